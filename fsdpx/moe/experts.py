"""Experts: `num_experts` copies of one expert module, stored stacked and computed grouped.

`Experts(template, num_experts)` keeps one copy of the template module whose every
parameter is replaced by a stacked parameter of shape [num_experts, *shape], initialised
from `num_experts` deep copies of the template: equal initial values, as DeepSpeed's `Experts`
makes them (`reinit=True` calls each copy's `reset_parameters()` instead). Parameter names are the
template's under `experts.`, e.g. `experts.fc1.weight` [E, out, in].

[Note: stacked experts] One tensor per parameter across experts is what makes the expert
layer cheap to parallelise: expert parallelism is `Shard(0)` of each stacked tensor over
mesh.ep (a DTensor: checkpoints see the global [E, ...] shape whatever the ep size), and
FSDP shards the local [E/ep, ...] block over the expert-data-parallel ranks like any
other parameter. A ModuleList of experts would need per-rank module surgery instead.

[Note: grouped expert compute] The tokens of the local experts arrive sorted by expert,
with per-expert counts. Four ways to run them, all on the same stacked weights:
`grouped="fused"` (experts of the form Sequential(Linear, activation, Linear)) is one
autograd node for all local experts, fsdpx/moe/grouped_mlp.py ([Note: fused grouped MLP]):
the fastest on CPU in benchmarks/moe_grouped.py, 1.1-1.2x a per-expert module loop at 8
local experts (README, Measured); `grouped="grouped_mm"` (same expert form) runs each
Linear as one `torch._grouped_mm` over all local experts with per-expert row offsets (on
CPU a per-group loop inside one op; on a GPU one kernel: its case there);
`grouped="loop"` slices the sorted tokens and runs the template per expert with
`torch.func.functional_call` (any expert module); `grouped="padded"` copies them into an
[experts, max_count, d] buffer and runs the template once under `torch.func.vmap` (one
batched matmul per layer), the slowest under uneven loads. The default, "auto", is "loop"
for any expert not of the Linear-activation-Linear form; for that form it is chosen on the
first forward on each device and dtype: "fused", except on a GPU where torch._grouped_mm is
one kernel and the expert is small, where it is "grouped_mm" (fsdpx/moe/auto_grouped.py,
[Note: auto grouped choice]; `Experts.mode`). The fused
path computes the loop's matmuls on the same row blocks, so its results equal the loop's
(tests/test_moe_grouped_mlp.py); grouped_mm sums in its own order (fp32 rounding).
"""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call, vmap

from fsdpx.moe.auto_grouped import choose_grouped, grouped_mm_kernel
from fsdpx.moe.grouped_mlp import grouped_mlp

Grouped = Literal["auto", "fused", "padded", "loop", "grouped_mm"]
_MODES = ("auto", "fused", "padded", "loop", "grouped_mm")


