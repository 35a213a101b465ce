"""MoE telemetry: the records' moe_tokens / moe_dropped / moe_imbalance
(fsdpx/telemetry/moe_load.py, monitor/PROTOCOL.md "Mixture of experts"), one process.
The expert-parallel count (rows computed across ranks) is checked in
tests/test_moe_plan.py's 2-rank test."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

import fsdpx
from fsdpx.moe import MoE
from fsdpx.telemetry.moe_load import moe_load
from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.protocol import MOE_FIELDS, RECORD_FIELDS
from tests import moe_bodies as mb

# DeepSpeed's top-1 gate with a capacity that drops tokens: 12 tokens over 4 experts.
TOP1 = dict(num_experts=4, ep_size=1, k=1, capacity_factor=1.0, min_capacity=1, use_rts=False)


def _expected(model: torch.nn.Module) -> tuple[int, int, float]:
    """(rows kept, assignments dropped, worst layer's max/mean kept load) of the model's
    last forward, from each layer's exp_counts (chosen before dropping) and capacity."""
    kept_total = dropped = 0
    worst = 0.0
    for module in model.modules():
        if isinstance(module, MoE):
            counts = module.deepspeed_moe.exp_counts.tolist()
            cap = math.ceil(mb.SEQS * mb.TOKENS / len(counts) * 1.0)
            kept = [min(c, cap) for c in counts]
            kept_total += sum(kept)
            dropped += sum(counts) - sum(kept)
            worst = max(worst, max(kept) * len(kept) / sum(kept))
    return kept_total, dropped, worst


def test_records_carry_expert_load(tmp_path: Path) -> None:
    log_path = tmp_path / "run.tlm"
    cfg = fsdpx.Config.from_dict(
        {
            "optimizer": {"type": "adamw", "lr": mb.LR},
            "telemetry": {
                "enabled": True,
                "relay": str(tmp_path / "r.sock"),
                "log_path": str(log_path),
            },
        }
    )
    engine = fsdpx.shard(mb.make_model(TOP1), cfg)
    expected = []
    for step in mb.batches(1):
        x, y = step[0]
        engine.backward(mb.loss_of(engine, x, y))
        expected.append(_expected(engine.module))
        engine.step()
    assert engine.telemetry is not None
    engine.telemetry.close()
    records = [r for m in iter_log(log_path) if m["type"] == "records" for r in m["records"]]
    assert len(records) == mb.STEPS
    assert any(dropped > 0 for _, dropped, _ in expected)  # the capacity really drops
    for r, (kept, dropped, worst) in zip(records, expected, strict=True):
        assert tuple(r) == RECORD_FIELDS
        assert (r["moe_tokens"], r["moe_dropped"]) == (kept, dropped)
        assert math.isclose(r["moe_imbalance"], worst)


def test_recomputed_forward_is_not_counted_twice() -> None:
    moe = MoE(mb.HIDDEN, torch.nn.Linear(mb.HIDDEN, mb.HIDDEN), 4, k=2, capacity_factor=None)
    x = torch.randn(10, mb.HIDDEN, requires_grad=True)
    moe_load().take()
    out = checkpoint(lambda t: moe(t)[0], x, use_reentrant=False)
    out.sum().backward()  # runs the forward again
    fields = moe_load().take()
    assert fields["moe_tokens"] == 10 * 2 and fields["moe_dropped"] == 0
    assert set(MOE_FIELDS) == set(fields) and fields["moe_imbalance"] >= 1.0
    assert moe_load().take() == dict.fromkeys(MOE_FIELDS)  # no MoE layer ran since
