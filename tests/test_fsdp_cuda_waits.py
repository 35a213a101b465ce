"""FSDP2's all-gather / reduce-scatter waits on CUDA as CUDA event pairs
(fsdpx/comm/fsdp_events.py [Note: CUDA waits]).

Default tier (CPU): the wrapper is installed only where CUDA is available, the methods it
wraps exist on torch's FSDP parameter groups (a torch upgrade that renames them fails
here, not silently), wrapping is idempotent, and a wrapped group trains exactly as an
unwrapped one while the clock is not on CUDA.

GPU tier: `pytest -m gpu tests/test_fsdp_cuda_waits.py` on a machine with a GPU (one
process, a one-rank NCCL group): every record's `comm_wait_s` is a float from the event
pairs, inside the compute spans, and one pair is recorded per wrapped call.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

import fsdpx
from fsdpx.comm import fsdp_events
from fsdpx.comm.fsdp_groups import param_groups
from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.protocol import COMM_SPLIT_FIELDS
from tests.parity import LR, TINY, make_model


def _fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


VOCAB, BLOCK = TINY.vocab_size, TINY.block_size


def _train(engine: fsdpx.Engine, steps: int, device: str = "cpu") -> list[float]:
    vocab, block = VOCAB, BLOCK
    g = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (2, block), generator=g).to(device)
        y = torch.randint(0, vocab, (2, block), generator=g).to(device)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def test_cuda_wait_timing_is_installed_only_with_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = fsdpx.Config.from_dict({"optimizer": {"type": "adamw", "lr": LR}})
    torch.manual_seed(0)
    plain = fsdpx.shard(make_model(), cfg)
    modules = _fsdp_modules(plain.module)
    if not torch.cuda.is_available():  # this CPU machine: nothing was wrapped
        for m in modules:
            for group in param_groups(m._get_fsdp_state()):
                assert not any(n in vars(group) for n in fsdp_events.WAIT_METHODS)
    # As on a CUDA machine: every group's wait methods wrapped once, however often asked.
    torch.manual_seed(0)
    wrapped = fsdpx.shard(make_model(), cfg)
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        for m in _fsdp_modules(wrapped.module):
            assert fsdp_events.attach(m) == 1
            assert fsdp_events.attach(m) == 1  # again: still one wrapper per method
    for m in _fsdp_modules(wrapped.module):
        for group in param_groups(m._get_fsdp_state()):
            for name in fsdp_events.WAIT_METHODS:
                method = vars(group)[name]
                assert method.fsdpx_cuda_timed
                assert not getattr(method.__wrapped__, "fsdpx_cuda_timed", False)
    # The clock is not on CUDA here: the wrappers pass through, training is unchanged.
    assert _train(wrapped, 2) == _train(plain, 2)


@pytest.mark.gpu
def test_fsdp_waits_are_cuda_event_pairs(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from fsdpx.telemetry.phases import phase_clock

    log_path = tmp_path / "run.tlm"
    cfg = fsdpx.Config.from_dict(
        {
            "device": "cuda",
            "zero": {"stage": 3},
            "optimizer": {"type": "adamw", "lr": LR},
            "telemetry": {
                "enabled": True,
                "relay": str(tmp_path / "r.sock"),
                "log_path": str(log_path),
                "measure_flops": False,
            },
        }
    )
    torch.manual_seed(0)
    engine = fsdpx.shard(make_model(), cfg)
    # param_groups: torch 2.11 keeps one group per state, 2.13 a list (fsdp_groups.py).
    groups = [g for m in _fsdp_modules(engine.module) for g in param_groups(m._get_fsdp_state())]
    assert groups and all(
        vars(g)[n].fsdpx_cuda_timed for g in groups for n in fsdp_events.WAIT_METHODS
    )
    # Count the pairs the wrappers add in one step (the clock is on: a publisher runs).
    clock = phase_clock()
    pairs: list[int] = []
    real = clock.add_events

    def spy(phase: int, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        pairs.append(phase)
        real(phase, start, end)

    clock.add_events = spy  # type: ignore[method-assign]
    try:
        _train(engine, 4, "cuda")
    finally:
        clock.add_events = real  # type: ignore[method-assign]
    from fsdpx.telemetry.phases import COMM_WAIT

    assert pairs.count(COMM_WAIT) >= 4 * len(groups)  # each group waits for its unshard
    assert engine.telemetry is not None
    engine.telemetry.close()
    engine.close()
    records = [r for m in iter_log(log_path) if m["type"] == "records" for r in m["records"]]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        comm = r["comm_wait_s"]
        assert isinstance(comm, float) and comm >= 0.0, r
        assert comm <= r["forward_s"] + r["backward_s"] + r["optimizer_s"], r
        # The same pairs, by the span open when they were recorded ([Note: comm wait by
        # phase] in fsdpx/telemetry/phases.py): every FSDP wait point of the engine's loop
        # lies in forward or backward, so the split adds up to the whole.
        split = [r[f] for f in COMM_SPLIT_FIELDS]
        assert all(isinstance(v, float) and v >= 0.0 for v in split), r
        assert math.isclose(sum(split), comm, rel_tol=1e-6, abs_tol=1e-9), r
        for phase in ("forward", "backward", "optimizer"):
            assert r[f"comm_wait_{phase}_s"] <= r[f"{phase}_s"] * (1 + 1e-6), (phase, r)
