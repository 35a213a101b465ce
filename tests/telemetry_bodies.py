"""Per-rank bodies of the telemetry tests (module level, so spawned ranks can import them)."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist

import fsdpx
from fsdpx.demo.gpt import shard_batch
from tests.parity import LR, global_batches, make_model

E2E_STEPS = 6
E2E_GAS = 2


def train_with_and_without_telemetry(
    rank: int, world_size: int, relay: str, steps: int, gas: int
) -> dict[str, Any]:
    """Train the tiny GPT twice on the same data and seed, telemetry off then on.

    Returns this rank's per-step losses of both runs (the mean of the step's micro-batch
    losses on this rank, as the publisher defines `loss`), the publisher's drop counter,
    its measured FLOPs and collective bytes per step.
    """
    out: dict[str, Any] = {}
    for enabled in (False, True):
        cfg = fsdpx.Config.from_dict(
            {
                "gradient_accumulation_steps": gas,
                "gradient_clipping": 1.0,
                "optimizer": {"type": "adamw", "lr": LR},
                "scheduler": {"type": "WarmupLR", "warmup_num_steps": 4, "warmup_type": "linear"},
                "telemetry": {
                    "enabled": enabled,
                    "relay": relay,
                    "start_relay": False,
                    "poll_interval_s": 0.05,
                    "tokens_per_step": 128,
                    "run_id": "e2e",
                },
            }
        )
        engine = fsdpx.shard(make_model(), cfg)
        losses, lrs = [], []
        for micro in global_batches(steps, gas):
            lrs.append(engine.get_lr()[0])
            step_losses = []
            for x, y in micro:
                loss = engine(shard_batch(x, rank, world_size), shard_batch(y, rank, world_size))
                engine.backward(loss)
                engine.step()
                step_losses.append(loss.detach().float())
            losses.append(float(torch.stack(step_losses).mean()))
        key = "on" if enabled else "off"
        out[f"losses_{key}"] = losses
        out["lrs"] = lrs
        if engine.telemetry is not None:
            pub = engine.telemetry
            pub.event("checkpoint_saved", step=steps, detail={"path": "ckpt", "bytes": 1})
            pub.close()
            out["dropped"] = pub.dropped
            out["records_sent"] = pub.stats.records_sent
            out["flops"] = pub._meter.flops_per_step
            out["comm_bytes"] = pub._meter.comm_bytes_per_step
        dist.barrier()
    return out


RUNS_STEPS = 4


def two_runs_into_one_relay(rank: int, world_size: int, relay: str) -> list[str]:
    """Two launches of one job on these ranks, one after the other, into one relay: each
    agrees on its run id as `fsdpx.shard` does (start.agree_run) and publishes RUNS_STEPS
    steps through a real Publisher. Returns this rank's run ids, in launch order."""
    from fsdpx.config import TelemetryConfig
    from fsdpx.distributed import DistInfo
    from fsdpx.engine import StepResult
    from fsdpx.telemetry.publisher import Publisher
    from fsdpx.telemetry.start import agree_run

    cfg = TelemetryConfig(
        enabled=True, relay=relay, start_relay=False, poll_interval_s=0.02, job="nightly"
    )
    info = DistInfo(rank, world_size, rank, torch.device("cpu"))
    model = torch.nn.Linear(2, 1)
    engine = types.SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    run_ids = []
    for launch in range(2):
        run = agree_run(cfg, info)
        pub = Publisher(
            cfg,
            rank=rank,
            local_rank=rank,
            world_size=world_size,
            device=torch.device("cpu"),
            install_hooks=False,
            run=run,
        )
        for step in range(1, RUNS_STEPS + 1):
            pub.observe_loss(torch.tensor(float(10 * launch + step)))
            pub.on_step(engine, StepResult(step, False, None, 1.0))
        if launch == 0:
            pub.record_exception(RuntimeError("first launch failed"), step=RUNS_STEPS)
        pub.close(reason="exception" if launch == 0 else "closed")
        run_ids.append(run.run_id)
        dist.barrier()
    return run_ids


