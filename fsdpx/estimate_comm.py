"""Communication volume per training step: the bytes one rank sends, per collective kind,
for a ZeRO stage with or without ZeRO++'s quantized collectives (qwZ, qgZ).

The formulas are those fsdpx.comm counts at the calls (fsdpx/comm/counted.py,
fsdpx/comm/fsdp_slot.py), applied to what FSDP2 issues per fully_shard unit (the root and
each block) in one micro-step without gradient accumulation. With ``W`` the shard-group size,
``n`` a unit's all-gather input (its parameters' shards, dim 0 padded to a multiple of
``W`` as FSDP2 pads), ``c`` / ``r`` the compute / reduce dtype bytes and ``b`` the block size:

| collective | per unit and occurrence, bytes sent |
|---|---|
| all-gather, plain | (W - 1) * n * c |
| all-gather, qwZ | (W - 1) * (n + 4 * ceil(n / b)) |
| reduce-scatter, plain | (W - 1) * n * r |
| all-to-all, qgZ | (W - 1) * (q(n) + 4 * ceil(n / b)), q(n) = n (int8) or ceil(n / 2) |
| all-reduce (HSDP, R replicas; stage 0) | 2 * (R - 1) / R * n * r |

The hierarchical qgZ (``zero.quantized_gradients_hierarchical``, N nodes of L ranks) sends
the same all-to-all total, ``(L - 1) * N`` payloads within the node and ``N - 1`` across
(fsdpx/comm/qgz_hier.py), so the table does not split it.

Occurrences: stage 3 gathers each block twice (forward, and again in backward; under hpZ
the backward one runs over the secondary group of ``h`` ranks with ``n_h`` from a shard
over ``h``) and the root once; stages 1-2 gather every unit once; every stage with a
shard group reduce-scatters each unit once. The all-reduces are FSDP's own (not counted by
fsdpx.comm's log, shown here so the settings compare). A bare parameter count is one block
of one tensor. Tensor / pipeline parallel degrees divide the parameters evenly (an
approximation: their own collectives are not included).

Mixture of experts under mesh.ep (stages 1-3): each layer's experts are their own FSDP unit
over the expert-data-parallel group (``W_e`` = dp_shard / ep ranks) holding the layer's
``E / ep`` local experts ([Note: expert terms] in fsdpx/estimate.py), gathered and
reduce-scattered like a block. Token dispatch (fsdpx/moe/dispatch.py), per MoE layer and
micro-step, with ``T`` tokens on the rank, top-``k`` routing, hidden size ``d`` and tokens
spread evenly over the experts (the expectation; a skewed router sends more or less):

    all-to-all, dispatch = (ep - 1) / ep * (8 * E + 4 * T * k * d * c)

(the int64 count exchange, then the rows out and back in forward, and their gradients
out and back in backward). It needs ``tokens_per_micro_step``; without it the term is 0.

Example::

    print(format_comm_table(comm_table(1_300_000_000, Config(), 64)))
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fsdpx.config import Config, ZeroConfig
from fsdpx.estimate import ParamShape, _shard_numel, local_shape, param_shapes
from fsdpx.parallel_dims import ParallelDims
from fsdpx.precision import torch_dtype
from fsdpx.zero import dims_for_stage


@dataclass(frozen=True)
class CommVolume:
    """Bytes one rank sends in one micro-step, per collective kind."""

    setting: str
    all_gather: int
    reduce_scatter: int
    all_to_all: int
    all_reduce: int

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_to_all + self.all_reduce


def _blocks(n: int, b: int) -> int:
    return -(-n // b)


Unit = tuple[int, bool]
"""(owning block, -1 for the root; True for the block's experts under mesh.ep)."""


def _units(shapes: Sequence[ParamShape], tp_pp: int, ep: int) -> dict[Unit, list[tuple[int, ...]]]:
    units: dict[Unit, list[tuple[int, ...]]] = {}
    for p in shapes:
        split = p.expert and ep > 1
        shape = local_shape(p, ep)
        if tp_pp > 1:  # even split over the model-parallel ranks (approximation)
            shape = (math.ceil(math.prod(shape) / tp_pp),)
        key = (max(p.unit, 0) if p.unit != -1 else -1, split)
        units.setdefault(key, []).append(shape)
    return units


def dispatch_bytes(
    tokens: int, hidden: int, k: int, num_experts: int, ep: int, element_size: int
) -> int:
    """Bytes one rank sends through one MoE layer's all-to-alls in one micro-step (forward
    and backward) with `tokens` tokens routed evenly (module docstring)."""
    if ep <= 1:
        return 0
    return (ep - 1) * (8 * num_experts + 4 * tokens * k * hidden * element_size) // ep


def moe_layer_sizes(model: nn.Module) -> list[tuple[int, int, int]]:
    """(num_experts, k, hidden) of each MoE layer: fsdpx.moe layers, and Hugging Face fused
    experts with k from the model config's `num_experts_per_tok`."""
    from fsdpx.moe.parallel import fused_experts, moe_layers

    sizes = [
        (layer.num_experts, layer.gate.k, layer.gate.wg.in_features)
        for _, layer in moe_layers(model)
    ]
    k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    for name, module in fused_experts(model):
        if not isinstance(k, int):
            raise ValueError(
                f"fused experts {name!r}: the estimate needs top-k from the model config's "
                "num_experts_per_tok, which this model lacks; leave tokens_per_micro_step "
                "unset to estimate without the dispatch term"
            )
        e, _, d = module.get_parameter("gate_up_proj").shape
        sizes.append((e, k, d))
    return sizes


def comm_volume(
    model_or_num_params: nn.Module | int,
    cfg: Config,
    world_size: int,
    *,
    setting: str = "this config",
    tokens_per_micro_step: int | None = None,
) -> CommVolume:
    """Bytes one rank sends per micro-step under `cfg` (module docstring for the formulas).

    Args:
        tokens_per_micro_step: tokens one rank feeds the model per micro-step; with MoE
            layers and mesh.ep > 1 it adds their dispatch all-to-alls (else 0).
    """
    zero = cfg.zero
    dims = dims_for_stage(ParallelDims.from_config(cfg.mesh, world_size), zero)
    ep = dims.ep if zero.stage > 0 else 1  # [Note: expert terms] in fsdpx/estimate.py
    if isinstance(model_or_num_params, nn.Module):
        shapes = param_shapes(model_or_num_params, zero.block_classes)
    else:
        shapes = [ParamShape((int(model_or_num_params),), 4, 0)]
    reps = dims.dp_replicate
    c = torch.empty((), dtype=torch_dtype(cfg.precision.param_dtype)).element_size()
    r = torch.empty((), dtype=torch_dtype(cfg.precision.reduce_dtype)).element_size()
    b = zero.quantization_block_size

    def gather(n: int, group: int) -> int:
        per = n + 4 * _blocks(n, b) if zero.quantized_weights else n * c
        return (group - 1) * per

    ag = rs = a2a = ar = 0
    for (unit, experts), unit_shapes in _units(shapes, dims.tp * dims.pp, ep).items():
        w = dims.dp_shard // ep if experts else dims.dp_shard
        n = sum(_shard_numel(s, w) for s in unit_shapes)
        if w > 1:
            ag += gather(n, w)
            if zero.stage == 3 and unit != -1:
                h = zero.hpz_partition_size
                n_h = sum(_shard_numel(s, h) for s in unit_shapes)
                ag += gather(n_h, h) if h > 1 else gather(n, w)
            if zero.quantized_gradients:
                q = n if zero.quantized_gradients_bits == 8 else (n + 1) // 2
                a2a += (w - 1) * (q + 4 * _blocks(n, b))
            else:
                rs += (w - 1) * n * r
        if reps > 1:
            ar += 2 * (reps - 1) * n * r // reps
    if tokens_per_micro_step and ep > 1 and isinstance(model_or_num_params, nn.Module):
        for e, k, d in moe_layer_sizes(model_or_num_params):
            a2a += dispatch_bytes(tokens_per_micro_step, d, k, e, ep, c)
    return CommVolume(setting, ag, rs, a2a, ar)


def comm_table(
    model_or_num_params: nn.Module | int, cfg: Config, world_size: int
) -> list[CommVolume]:
    """ZeRO-3 plain, + qwZ, + qwZ + qgZ (int8, int4), then `cfg` itself; the mesh,
    precision and block size of `cfg` kept."""
    base = dataclasses.replace(
        cfg.zero, stage=3, quantized_weights=False, quantized_gradients=False
    )
    even_block = base.quantization_block_size + base.quantization_block_size % 2  # int4
    rows: list[tuple[str, ZeroConfig]] = [
        ("zero3", base),
        ("zero3 + qwZ", dataclasses.replace(base, quantized_weights=True)),
        (
            "zero3 + qwZ + qgZ int8",
            dataclasses.replace(base, quantized_weights=True, quantized_gradients=True),
        ),
        (
            "zero3 + qwZ + qgZ int4",
            dataclasses.replace(
                base,
                quantized_weights=True,
                quantized_gradients=True,
                quantized_gradients_bits=4,
                quantization_block_size=even_block,
            ),
        ),
    ]
    out = [
        comm_volume(model_or_num_params, cfg.replace(zero=z), world_size, setting=name)
        for name, z in rows
    ]
    out.append(comm_volume(model_or_num_params, cfg, world_size))
    return out


def format_comm_table(rows: Sequence[CommVolume]) -> str:
    """A fixed-width table in MiB, with each row's total as a fraction of the first's."""

    def mib(v: int) -> str:
        return f"{v / 2**20:.2f}"

    first = rows[0].total or 1
    lines = [
        "communication per micro-step, MiB sent per rank (ratio: total / the first row's)",
        f"{'setting':<24} {'all_gather':>10} {'red_scat':>10} {'all_to_all':>10} "
        f"{'all_reduce':>10} {'total':>10} {'ratio':>6}",
    ]
    for v in rows:
        lines.append(
            f"{v.setting:<24} {mib(v.all_gather):>10} {mib(v.reduce_scatter):>10} "
            f"{mib(v.all_to_all):>10} {mib(v.all_reduce):>10} {mib(v.total):>10} "
            f"{v.total / first:>6.3f}"
        )
    return "\n".join(lines)
