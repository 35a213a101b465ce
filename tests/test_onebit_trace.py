"""benchmarks/onebit_trace.py, the per-step trace of benchmarks/onebit.py (``--trace``): its
phase labels follow each optimizer's schedule and its numbers are the hand-computed ones,
in one process (the trace reads rank 0's optimizer; the loss average is skipped there)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.onebit import _note_variance_sampling
from benchmarks.onebit_trace import StepTrace
from fsdpx.onebit_adam import OneBitAdam
from fsdpx.zero_one_adam import ZeroOneAdam

SHAPE = (5, 7)


def _grads(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    out = [torch.randn(SHAPE, generator=g) for _ in range(steps)]
    for grad in out:
        grad[0, 0] = 0.0  # never a gradient: v stays exactly 0 there
    return out


def _trace(opt: torch.optim.Optimizer, p: torch.nn.Parameter, steps: int) -> list[dict[str, Any]]:
    tracer = StepTrace("x", opt, [("p", p)])
    for grad in _grads(steps):
        p.grad = grad.clone()
        tracer.before_step()
        opt.step()
        tracer.after_step(torch.tensor(2.5))
    return tracer.records


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.linspace(-1, 1, math.prod(SHAPE)).view(SHAPE))


def test_zero_one_adam_trace_follows_its_schedule() -> None:
    p = _param()
    # The schedule of tests/test_zero_one_adam.py: variance steps 1, 2, 4; frozen from 5,
    # syncs at 5, 6, then every 2nd step.
    opt = ZeroOneAdam(
        [p], lr=1e-2, var_freeze_step=4, var_update_scaler=1, local_step_scaler=2,
        local_step_clipper=2,
    )  # fmt: skip
    records = _trace(opt, p, 9)
    assert [r["phase"] for r in records] == [
        "variance", "variance", "compressed", "variance", "sync", "sync", "local", "sync",
        "local",
    ]  # fmt: skip
    assert [r["var_updates"] for r in records] == [1, 2, 2, 3, 3, 3, 3, 3, 3]
    g = _grads(9)
    # After one variance update the corrected v_hat is g^2: sqrt(v_hat) = |g|.
    assert math.isclose(records[0]["sqrt_v_hat"], float(g[0].abs().mean()), rel_tol=1e-6)
    # Frozen from step 4 on: the same number every step after.
    assert len({r["sqrt_v_hat"] for r in records[3:]}) == 1
    # Step 1 is m_hat / sqrt(v_hat) = sign(g) except (0, 0): RMS sqrt(34/35), max 1.
    assert math.isclose(records[0]["update_rms"], math.sqrt(34 / 35), rel_tol=1e-5)
    assert math.isclose(records[0]["update_max"], 1.0, rel_tol=1e-5)
    assert math.isclose(records[0]["update_median"], 1.0, rel_tol=1e-5)
    assert records[0]["update_max_at"] == "p"
    assert records[0]["update_max_sqrt_v_hat"] in {float(x) for x in g[0].abs().flatten()}
    assert records[0]["v_zero"] == 1 / 35
    assert math.isclose(records[0]["grad_ms"], float(g[0].square().mean()), rel_tol=1e-6)
    assert all(r["loss"] == 2.5 and r["lr"] == 1e-2 for r in records)
    assert [r["step"] for r in records] == list(range(1, 10))


def test_onebit_adam_and_adam_traces() -> None:
    p = _param()
    records = _trace(OneBitAdam([p], lr=1e-2, freeze_step=3), p, 5)
    assert [r["phase"] for r in records] == ["fp32"] * 3 + ["compressed"] * 2
    assert [r["var_updates"] for r in records] == [1, 2, 3, 3, 3]
    q = _param()
    adam = torch.optim.Adam([q], lr=1e-2)
    records = _trace(adam, q, 3)
    assert [r["phase"] for r in records] == ["fp32"] * 3
    assert [r["var_updates"] for r in records] == [1, 2, 3]
    v = adam.state[q]["exp_avg_sq"] / (1 - 0.999**3)
    assert math.isclose(records[-1]["sqrt_v_hat"], float(v.sqrt().mean()), rel_tol=1e-6)


def test_trace_names_the_largest_update(tmp_path: Path) -> None:
    a, b = _param(), _param()
    # Step 1 of Adam is lr * sign(g): b's group takes 20x the steps, reported in units of
    # the first group's lr.
    groups: list[dict[str, Any]] = [{"params": [a]}, {"params": [b], "lr": 2e-1}]
    adam = torch.optim.Adam(groups, lr=1e-2)
    tracer = StepTrace("x", adam, [("a", a), ("b", b)])
    a.grad, b.grad = _grads(2)
    tracer.before_step()
    adam.step()
    tracer.after_step(torch.tensor(1.0))
    (record,) = tracer.records
    assert record["update_max_at"] == "b"
    assert math.isclose(record["update_max"], 20.0, rel_tol=1e-5)
    assert math.isclose(record["update_median"], 1.0, rel_tol=1e-5)
    assert math.isclose(record["update_wild"], 34 / 70, rel_tol=1e-6)  # b with a gradient
    by_tensor = tracer.by_tensor()["sqrt_v_hat_by_tensor"]
    for name, g in (("a", a.grad), ("b", b.grad)):  # one update: sqrt(v_hat) = |g|
        assert g is not None
        assert math.isclose(by_tensor[name], float(g.abs().mean()), rel_tol=1e-6)
    tracer.write(str(tmp_path / "t.jsonl"))
    lines = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert lines == [record, tracer.by_tensor()]


def test_benchmark_says_how_zero_one_adam_samples_the_warmup(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # DeepSpeed's default 16 at freeze 80: samples at 1..16, 18..48 by 2, 52..80 by 4.
    _note_variance_sampling(80, 16)
    out = capsys.readouterr().out
    assert "40 variance samples in 80 warmup steps" in out
    assert "doubles 2 times" in out and "--var-update-scaler 27 or more" in out
    # 27: the second doubling would come at step 81, after the freeze.
    _note_variance_sampling(80, 27)
    out = capsys.readouterr().out
    assert "54 variance samples" in out and "doubles 1 times" in out
    assert "--var-update-scaler" not in out