def _train(engine: fsdpx.Engine, rank: int, world_size: int, *, steps: int) -> None:
    for micro in global_batches(steps, 1):
        for x, y in micro:
            loss = engine(shard_batch(x, rank, world_size), shard_batch(y, rank, world_size))
            engine.backward(loss)
            engine.step()


def save_and_load_with_telemetry(
    rank: int, world_size: int, relay: str, root: str
) -> dict[str, Any]:
    """Two launches with telemetry on into `relay`: one saves synchronously (tag "sync",
    after 2 steps), trains a step and loads it back; one saves in the background (tag
    "async", after 2 steps), waits for the commit and loads `latest`. Returns, for the
    test to check the events against: the global steps after each load, and on rank 0
    the async checkpoint's MANIFEST mtime (the event must come after the commit)."""
    import os

    from checkpoint_tools.format import MANIFEST_NAME

    out: dict[str, Any] = {}
    for mode in ("sync", "async"):
        cfg = fsdpx.Config.from_dict(
            {
                "optimizer": {"type": "adamw", "lr": LR},
                "checkpoint": {"async_save": mode == "async"},
                "telemetry": {
                    "enabled": True,
                    "relay": relay,
                    "start_relay": False,
                    "poll_interval_s": 0.05,
                    "run_id": f"ckpt-{mode}",
                },
            }
        )
        engine = fsdpx.shard(make_model(), cfg)

        _train(engine, rank, world_size, steps=2)
        engine.save_checkpoint(root, tag=mode)
        if mode == "async":
            engine.wait_for_checkpoint()
            if rank == 0:
                out["async_manifest_mtime"] = os.stat(
                    os.path.join(root, mode, MANIFEST_NAME)
                ).st_mtime
            engine.load_checkpoint(root)  # `latest`: the async one
        else:
            _train(engine, rank, world_size, steps=1)
            engine.load_checkpoint(root, tag=mode)
        out[f"{mode}_step_after_load"] = engine.global_steps
        assert engine.telemetry is not None
        engine.telemetry.close()
        dist.barrier()
    return out


SLOW_RANK = 1
SLOW_LOADER_STEPS = 10


