"""fsdpx.moe.MoE on one process: DeepSpeed's numbers, the dropless router, grouped expert
compute, and the constructor's errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from fsdpx.moe import MoE
from fsdpx.moe.router import capacity

FIXTURE = Path(__file__).parent / "data" / "moe" / "deepspeed_moe.safetensors"
DS_CASES: dict[str, dict[str, Any]] = {
    "top1": dict(k=1, capacity_factor=1.0, min_capacity=0, drop_tokens=False, use_rts=False),
    "top2_drop": dict(k=2, capacity_factor=0.5, min_capacity=1, drop_tokens=True, use_rts=False),
}
EXPERT_PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")


def _expert(hidden: int = 8, ffn: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, ffn), nn.GELU(), nn.Linear(ffn, hidden))


@pytest.mark.parametrize("case", sorted(DS_CASES))
def test_matches_deepspeed(case: str) -> None:
    """Output, l_aux, exp_counts and the input gradient equal deepspeed.moe.layer.MoE's on
    the same weights and tokens (tests/data/moe/make_deepspeed_moe.py made the file)."""
    data = load_file(FIXTURE)
    moe = MoE(8, _expert(), num_experts=4, top2_2nd_expert_sampling=False, **DS_CASES[case])
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight.copy_(data[f"{case}.gate"])
        for name in EXPERT_PARAMS:
            moe.deepspeed_moe.experts.expert.get_parameter(name).copy_(
                data[f"{case}.experts.{name}"]
            )
    x = data[f"{case}.x"].clone().requires_grad_()
    y, l_aux, counts = moe(x)
    (y * data[f"{case}.probe"]).sum().backward()
    torch.testing.assert_close(y, data[f"{case}.y"])
    torch.testing.assert_close(l_aux.reshape(1), data[f"{case}.l_aux"])
    assert counts.tolist() == data[f"{case}.exp_counts"].tolist()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, data[f"{case}.x_grad"])


def _dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Every expert on every token, then each token's top-k mix (no sorting, no dispatch)."""
    gate = moe.deepspeed_moe.gate
    flat = x.reshape(-1, x.shape[-1])
    scores = torch.softmax(flat @ gate.wg.weight.t(), dim=1)
    top, idx = torch.topk(scores, moe.k, dim=1)
    top = top / top.sum(dim=1, keepdim=True)
    experts = moe.deepspeed_moe.experts
    outs = []
    for e in range(moe.num_experts):
        params = {n: p[e] for n, p in experts.local_params().items()}
        outs.append(torch.func.functional_call(experts.expert, params, (flat,)))
    every = torch.stack(outs, dim=1)  # [tokens, experts, d]
    chosen = every.gather(1, idx.unsqueeze(-1).expand(-1, -1, flat.shape[1]))
    out = (chosen * top.unsqueeze(-1)).sum(1)
    assert moe.shared_expert is not None
    return out.reshape(x.shape) + moe.shared_expert(x)


@pytest.mark.parametrize("grouped", ["loop", "padded"])
def test_dropless_topk_with_shared_expert(grouped: str) -> None:
    torch.manual_seed(0)
    moe = MoE(
        8,
        _expert(),
        num_experts=6,
        k=3,
        capacity_factor=None,
        shared_expert=_expert(8, 4),
        grouped=grouped,  # type: ignore[arg-type]
        reinit_experts=True,
    )
    x = torch.randn(3, 5, 8)
    y, l_aux, counts = moe(x)
    torch.testing.assert_close(y, _dense_reference(moe, x))
    assert int(counts.sum()) == 15 * 3  # dropless: every token's k assignments
    assert l_aux.item() >= 1.0 - 1e-6  # the Switch loss is >= 1, equal when balanced


