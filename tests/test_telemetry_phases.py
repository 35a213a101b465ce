"""Per-step phase times (fsdpx/telemetry/phases.py [Note: phase spans]) and
`fsdpx.telemetry.timed_loader`: the record fields a real engine fills, what the clock does
with telemetry off, no double counting between timed_loader and train_batch, and one real
3-rank run whose rank 1 has a slow data loader: a monitor connected to the relay reaches
the state "rank 1 is a chronic straggler in data wait" (waited for, never timed); and FSDP's
own all-gathers / reduce-scatters in `comm_wait_s` (fsdpx/comm/fsdp_slot.py [Note: timing
FSDP's waits]): a rank late to them shows as the other rank's comm wait."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdpx
import fsdpx.telemetry
from fsdpx.telemetry import phases
from fsdpx.telemetry.phases import (
    BACKWARD,
    COMM_WAIT,
    DATA_WAIT,
    FORWARD,
    OPTIMIZER,
    PhaseClock,
    next_batch,
    phase_clock,
)
from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.protocol import COMM_SPLIT_FIELDS, PHASE_FIELDS, RECORD_FIELDS
from fsdpx.telemetry.wire.relay import Relay
from monitor.app import MonitorApp
from monitor.model import MonitorModel
from tests import telemetry_bodies
from tests.dist import run_ranks
from tests.parity import LR, make_model


@pytest.fixture
def ticking_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[PhaseClock]:
    """The phase clock, enabled, with a perf_counter that advances 1.0 per read: every
    timed span is exactly 1 s, so counts are checked without measuring anything."""
    ticks = itertools.count()
    monkeypatch.setattr(phases.time, "perf_counter", lambda: float(next(ticks)))
    clock = phase_clock()
    clock.enable(torch.device("cpu"))
    clock.take()
    yield clock
    clock.disable()


def test_timed_loader_counts_each_wait_once(ticking_clock: PhaseClock) -> None:
    loader = fsdpx.telemetry.timed_loader([1, 2, 3])
    assert len(loader) == 3 and list(loader) == [1, 2, 3]  # 3 batches + the end: 4 waits
    assert ticking_clock.take().seconds[DATA_WAIT] == 4.0
    it = iter(loader)
    assert next_batch(it) == 1  # train_batch's read of a timed_loader: not counted twice
    assert ticking_clock.take().seconds[DATA_WAIT] == 1.0
    assert next_batch(iter([5])) == 5  # a plain iterator: train_batch counts it
    assert ticking_clock.take().seconds[DATA_WAIT] == 1.0


def test_comm_waits_are_split_by_the_span_open_while_they_were_timed(
    ticking_clock: PhaseClock,
) -> None:
    # [Note: comm wait by phase]: each timed wait also counts for the span open then.
    clock = ticking_clock
    clock.end(COMM_WAIT, clock.begin(COMM_WAIT))  # between steps: no span open (1 s)
    token = clock.begin(FORWARD)
    clock.end(COMM_WAIT, clock.begin(COMM_WAIT))  # 1 s
    clock.add(COMM_WAIT, 2.0)  # FSDP's slot, measured elsewhere
    clock.end(FORWARD, token)
    token = clock.begin(BACKWARD)
    clock.add(COMM_WAIT, 4.0)
    clock.end(BACKWARD, token)
    clock.add(COMM_WAIT, 8.0)  # after backward: no span open
    clock.end(OPTIMIZER, clock.begin(OPTIMIZER))  # an optimizer step with no wait
    fields = dict(
        zip(PHASE_FIELDS + COMM_SPLIT_FIELDS, clock.take().seconds_per_phase(), strict=True)
    )
    assert fields["comm_wait_s"] == 1.0 + 1.0 + 2.0 + 4.0 + 8.0
    assert fields["comm_wait_forward_s"] == 3.0
    assert fields["comm_wait_backward_s"] == 4.0
    assert fields["comm_wait_optimizer_s"] == 0.0  # the span ran: 0, not nil
    # A step where no span was timed (a loop without the engine): the split is nil.
    clock.add(COMM_WAIT, 1.0)
    fields = dict(
        zip(PHASE_FIELDS + COMM_SPLIT_FIELDS, clock.take().seconds_per_phase(), strict=True)
    )
    assert fields["comm_wait_s"] == 1.0
    assert [fields[f] for f in COMM_SPLIT_FIELDS] == [None, None, None]
    # A span a raise left open does not claim the next step's waits.
    clock.begin(FORWARD)
    clock.take()
    clock.add(COMM_WAIT, 1.0)
    assert clock.take().comm_in == [None, None, None]


def test_clock_off_measures_nothing() -> None:
    clock = PhaseClock()
    assert clock.begin(DATA_WAIT) is None
    clock.add(DATA_WAIT, 1.0)
    assert clock.take().seconds == [None] * len(PHASE_FIELDS)
    clock.enable(torch.device("cpu"))
    clock.enable(torch.device("cpu"))  # two publishers in one process
    clock.disable()
    assert clock.enabled
    clock.disable()
    assert not clock.enabled


def test_engine_records_carry_phase_times(tmp_path: Path) -> None:
    log_path = tmp_path / "run.tlm"
    cfg = fsdpx.Config.from_dict(
        {
            "optimizer": {"type": "adamw", "lr": LR},
            "telemetry": {
                "enabled": True,
                "relay": str(tmp_path / "r.sock"),
                "log_path": str(log_path),
            },
        }
    )
    model = make_model()
    vocab, block = model.config.vocab_size, model.config.block_size
    engine = fsdpx.shard(model, cfg)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randint(0, vocab, (2, block), generator=g),
            torch.randint(0, vocab, (2, block), generator=g),
        )
        for _ in range(3)
    ]
    it = iter(fsdpx.telemetry.timed_loader(batches))
    for _ in range(3):
        engine.train_batch(it)
    assert engine.telemetry is not None
    engine.telemetry.close()
    records = [r for m in iter_log(log_path) if m["type"] == "records" for r in m["records"]]
    assert len(records) == 3
    for r in records:
        timed = PHASE_FIELDS + COMM_SPLIT_FIELDS
        assert tuple(r) == RECORD_FIELDS and tuple(r)[-len(timed) :] == timed
        for name in ("data_wait_s", "forward_s", "backward_s", "optimizer_s"):
            assert isinstance(r[name], float) and r[name] >= 0.0, (name, r[name])
        # One process: no collective went through fsdpx.comm; CPU: no host-to-device copy.
        assert r["comm_wait_s"] is None and r["h2d_s"] is None
        # The engine's spans ran with no wait inside them: 0.0, not nil.
        assert [r[f] for f in COMM_SPLIT_FIELDS] == [0.0, 0.0, 0.0]
    assert not phase_clock().enabled  # the publisher's close turned the clock off


def test_a_late_rank_is_the_other_ranks_fsdp_comm_wait() -> None:
    """Rank 1 late to the first half's FSDP collectives, rank 0 to the second's (a slow
    loader: its own data wait): the punctual ranks' comm wait is the larger in each half.
    Orderings of totals over a half (the injected lateness, 0.5 s a step, dwarfs what load
    does to a tiny model's collectives), no thresholds. Then rank 2 sleeps at the start of
    its forward: the others wait for it inside their own forward, and the monitor names
    rank 2, by the comm wait each rank recorded inside its forward."""
    results = run_ranks(telemetry_bodies.slow_before_fsdp_collectives, 3)
    per_rank = [steps for steps, _, _ in results]
    n = telemetry_bodies.FSDP_WAIT_STEPS
    for steps in per_rank:
        assert len(steps) == 2 * n + telemetry_bodies.SLOW_FORWARD_STEPS
        for s in steps:
            comm = s[COMM_WAIT]
            # FSDP's collectives are timed (no fsdpx.comm collective runs here: without the
            # slot's timing this is None), and they lie inside the compute spans.
            assert comm is not None
            assert 0.0 < comm <= s[FORWARD] + s[BACKWARD] + s[OPTIMIZER], s

    def total(rank: int, phase: int, half: int) -> float:
        return sum(s[phase] or 0.0 for s in per_rank[rank][half * n : (half + 1) * n])

    for half, late in ((0, 1), (1, 0)):
        for punctual in {0, 1, 2} - {late}:
            assert total(late, DATA_WAIT, half) > total(punctual, DATA_WAIT, half)
            assert total(punctual, COMM_WAIT, half) > total(late, COMM_WAIT, half), per_rank
    # Each slot call is one span (every span lasts 1 s on the ticking clock): a synchronous
    # collective is its wait, an asynchronous one waits in work.wait() and not when issued,
    # and a quantized slot counts only its one collective (the comm layer times it), not
    # the quantize / dequantize around it: nothing is counted twice.
    for _, _, spans in results:
        assert spans == {
            "all_gather": 1.0,
            "all_gather_issued": None,
            "all_gather_waited": 1.0,
            "reduce_scatter": 1.0,
            "qwz": 1.0,
            "qgz": 1.0,
        }
    _slow_forward_is_named(results, 2 * n)


def _slow_forward_is_named(results: list[Any], first: int) -> None:
    """The records of the slow-forward steps (from `first` on), as the publisher fills
    them, through the monitor's scorer: SLOW_FORWARD_RANK is the one chronic straggler,
    in forward. Without the split (an older publisher's records) it sits at the median:
    every rank's forward time includes the slow rank's sleep."""
    slow = telemetry_bodies.SLOW_FORWARD_RANK
    fields = PHASE_FIELDS + COMM_SPLIT_FIELDS

    def records(rank: int, split: bool) -> list[dict[str, Any]]:
        values, step_times, _ = results[rank]
        out = []
        for step, (v, st) in enumerate(zip(values[first:], step_times[first:], strict=True)):
            rec = {"rank": rank, "host": "h", "step": step + 1, "step_time_s": st}
            rec.update(zip(fields, v, strict=True))
            if not split:
                for f in COMM_SPLIT_FIELDS:
                    del rec[f]
            out.append(rec)
        return out

    def chronic(split: bool) -> dict[int, str]:
        model = MonitorModel()
        model.add_events(
            [{"rank": r, "kind": "start", "step": 0, "detail": {"world_size": 3}} for r in range(3)]
        )
        by_rank = [records(r, split) for r in range(3)]
        for step_records in zip(*by_rank, strict=True):
            model.add_records(list(step_records), now=0.0)
        rows = {r: model.stragglers.row(r) for r in range(3)}
        return {r: row.phase for r, row in rows.items() if row is not None and row.chronic}

    # The waits happened inside forward: the waiting ranks' comm wait there is the larger.
    fwd = COMM_SPLIT_FIELDS.index("comm_wait_forward_s") + len(PHASE_FIELDS)
    waited = {r: sum(v[fwd] for v in results[r][0][first:]) for r in range(3)}
    assert all(waited[r] > waited[slow] for r in range(3) if r != slow), waited
    assert chronic(split=True) == {slow: "forward"}
    assert chronic(split=False).get(slow) != "forward"


@pytest.mark.slow  # ~35 s of 4 gloo ranks on 2 busy cores; default-tier twins: the
# synthetic stream through the app (tests/test_monitor_stragglers.py), the one-process
# engine records and the 3-rank records through the scorer above.
def test_slow_data_loader_and_slow_forward_are_flagged_live(tmp_path: Path) -> None:
    """4 ranks with publishers, a relay and a monitor: rank 1's loader is slow, rank 2
    sleeps at the start of its forward; the monitor names both, chronic, each with its
    phase, and neither rank 0 nor rank 3, which waited for them."""
    relay = Relay(str(tmp_path / "relay.sock"), log_path=tmp_path / "run.tlm")
    address = str(relay.bind())
    relay.start_thread()
    try:
        steps = telemetry_bodies.SLOW_LOADER_STEPS
        sent = run_ranks(telemetry_bodies.slow_data_loader, 4, (address, steps))
        assert sent == [steps] * 4
        asyncio.run(_monitor_flags_the_slow_ranks(address))
    finally:
        relay.stop()


def _flag(app: MonitorApp, rank: int) -> Any:
    return app.model.stragglers.row(rank)


async def _monitor_flags_the_slow_ranks(address: str) -> None:
    # The relay's history brings every record to a monitor that connects after the run.
    app = MonitorApp(sources=[address])
    expected = {
        telemetry_bodies.SLOW_RANK: "data_wait",
        telemetry_bodies.SLOW_FORWARD_RANK: "forward",
    }

    def chronic() -> dict[int, str]:
        rows = {r: _flag(app, r) for r in range(4)}
        return {r: row.phase for r, row in rows.items() if row is not None and row.chronic}

    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(1000):  # until the state is reached; the bound only ends a failure
            if set(chronic()) >= set(expected):
                break
            await pilot.pause(0.02)
        assert chronic() == expected, {r: _flag(app, r) for r in range(4)}
        events = [e for e in app.model.events if e.get("kind") == "straggler"]
        assert sorted((e["rank"], e["detail"]["phase"]) for e in events) == sorted(expected.items())


def test_a_span_a_raise_left_open_does_not_claim_later_waits_of_its_step() -> None:
    # A forward that raises (a bad batch, caught by the user's loop, which then goes on:
    # evaluates, saves a checkpoint, retries) must not leave FORWARD open: waits timed
    # after it, outside any span, count in comm_wait_s only, not in comm_wait_forward_s
    # (which would then exceed the forward time it is part of). Review rev6.
    model = make_model()
    vocab = model.config.vocab_size
    engine = fsdpx.shard(model, fsdpx.Config.from_dict({"optimizer": {"lr": LR}}))
    clock = phase_clock()
    clock.enable(torch.device("cpu"))
    try:
        clock.take()
        bad = torch.full((1, 4), vocab + 5)  # token ids past the embedding: IndexError
        with pytest.raises(IndexError):
            engine(bad, bad)
        clock.add(COMM_WAIT, 1.0)  # e.g. FSDP's gathers of a checkpoint save
        got = clock.take()
        assert got.seconds[COMM_WAIT] == 1.0
        assert got.comm_in == [None, None, None]
    finally:
        clock.disable()