class _SlowLoader:
    """A data loader whose batches take `delay_s` to arrive (the injected straggler: a
    slow loader is the cause under test, not a way to wait for something)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], delay_s: float) -> None:
        self.batches, self.delay_s = batches, delay_s

    def __iter__(self) -> Any:
        import time

        for batch in self.batches:
            if self.delay_s:
                time.sleep(self.delay_s)
            yield batch

    def __len__(self) -> int:
        return len(self.batches)


def slow_data_loader(rank: int, world_size: int, relay: str, steps: int) -> int:
    """Train the tiny GPT for `steps` steps with telemetry on, reading batches through
    `fsdpx.telemetry.timed_loader`; rank SLOW_RANK's loader takes 0.1 s per batch, and
    rank SLOW_FORWARD_RANK (when there is one) sleeps 0.15 s at the start of each forward
    (a root forward pre-hook: the others wait for it in their forward's all-gathers).
    Returns the records sent."""
    import time

    from fsdpx.demo.gpt import GPT

    cfg = fsdpx.Config.from_dict(
        {
            "optimizer": {"type": "adamw", "lr": LR},
            "telemetry": {
                "enabled": True,
                "relay": relay,
                "start_relay": False,
                "poll_interval_s": 0.05,
                "run_id": "slow-loader",
                "measure_flops": False,
            },
        }
    )
    model = make_model()
    assert isinstance(model, GPT)
    vocab, block = model.config.vocab_size, model.config.block_size
    g = torch.Generator().manual_seed(rank)
    batches = [
        (
            torch.randint(0, vocab, (2, block), generator=g),
            torch.randint(0, vocab, (2, block), generator=g),
        )
        for _ in range(steps)
    ]
    engine = fsdpx.shard(model, cfg)
    if rank == SLOW_FORWARD_RANK:
        model.register_forward_pre_hook(lambda module, args: time.sleep(0.15))
    loader = _SlowLoader(batches, 0.1 if rank == SLOW_RANK else 0.0)
    for x, y in fsdpx.telemetry.timed_loader(loader):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
    pub = engine.telemetry
    assert pub is not None
    pub.close()
    dist.barrier()
    return pub.stats.records_sent


def _elsewhere(release: Any) -> None:
    """Where rank 1 is while rank 0 waits for it in a collective: until the test, having
    seen both ranks' dumps, creates the `release` file (a state, polled)."""
    import time

    while not release.exists():
        time.sleep(0.02)


def skip_a_collective(rank: int, world_size: int, relay: str, release: str) -> float:
    """Two steps with telemetry on, then rank 0 enters an fsdpx.comm all-reduce while rank
    1 stays in `_elsewhere` until the test releases it; then rank 1 arrives, the
    all-reduce completes and a third step runs (the dump must not harm the run).
    Returns the all-reduced value (world_size on every rank)."""
    from pathlib import Path

    import fsdpx.comm

    cfg = fsdpx.Config.from_dict(
        {
            "optimizer": {"type": "adamw", "lr": LR},
            "telemetry": {
                "enabled": True,
                "relay": relay,
                "start_relay": False,
                "poll_interval_s": 0.05,
                "run_id": "hang",
                "measure_flops": False,
            },
        }
    )
    model = make_model()
    vocab, block = model.config.vocab_size, model.config.block_size
    engine = fsdpx.shard(model, cfg)
    g = torch.Generator().manual_seed(rank)

    def step() -> None:
        x = torch.randint(0, vocab, (2, block), generator=g)
        engine.backward(engine(x, x))
        engine.step()

    step()
    step()
    t = torch.ones(4)
    if rank == 1:
        _elsewhere(Path(release))
    else:
        # The log numbers FSDP's collectives too (fsdpx owns its comm slot): the test reads
        # which number the all-reduce gets.
        seq = Path(release).with_name("all_reduce_seq")
        seq.with_suffix(".tmp").write_text(str(fsdpx.comm.comm_log().mark()))
        seq.with_suffix(".tmp").rename(seq)
    fsdpx.comm.all_reduce(t)
    step()
    pub = engine.telemetry
    assert pub is not None
    pub.close()
    dist.barrier()
    return float(t[0])


FSDP_WAIT_STEPS = 3
"""Steps per half of `slow_before_fsdp_collectives`: rank 1 is slow in the first half,
rank 0 in the second."""
FSDP_WAIT_DELAY_S = 0.5
SLOW_FORWARD_RANK = 2
"""The rank that, in the last part of `slow_before_fsdp_collectives`, sleeps at the start
of its forward (after the root module's all-gather, before its blocks')."""
SLOW_FORWARD_STEPS = 6
"""Steps of that part: enough for a chronic straggler (five slow steps in a row)."""
SLOW_FORWARD_DELAY_S = 0.25


class _LateLoader:
    """Batches from `batches`, each after `delays[i]` seconds (the injected slowness)."""

    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], delays: list[float]):
        self.batches, self.delays = batches, delays

    def __iter__(self) -> Any:
        import time

        for batch, delay in zip(self.batches, self.delays, strict=True):
            if delay:
                time.sleep(delay)
            yield batch