class Experts(nn.Module):
    """`num_experts` experts shaped like `template` (input [n, d] -> output [n, d])."""

    def __init__(
        self,
        template: nn.Module,
        num_experts: int,
        grouped: Grouped = "auto",
        reinit: bool = False,
        *,
        sources: list[nn.Module] | None = None,
    ) -> None:
        super().__init__()
        if grouped not in _MODES:
            raise ValueError(
                f"grouped must be one of {', '.join(repr(m) for m in _MODES)}; got {grouped!r}"
            )
        if grouped == "auto" and _mlp_problem(template) is not None:
            grouped = "loop"  # "auto" for MLP experts is chosen per device in mode()
        elif grouped in ("fused", "grouped_mm"):
            _check_mlp(template, grouped)
        if any(True for _ in template.buffers()):
            names = [n for n, _ in template.named_buffers()]
            raise ValueError(
                f"an expert module with buffers ({names}) cannot be stacked: experts share "
                "one module and stack only parameters; use an expert without buffers "
                "(e.g. Linear / activation / Linear)"
            )
        # sources: the experts themselves (from_modules), stacked as they are.
        copies = sources or [copy.deepcopy(template) for _ in range(num_experts)]
        if reinit:
            for c in copies:
                _reset(c)
        self.expert = copy.deepcopy(template)
        self.num_experts = num_experts
        self.grouped: Grouped = grouped
        """The compute asked for; "auto" (MLP experts only) is resolved by mode()."""
        self._auto: dict[tuple[torch.device, torch.dtype, torch.dtype], str] = {}
        self.grad_scale = 1.0
        """Multiplies the local experts' gradients (1 / ep under expert parallelism:
        [Note: expert gradient scale] in fsdpx/moe/parallel.py)."""
        self._names = [n for n, _ in template.named_parameters()]
        for name in self._names:
            stacked = torch.stack([c.get_parameter(name).detach() for c in copies])
            owner, leaf = _split(self.expert, name)
            setattr(owner, leaf, nn.Parameter(stacked))

    @classmethod
    def from_modules(cls, modules: list[nn.Module], grouped: Grouped = "auto") -> Experts:
        """Stack existing experts (one module each, one class, no buffers) keeping each
        one's own values: expert j's parameters become row j of the stacked tensors
        (fsdpx/moe/plan.py converts a model's ModuleList of experts with it)."""
        classes = {type(m) for m in modules}
        if len(classes) != 1:
            names = sorted(c.__name__ for c in classes)
            raise ValueError(f"experts to stack must share one class; got {names}")
        shapes = [[(n, p.shape) for n, p in m.named_parameters()] for m in modules]
        if any(s != shapes[0] for s in shapes):
            raise ValueError(
                "experts to stack must have the same parameter names and shapes; expert 0 "
                f"has {shapes[0]}, another has {next(s for s in shapes if s != shapes[0])}"
            )
        return cls(modules[0], len(modules), grouped=grouped, sources=modules)

    def local_params(self) -> dict[str, Tensor]:
        """Each stacked parameter as this rank's local block [E_local, ...] (autograd-linked)."""
        out: dict[str, Tensor] = {}
        for name in self._names:
            p = self.expert.get_parameter(name)
            local = p.to_local() if isinstance(p, DTensor) else p
            out[name] = (
                _ScaleGrad.apply(local, self.grad_scale) if self.grad_scale != 1.0 else local
            )
        return out

    def mode(self, x: Tensor, params: dict[str, Tensor] | None = None) -> str:
        """The compute a forward on rows `x` runs: `grouped`, with "auto" resolved for x's
        device and dtype and the weights' dtype ([Note: auto grouped choice])."""
        if self.grouped != "auto":
            return self.grouped
        w1 = (params or self.local_params())["0.weight"]  # [E, ffn, hidden]
        key = (x.device, x.dtype, w1.dtype)
        chosen = self._auto.get(key)
        if chosen is None:
            chosen = choose_grouped(
                x.device.type,
                x.dtype if x.dtype == w1.dtype else None,
                w1.shape[2],
                w1.shape[1],
                grouped_mm_kernel=grouped_mm_kernel(x.device),
            )
            self._auto[key] = chosen
        return chosen

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """Run expert j on the next counts[j] rows of `x` (rows sorted by local expert)."""
        params = self.local_params()
        if not counts or sum(counts) == 0:
            # Keep the parameters in the graph so every rank's backward touches them
            # (FSDP reduce-scatters every parameter's gradient; zero here).
            zero = sum(p.sum() for p in params.values()) * 0.0
            return x + zero
        mode = self.mode(x, params)
        if mode == "loop":
            outs = []
            start = 0
            for j, n in enumerate(counts):
                if n == 0:
                    continue
                one = {name: p[j] for name, p in params.items()}
                outs.append(functional_call(self.expert, one, (x[start : start + n],)))
                start += n
            return torch.cat(outs)
        if mode == "fused":
            act = self.expert.get_submodule("1")  # the activation (_check_mlp)
            return grouped_mlp(
                x,
                params["0.weight"],
                params.get("0.bias"),
                params["2.weight"],
                params.get("2.bias"),
                counts,
                act,
            )
        if mode == "grouped_mm":
            return self._grouped_mm(x, counts, params)
        return self._padded(x, counts, params)

    def _grouped_mm(self, x: Tensor, counts: list[int], params: dict[str, Tensor]) -> Tensor:
        """Linear -> activation -> Linear as two torch._grouped_mm calls over all experts."""
        counts_t = torch.tensor(counts, device=x.device)
        offs = torch.cumsum(counts_t, 0).to(torch.int32)
        expert_of_row = torch.repeat_interleave(
            torch.arange(len(counts), device=x.device), counts_t
        )
        h = torch._grouped_mm(x, params["0.weight"].transpose(1, 2), offs=offs)
        if "0.bias" in params:
            h = h + params["0.bias"].index_select(0, expert_of_row)
        h = self.expert.get_submodule("1")(h)  # the activation (_check_mlp)
        out = torch._grouped_mm(h, params["2.weight"].transpose(1, 2), offs=offs)
        if "2.bias" in params:
            out = out + params["2.bias"].index_select(0, expert_of_row)
        return out

    def _padded(self, x: Tensor, counts: list[int], params: dict[str, Tensor]) -> Tensor:
        num = len(counts)
        width = max(counts)
        counts_t = torch.tensor(counts, device=x.device)
        expert_of_row = torch.repeat_interleave(torch.arange(num, device=x.device), counts_t)
        starts = torch.cumsum(counts_t, 0) - counts_t
        slot = torch.arange(x.shape[0], device=x.device) - starts[expert_of_row]
        flat = expert_of_row * width + slot
        buf = x.new_zeros(num * width, x.shape[1]).index_copy(0, flat, x)

        def one(p: dict[str, Tensor], rows: Tensor) -> Tensor:
            return functional_call(self.expert, p, (rows,))

        out = vmap(one)(params, buf.view(num, width, -1))
        return out.reshape(num * width, -1).index_select(0, flat)


def _mlp_problem(template: nn.Module) -> str | None:
    """Why `template` is not nn.Sequential(Linear, parameterless activation, Linear), or None."""
    parts = list(template.children()) if isinstance(template, nn.Sequential) else []
    ok = (
        len(parts) == 3
        and isinstance(parts[0], nn.Linear)
        and isinstance(parts[2], nn.Linear)
        and not any(True for _ in parts[1].parameters())
        and not any(True for _ in parts[1].buffers())
    )
    if not ok:
        return (
            "it computes experts of the form nn.Sequential(nn.Linear, an activation without "
            f"parameters, nn.Linear); got {template!r}"
        )
    return None


def _check_mlp(template: nn.Module, grouped: str) -> None:
    """grouped="fused" / "grouped_mm" compute nn.Sequential(Linear, activation, Linear) only."""
    problem = _mlp_problem(template)
    if problem is not None:
        raise ValueError(f"grouped={grouped!r}: {problem}. Use grouped='loop' (any expert module)")
    if grouped == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        raise ValueError(
            f"grouped='grouped_mm' needs torch._grouped_mm, which torch {torch.__version__} "
            "lacks; use grouped='fused'"
        )


def scale_grad(x: Tensor, scale: float) -> Tensor:
    """`x` in forward; its gradient times `scale` in backward (x itself when scale is 1)."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad * ctx.scale, None


def _split(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def _reset(module: nn.Module) -> None:
    """Re-initialise every submodule that can (each expert gets its own initial values)."""
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
