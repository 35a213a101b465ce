"""grouped="grouped_mm" (torch._grouped_mm per Linear over all local experts) against the
sorted per-expert loop on the same stacked weights: outputs and gradients, uneven and empty
expert loads included; the templates it refuses; and when grouped="auto" picks it
(fsdpx/moe/auto_grouped.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fsdpx.moe.experts as experts_mod
from fsdpx.moe import MoE
from fsdpx.moe.auto_grouped import (
    GROUPED_MM_MAX_WEIGHT,
    LARGE_MEASURED,
    SMALL_MEASURED,
    choose_grouped,
    grouped_mm_kernel,
)
from fsdpx.moe.experts import Experts


def _mlp(bias: bool = True) -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 12, bias=bias), nn.GELU(), nn.Linear(12, 8, bias=bias))


@pytest.mark.parametrize("bias", [True, False])
def test_grouped_mm_equals_the_loop(bias: bool) -> None:
    torch.manual_seed(0)
    loop = Experts(_mlp(bias), 4, grouped="loop", reinit=True)
    grouped = copy.deepcopy(loop)
    grouped.grouped = "grouped_mm"
    counts = [5, 0, 11, 2]  # uneven, one expert without rows
    x = torch.randn(sum(counts), 8)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(xi, counts) for m, xi in zip((loop, grouped), xs, strict=True)]
    torch.testing.assert_close(outs[1], outs[0])
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad)
    for (name, p), q in zip(loop.named_parameters(), grouped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


def test_moe_layer_with_grouped_mm() -> None:
    torch.manual_seed(0)
    layer = MoE(8, _mlp(), 4, k=2, capacity_factor=None, reinit_experts=True)
    torch.manual_seed(0)
    grouped = MoE(
        8, _mlp(), 4, k=2, capacity_factor=None, reinit_experts=True, grouped="grouped_mm"
    )
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(grouped(x)[0], layer(x)[0])


def test_grouped_mm_refuses_other_experts() -> None:
    with pytest.raises(ValueError, match=r"grouped='grouped_mm': it computes experts of the form"):
        Experts(nn.Linear(8, 8), 4, grouped="grouped_mm")
    with pytest.raises(ValueError, match=r"grouped must be one of 'auto', 'fused'"):
        Experts(_mlp(), 4, grouped="fast")  # type: ignore[arg-type]


def test_auto_choice_rule() -> None:
    """[Note: auto grouped choice]: grouped_mm only on CUDA with the one-kernel path, bf16,
    aligned and small experts; the two measured sizes fall on their measured sides."""
    small, mixtral = (256, 512), (4096, 14336)
    bf16 = torch.bfloat16

    def pick(device: str, dtype: torch.dtype | None, shape: tuple[int, int], kernel: bool) -> str:
        return choose_grouped(device, dtype, *shape, grouped_mm_kernel=kernel)

    assert pick("cuda", bf16, small, True) == "grouped_mm"
    assert pick("cuda", bf16, mixtral, True) == "fused"
    assert pick("cuda", bf16, (1024, 2048), True) == "grouped_mm"  # 2.1M <= 2.77M
    assert pick("cuda", bf16, (2048, 2048), True) == "fused"  # 4.2M
    assert SMALL_MEASURED < GROUPED_MM_MAX_WEIGHT < LARGE_MEASURED
    assert (
        GROUPED_MM_MAX_WEIGHT**2
        <= SMALL_MEASURED * LARGE_MEASURED
        < (GROUPED_MM_MAX_WEIGHT + 1) ** 2
    )
    for device, dtype, kernel in [
        ("cpu", bf16, True),  # CPU unchanged, whatever the build
        ("cpu", torch.float32, False),
        ("cuda", bf16, False),  # no one-kernel path (another GPU, ROCm, no _grouped_mm)
        ("cuda", torch.float32, True),
        ("cuda", torch.float16, True),
        ("cuda", None, True),  # rows and weights of different dtypes
    ]:
        assert pick(device, dtype, small, kernel) == "fused", (device, dtype, kernel)
    assert pick("cuda", bf16, (260, 512), True) == "fused"  # rows not 16-byte aligned
    assert pick("cuda", bf16, (256, 500), True) == "fused"
    assert not grouped_mm_kernel(torch.device("cpu"))


def test_auto_asks_the_rule_with_the_forward_s_device_dtype_and_shapes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Experts.mode passes the rows' device type, the common dtype (None when rows and
    weights differ), hidden, ffn and the kernel check to the rule, once per device/dtype."""
    calls: list[tuple[object, ...]] = []

    def rule(device: str, dtype: torch.dtype | None, hidden: int, ffn: int, **kw: bool) -> str:
        calls.append((device, dtype, hidden, ffn, kw["grouped_mm_kernel"]))
        return "grouped_mm"

    monkeypatch.setattr(experts_mod, "choose_grouped", rule)
    monkeypatch.setattr(experts_mod, "grouped_mm_kernel", lambda device: device.type == "cpu")
    torch.manual_seed(0)
    auto = Experts(_mlp(), 4, reinit=True)
    loop = copy.deepcopy(auto)
    loop.grouped = "loop"
    counts = [5, 0, 11, 2]
    x = torch.randn(sum(counts), 8)
    torch.testing.assert_close(auto(x, counts), loop(x, counts))  # it ran grouped_mm
    auto(x, counts)
    assert auto.mode(x.bfloat16()) == "grouped_mm"
    assert calls == [("cpu", torch.float32, 8, 12, True), ("cpu", None, 8, 12, True)]
    assert Experts(_mlp(), 2, grouped="fused").mode(x) == "fused"  # asked for: kept


@pytest.mark.gpu
def test_auto_on_cuda_picks_grouped_mm_for_small_experts() -> None:
    """On an H100 / B200 in bf16, a 256 -> 512 expert runs torch._grouped_mm under "auto"
    (elsewhere the fused node), and its output is the loop's to the bound of
    tests/test_moe_grouped_mlp.py's CUDA test."""
    torch.manual_seed(0)
    template = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    auto = Experts(template, 8, reinit=True).cuda().bfloat16()
    loop = copy.deepcopy(auto)
    loop.grouped = "loop"
    counts = [40, 0, 88, 16, 64, 8, 24, 32]
    x = torch.randn(sum(counts), 256, device="cuda", dtype=torch.bfloat16)
    kernel = grouped_mm_kernel(x.device)
    assert auto.mode(x) == ("grouped_mm" if kernel else "fused")
    assert auto.mode(x.float()) == "fused"  # fp32 rows, bf16 weights
    got, ref = auto(x, counts), loop(x, counts)
    bound = 2**-6 * float(ref.abs().max())
    assert float((got.float() - ref.float()).abs().max()) <= bound