def _slot_spans() -> dict[str, float | None]:
    """The comm wait each of fsdpx's FSDP slots adds for one call, with a clock whose
    every span is exactly 1 s (perf_counter ticks 1.0 per read): counts, not times."""
    import itertools
    import time

    from fsdpx.comm.fsdp_slot import (
        CountedAllGather,
        CountedReduceScatter,
        QuantizedAllGather,
        QuantizedReduceScatter,
    )
    from fsdpx.telemetry.phases import COMM_WAIT, phase_clock

    group = dist.group.WORLD
    assert group is not None
    w = dist.get_world_size()
    clock, ticks, real = phase_clock(), itertools.count(), time.perf_counter
    inp, out, piece = torch.ones(4 * w), torch.empty(4 * w * w), torch.empty(4)
    spans: dict[str, float | None] = {}
    clock.enable(torch.device("cpu"))
    time.perf_counter = lambda: float(next(ticks))  # this rank's process ends after
    try:
        clock.take()
        CountedAllGather()(out, inp, group)
        spans["all_gather"] = clock.take().seconds[COMM_WAIT]
        work = CountedAllGather()(out, inp, group, async_op=True)
        spans["all_gather_issued"] = clock.take().seconds[COMM_WAIT]
        assert isinstance(work, dist.Work)
        work.wait()
        spans["all_gather_waited"] = clock.take().seconds[COMM_WAIT]
        CountedReduceScatter()(piece, inp, group, dist.ReduceOp.SUM)
        spans["reduce_scatter"] = clock.take().seconds[COMM_WAIT]
        QuantizedAllGather("int8", 4)(out, inp, group)
        spans["qwz"] = clock.take().seconds[COMM_WAIT]
        QuantizedReduceScatter(8, 4)(piece, inp, group, dist.ReduceOp.SUM)
        spans["qgz"] = clock.take().seconds[COMM_WAIT]
    finally:
        time.perf_counter = real
        clock.disable()
    return spans


def slow_before_fsdp_collectives(
    rank: int, world_size: int
) -> tuple[list[list[float | None]], list[float], dict[str, float | None]]:
    """ZeRO-3 on the tiny GPT, the phase clock on (as a publisher turns it on), and one
    rank late to each step's FSDP collectives: rank 1 in the first FSDP_WAIT_STEPS steps,
    rank 0 in the next (a data loader that takes FSDP_WAIT_DELAY_S per batch), then, for
    SLOW_FORWARD_STEPS steps, SLOW_FORWARD_RANK at the start of its forward (a forward
    pre-hook on the root module sleeps SLOW_FORWARD_DELAY_S: the others wait for it in
    their forward's all-gathers). Returns this rank's per-step values of the record
    fields PHASE_FIELDS + COMM_SPLIT_FIELDS (`StepPhases.seconds_per_phase`, what the
    publisher puts in its records), each step's wall time (the record's step_time_s,
    from the end of the step before), and what each slot adds per call (`_slot_spans`)."""
    import time

    from fsdpx.telemetry.phases import phase_clock

    cfg = fsdpx.Config.from_dict({"optimizer": {"type": "adamw", "lr": LR}})
    model = make_model()
    vocab, block = model.config.vocab_size, model.config.block_size
    engine = fsdpx.shard(model, cfg)
    g = torch.Generator().manual_seed(rank)
    steps = 2 * FSDP_WAIT_STEPS + SLOW_FORWARD_STEPS
    batches = [
        (
            torch.randint(0, vocab, (2, block), generator=g),
            torch.randint(0, vocab, (2, block), generator=g),
        )
        for _ in range(steps)
    ]
    late_rank = [1] * FSDP_WAIT_STEPS + [0] * FSDP_WAIT_STEPS + [-1] * SLOW_FORWARD_STEPS
    late = [r == rank for r in late_rank]
    loader = _LateLoader(batches, [FSDP_WAIT_DELAY_S if x else 0.0 for x in late])
    slow_forward = False

    def sleep_first(module: torch.nn.Module, args: Any) -> None:
        if slow_forward:
            time.sleep(SLOW_FORWARD_DELAY_S)  # the injected slowness

    if rank == SLOW_FORWARD_RANK:
        # Registered after fsdpx.shard: FSDP's own pre-forward hook (the root's
        # all-gather) runs first, the blocks' all-gathers come after the sleep.
        model.register_forward_pre_hook(sleep_first)
    clock = phase_clock()
    clock.enable(torch.device("cpu"))
    clock.take()  # nothing before the first step
    out: list[list[float | None]] = []
    step_times: list[float] = []
    try:
        ended = time.perf_counter()
        for i, (x, y) in enumerate(fsdpx.telemetry.timed_loader(loader)):
            slow_forward = i >= 2 * FSDP_WAIT_STEPS
            engine.backward(engine(x, y))
            engine.step()
            out.append(clock.take().seconds_per_phase())
            step_times.append(time.perf_counter() - ended)
            ended = time.perf_counter()
    finally:
        clock.disable()
    dist.barrier()
    return out, step_times, _slot_spans()