def test_grouped_loop_and_padded_agree_with_drops_and_grads() -> None:
    torch.manual_seed(0)
    results = []
    for grouped in ("loop", "padded"):
        torch.manual_seed(1)
        moe = MoE(
            8,
            _expert(),
            num_experts=4,
            k=2,
            capacity_factor=0.5,
            min_capacity=1,
            use_rts=False,
            top2_2nd_expert_sampling=False,
            grouped=grouped,  # type: ignore[arg-type]
            reinit_experts=True,
        )
        x = torch.randn(2, 12, 8, requires_grad=True)
        y, _, _ = moe(x)
        y.square().sum().backward()
        grads = [p.grad for p in moe.parameters()]
        results.append((y.detach(), x.grad, grads))
    torch.testing.assert_close(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1])
    for a, b in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(a, b)


def test_capacity_drops_tokens_and_used_token_masks() -> None:
    torch.manual_seed(0)
    moe = MoE(
        8,
        _expert(),
        num_experts=4,
        k=1,
        capacity_factor=0.25,
        min_capacity=1,
        use_rts=False,
        reinit_experts=True,
    )
    x = torch.randn(1, 16, 8)
    cap = capacity(16, 4, 0.25, 1)
    y, _, counts = moe(x)
    kept = (y.abs().sum(-1) > 0).sum().item()
    assert kept == int(torch.clamp(counts, max=cap).sum())  # each expert keeps <= cap
    assert kept < 16  # some tokens dropped: their output is zero
    mask = torch.zeros(16)
    mask[:5] = 1
    y2, _, counts2 = moe(x, mask)
    assert int(counts2.sum()) == 5
    assert (y2[0, 5:] == 0).all()


def test_sigmoid_scores_and_z_loss() -> None:
    torch.manual_seed(0)
    base = dict(num_experts=4, k=2, capacity_factor=None, score_func="sigmoid")
    x = torch.randn(10, 8)
    torch.manual_seed(2)
    plain = MoE(8, _expert(), **base)  # type: ignore[arg-type]
    torch.manual_seed(2)
    with_z = MoE(8, _expert(), z_loss_coef=0.5, **base)  # type: ignore[arg-type]
    y1, l1, _ = plain(x)
    y2, l2, _ = with_z(x)
    torch.testing.assert_close(y1, y2)
    logits = x @ plain.deepspeed_moe.gate.wg.weight.t()
    z = torch.logsumexp(logits, dim=1).square().mean()
    torch.testing.assert_close(l2, l1 + 0.5 * z)


def test_deepspeed_import_path() -> None:
    import fsdpx.deepspeed as deepspeed
    from fsdpx.deepspeed.moe.layer import MoE as DSMoE

    assert DSMoE is MoE
    assert deepspeed.moe.layer.MoE is MoE


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(num_experts=6, ep_size=4), r"num_experts \(6\) is not divisible by ep_size \(4\)"),
        (
            dict(num_experts=4, k=5, capacity_factor=None),
            r"k must be in 1..num_experts \(4\); got k=5",
        ),
        (dict(num_experts=4, k=3), r"supports k = 1 or 2 .* got k=3. Use capacity_factor=None"),
        (
            dict(num_experts=4, capacity_factor=0.0, min_capacity=0),
            r"capacity of 0: every token would be dropped",
        ),
        (dict(num_experts=4, noisy_gate_policy="Gumbel"), r"noisy_gate_policy must be one of"),
        (dict(num_experts=4, use_tutel=True), r"use_tutel=True\) is not implemented"),
        (dict(num_experts=4, score_func="relu", capacity_factor=None), r"score_func must be"),
    ],
)
def test_constructor_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoE(8, _expert(), **kwargs)


def test_expert_with_buffers_is_refused() -> None:
    with pytest.raises(ValueError, match=r"expert module with buffers \(\['1.running_mean'"):
        MoE(8, nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)), num_experts=2)


def test_grouped_benchmark_runs() -> None:
    """benchmarks/moe_grouped.py end to end at its smallest (it checks every way against the
    per-expert module loop before timing); timings are not asserted."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "moe_grouped.py"
    args = ["--tokens", "64", "--hidden", "16", "--ffn", "32", "--repeat", "1"]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("per-expert loop (modules)", "sorted loop", "padded bmm", "fused (grouped_mlp)"):
        assert name in proc.stdout, proc.stdout
