"""Per-rank memory of a training job before running it: what fsdpx (FSDP2) holds for each
ZeRO stage and offload setting, next to what DeepSpeed's estimators print.

Two kinds of numbers, both in bytes per rank:

- fsdpx, analytic (`estimate_memory`): FSDP2 keeps the *sharded parameter itself* as the
  fp32 master copy, its gradient as a sharded fp32 tensor and Adam's two moments beside
  it, so model states are 16 bytes per parameter divided by the shard-group size (not
  divided at stage 0). The 16-bit (or fp32) working copy exists only while gathered:
  stages 0-2 gather every parameter from forward to the end of backward; stage 3 keeps
  the root's parameters and about two blocks (running + prefetched) gathered.
- measured (`fsdpx.estimate_measured.measure_memory`): the real sharding run under a
  fake process group and fake tensors, tracked by torch's FSDPMemTracker; adds
  activations and the peak when a sample input is given.

[Note: DeepSpeed's formulas] DeepSpeed's `estimate_zero2_model_states_mem_needs`
(deepspeed/runtime/zero/stage_1_and_2.py; used for stages 1 and 2) and
`estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py) assume
fp16/bf16 training with an fp32 master copy and Adam (K = 12 bytes of fp32 master + moments):

    zero2, no offload:  gpu = 4*P + 16*P/N          cpu = 4*P*gpus_per_node*1.5
    zero2, offload:     gpu = 2*P                   cpu = P*max(4*N, 16)*1.5
    zero3, no offload:  gpu = 4*L + 18*P/N          cpu = 4*L*gpus_per_node*1.5 (zero.Init)
    zero3, opt offload: gpu = 4*L + 2*P/N           cpu = 16*P/nodes*1.5      (zero.Init)
    zero3, all offload: gpu = 4*L                   cpu = 18*P/nodes*1.5      (zero.Init)

(P parameters, N ranks, L the largest layer's parameters, 1.5 their
additional_buffer_factor). Where fsdpx differs: (1) DeepSpeed keeps a persistent 16-bit
parameter copy (and at stages 1-2 full 16-bit gradients) beside the fp32 master; FSDP2's
16-bit copy is transient, so fsdpx's steady state is 16*P/N at stages 1-3 where DeepSpeed
counts 4*P + 16*P/N (stages 1-2) or 18*P/N + 4*L (stage 3); (2) DeepSpeed's 4*L is a
gathered-layer buffer, while FSDP2 gathers whole blocks and fsdpx never reshards the root
(embeddings, head), so fsdpx's transient term is root + 2 blocks in the compute dtype;
(3) in fp32 training both copies are 4 bytes, which DeepSpeed's formulas do not model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdpx.config import Config, OffloadConfig, ZeroConfig
from fsdpx.offload.plan import OffloadPlan, Placement, resolve_offload
from fsdpx.optimizers import OPTIMIZERS
from fsdpx.parallel_dims import ParallelDims
from fsdpx.precision import torch_dtype
from fsdpx.zero import dims_for_stage

_FP32 = 4
_UNKNOWN_UNIT = -2


@dataclass(frozen=True)
class ParamShape:
    """One parameter, as the estimator needs it."""

    shape: tuple[int, ...]
    element_size: int
    unit: int
    """-1: owned by the root module; i >= 0: by block i (a fully_shard unit); -2: not
    known (estimate from a bare parameter count)."""
    expert: bool = False
    """Stacked experts [num_experts, ...]: split over mesh.ep ([Note: expert terms])."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank for one configuration (rank 0, which holds the largest shards)."""

    stage: int
    world_size: int
    shard_size: int
    """Ranks a parameter is split over (1 at stage 0)."""
    offload_optimizer: str
    offload_param: str
    num_params: int
    params: int
    """The fp32 master: the sharded parameters."""
    grads: int
    """Sharded gradients at the optimizer step (full at stage 0)."""
    optimizer: int
    """Optimizer state (Adam: two moments and a step counter per tensor)."""
    gathered_params: int | None
    """Transient working copy during forward/backward, in the compute dtype (None: needs
    a model, or largest_layer_params at stage 3)."""
    device_model_states: int
    """params + grads + optimizer that stay on the device (not offloaded)."""
    host_bytes: int
    """Offloaded to CPU memory."""
    nvme_bytes: int
    """Offloaded to NVMe files."""
    deepspeed_gpu: int | None
    """DeepSpeed's estimator, per GPU (None at stage 0: DeepSpeed has none)."""
    deepspeed_cpu: int | None
    """DeepSpeed's estimator, host memory per node (with its 1.5 buffer factor)."""
    zero_paper: int
    """The ZeRO paper's model-state bytes for mixed-precision Adam (K = 12)."""
    activations: int | None = None
    """Measured (fake run) activation bytes at the peak; None without a sample input."""
    peak: int | None = None
    """Measured (fake run) peak bytes, every category; None without a sample input."""
    expert_params: int = 0
    """Of `params`: the stacked expert weights' local bytes (their gradients and optimizer
    state scale alike); 0 without MoE layers."""
    ep: int = 1
    """The expert-parallel degree the estimate applied (1 at stage 0: EP needs ZeRO >= 1)."""


def param_shapes(model: nn.Module, block_classes: tuple[str, ...] = ()) -> list[ParamShape]:
    """The parameters of `model` (meta tensors are fine) with the unit that owns each.

    Example::

        shapes = param_shapes(GPT(GPTConfig()))
    """
    from fsdpx.blocks import find_blocks
    from fsdpx.moe.parallel import expert_param_ids

    experts = expert_param_ids(model)
    owner: dict[int, int] = {}
    for i, block in enumerate(find_blocks(model, block_classes)):
        for p in block.parameters():
            owner[id(p)] = i
    seen: set[int] = set()
    out = []
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        shape = ParamShape(tuple(p.shape), p.element_size(), owner.get(id(p), -1))
        out.append(dataclasses.replace(shape, expert=id(p) in experts))
    return out


def _shard_numel(shape: tuple[int, ...], shard: int) -> int:
    # FSDP2 pads dim 0 to a multiple of the shard size; rank 0 holds ceil(dim0 / shard) rows.
    if not shape:
        return 1
    return math.ceil(shape[0] / shard) * math.prod(shape[1:])


def local_shape(p: ParamShape, ep: int) -> tuple[int, ...]:
    """The shape FSDP shards: a stacked expert tensor's ep-local block [E / ep, ...].

    [Note: expert terms] Under mesh.ep the experts of a layer are split over ep ranks
    (`Shard(0)`) and FSDP shards each rank's [E / ep, ...] block over the
    expert-data-parallel group of dp_shard / ep ranks (fsdpx/moe/parallel.py), so a rank
    holds ceil(ceil(E / ep) / (dp_shard / ep)) expert rows of the master, gradient and
    optimizer state, and gathers E / ep experts (not E) per layer. Without EP (or at
    stage 0, where EP is refused) experts are ordinary parameters.
    """
    if not p.expert or ep == 1 or not p.shape:
        return p.shape
    return (math.ceil(p.shape[0] / ep), *p.shape[1:])


def _local_numel(p: ParamShape, shard: int, ep: int) -> int:
    """Rank 0's elements of `p`: sharded over `shard` ranks, experts over ep then shard / ep."""
    if p.expert and ep > 1:
        return _shard_numel(local_shape(p, ep), shard // ep)
    return _shard_numel(p.shape, shard)


def _optimizer_bytes(cfg: Config, shapes: Sequence[ParamShape], shard: int, ep: int) -> int:
    local = sum(_local_numel(p, shard, ep) * p.element_size for p in shapes)
    return OPTIMIZERS[cfg.optimizer.type].state_bytes(cfg.optimizer, local, len(shapes))


def _gathered(
    zero: ZeroConfig,
    shapes: Sequence[ParamShape],
    compute: int,
    largest_layer: int | None,
    ep: int,
) -> int | None:
    if zero.stage != 3:
        return sum(math.prod(local_shape(p, ep)) for p in shapes) * compute
    units: dict[int, int] = {}
    for p in shapes:
        units[p.unit] = units.get(p.unit, 0) + math.prod(local_shape(p, ep))
    root = units.pop(-1, 0)
    units.pop(_UNKNOWN_UNIT, None)  # a bare parameter count: only largest_layer is known
    if units:
        block = max(units.values())
    elif largest_layer is not None:
        block = largest_layer
    else:
        return None
    kept = 0
    if zero.hpz_partition_size > 1:  # hpZ keeps each block's secondary shard after forward
        kept = sum(units.values()) // zero.hpz_partition_size
    return (root + 2 * block + kept) * compute


def deepspeed_formulas(
    stage: int,
    num_params: int,
    world_size: int,
    *,
    offload_optimizer: bool,
    offload_param: bool,
    largest_layer_params: int,
    gpus_per_node: int,
) -> tuple[int | None, int | None]:
    """(gpu, cpu) bytes as DeepSpeed's estimators print them (see [Note: DeepSpeed's
    formulas]); zero3 with zero_init=True, additional_buffer_factor=1.5. Stage 0: (None, None).
    """
    p, n, factor = num_params, world_size, 1.5
    nodes = max(1, n // gpus_per_node)
    if stage == 0:
        return None, None
    if stage in (1, 2):
        if offload_optimizer:
            return 2 * p, int(p * max(4 * n, 16) * factor)
        return 4 * p + int(16 * p / n), int(p * 4 * gpus_per_node * factor)
    layer = 4 * largest_layer_params
    if offload_optimizer and offload_param:
        return layer, int(p * 18 / nodes * factor)
    if offload_optimizer:
        return layer + int(2 * p / n), int(p * 16 / nodes * factor)
    return layer + int(18 * p / n), int(largest_layer_params * 4 * gpus_per_node * factor)


def _placement(
    plan: OffloadPlan, *, params: int, grads: int, optimizer: int, numel: int
) -> dict[Placement, int]:
    """Model-state bytes on the device, in host memory and on NVMe, as fsdpx.offload lays
    them out ([Note: the offload table] in fsdpx/offload/plan.py):

    - an optimizer stepping the parameters in place (no offload, or host parameters):
      its state sits with the parameters;
    - otherwise (OffloadedAdamW) an fp32 master (4 B per local element) joins the moments;
      host masters also mean a host copy of the gradients and, for 16-bit device shards,
      the 16-bit copy going back; NVMe masters mean `buffer_mb` of host streaming buffers.
    """
    placed: dict[Placement, int] = {"device": 0, "host": 0, "nvme": 0}
    placed[plan.params] += params + grads
    placed[plan.moments] += optimizer
    if plan.steps_in_place:
        return placed
    placed[plan.master] += _FP32 * numel  # the master
    placed["host"] += plan.streaming_buffer_bytes
    if plan.host_gradient_copy:
        element = params // numel if numel else 0
        placed["host"] += grads  # the host copy of the gradients
        if element == 2:
            placed["host"] += 2 * numel  # the 16-bit copy sent back to the device
    return placed


def zero_paper_bytes(stage: int, num_params: int, shard: int) -> int:
    """The ZeRO paper's model states (Rajbhandari et al. 2020, fig. 1): 2 bytes of 16-bit
    parameters, 2 of gradients, K = 12 of optimizer state per parameter."""
    p, n = num_params, shard
    return int([16 * p, 4 * p + 12 * p / n, 2 * p + 14 * p / n, 16 * p / n][stage])


def estimate_memory(
    model_or_num_params: nn.Module | int,
    cfg: Config | None = None,
    world_size: int = 1,
    *,
    largest_layer_params: int | None = None,
    gpus_per_node: int | None = None,
    sample_inputs: tuple[Any, ...] | None = None,
) -> MemoryEstimate:
    """Per-rank bytes of the model states (and the transient gathered parameters) for
    `cfg` on `world_size` ranks, next to DeepSpeed's estimator for the same setting.

    Args:
        model_or_num_params: the model (meta is fine: only shapes are read), or a
            parameter count (then every parameter counts as one fp32 row-sharded tensor).
        cfg: stage, mesh, precision, optimizer and offload settings; default Config().
        world_size: ranks in the job.
        largest_layer_params: stage 3 without a model: the largest block's parameters
            (DeepSpeed's largest_layer_params); with a model it is measured.
        gpus_per_node: for DeepSpeed's per-node CPU figure; default min(world_size, 8).
        sample_inputs: with a model, one micro-batch of forward arguments for this rank:
            fills `activations` and `peak` from a fake run of the real sharding
            (fsdpx.estimate_measured.measure_memory; needs no process group).
    Returns:
        A MemoryEstimate.

    Example::

        est = fsdpx.estimate_memory(1_300_000_000, Config.from_dict({"zero": {"stage": 3}}), 64)
        print(est.device_model_states / 2**30, "GiB per rank")
    """
    cfg = cfg or Config()
    dims = dims_for_stage(ParallelDims.from_config(cfg.mesh, world_size), cfg.zero)
    # FSDP shards over dp_shard x sp (the sp ranks hold the same weights).
    shard = dims.dp_shard * dims.sp
    if isinstance(model_or_num_params, nn.Module):
        shapes = param_shapes(model_or_num_params, cfg.zero.block_classes)
    else:
        n = int(model_or_num_params)
        if n < 1:
            raise ValueError(f"num_params must be >= 1; got {model_or_num_params!r}")
        shapes = [ParamShape((n,), _FP32, _UNKNOWN_UNIT)]
    num_params = sum(p.numel for p in shapes)
    units = {p.unit for p in shapes if p.unit >= 0}
    if units and largest_layer_params is None:
        largest_layer_params = max(sum(p.numel for p in shapes if p.unit == u) for u in units)
    ep = dims.ep if cfg.zero.stage > 0 else 1  # [Note: expert terms]
    params = sum(_local_numel(p, shard, ep) * p.element_size for p in shapes)
    expert_params = sum(_local_numel(p, shard, ep) * p.element_size for p in shapes if p.expert)
    grads = params
    optimizer = _optimizer_bytes(cfg, shapes, shard, ep)
    compute = torch.empty((), dtype=torch_dtype(cfg.precision.param_dtype)).element_size()
    gathered = _gathered(cfg.zero, shapes, compute, largest_layer_params, ep)
    plan = resolve_offload(cfg)
    local_numel = sum(_local_numel(p, shard, ep) for p in shapes)
    if plan.device_param_dtype is not None:
        # OffloadedAdamW keeps the device shards (and so their gradients) 16-bit.
        params = grads = local_numel * plan.device_param_bytes(compute)
    placed = _placement(plan, params=params, grads=grads, optimizer=optimizer, numel=local_numel)
    ds_gpu, ds_cpu = deepspeed_formulas(
        cfg.zero.stage,
        num_params,
        world_size,
        offload_optimizer=plan.master != "device",
        offload_param=plan.params != "device",
        largest_layer_params=largest_layer_params or 0,
        gpus_per_node=gpus_per_node or min(world_size, 8),
    )
    activations = peak = None
    if sample_inputs is not None:
        if not isinstance(model_or_num_params, nn.Module):
            raise ValueError(
                "sample_inputs needs the model itself, not a parameter count: activations "
                "depend on the model's layers"
            )
        from fsdpx.estimate_measured import measure_memory

        measured = measure_memory(model_or_num_params, cfg, world_size, sample_inputs)
        activations, peak = measured.activations, measured.peak
    return MemoryEstimate(
        activations=activations,
        peak=peak,
        stage=cfg.zero.stage,
        world_size=world_size,
        shard_size=shard,
        offload_optimizer=cfg.zero.offload_optimizer.device,
        offload_param=cfg.zero.offload_param.device,
        num_params=num_params,
        params=params,
        grads=grads,
        optimizer=optimizer,
        gathered_params=gathered,
        device_model_states=placed["device"],
        host_bytes=placed["host"],
        nvme_bytes=placed["nvme"],
        deepspeed_gpu=ds_gpu,
        deepspeed_cpu=ds_cpu,
        zero_paper=zero_paper_bytes(cfg.zero.stage, num_params, shard),
        expert_params=expert_params,
        ep=ep,
    )


SETTINGS: tuple[tuple[int, str, str], ...] = (
    (0, "none", "none"),
    (1, "none", "none"),
    (2, "none", "none"),
    (2, "cpu", "none"),
    (3, "none", "none"),
    (3, "cpu", "none"),
    (3, "cpu", "cpu"),
)
"""(stage, offload_optimizer, offload_param) rows of estimate_table: the settings
DeepSpeed's estimators cover, plus stage 0 and 1."""


def estimate_table(
    model_or_num_params: nn.Module | int,
    cfg: Config | None = None,
    world_size: int = 1,
    *,
    largest_layer_params: int | None = None,
    gpus_per_node: int | None = None,
) -> list[MemoryEstimate]:
    """estimate_memory for every row of SETTINGS (stage and offload changed, the rest of
    `cfg` kept).

    Example::

        for est in estimate_table(7_000_000_000, world_size=64): print(est.stage, est.params)
    """
    cfg = cfg or Config()
    out = []
    for stage, opt, par in SETTINGS:
        zero = ZeroConfig(
            stage=stage,  # type: ignore[arg-type]
            block_classes=cfg.zero.block_classes,
            offload_optimizer=OffloadConfig(device=opt),  # type: ignore[arg-type]
            offload_param=OffloadConfig(device=par),  # type: ignore[arg-type]
        )
        out.append(
            estimate_memory(
                model_or_num_params,
                cfg.replace(zero=zero),
                world_size,
                largest_layer_params=largest_layer_params,
                gpus_per_node=gpus_per_node,
            )
        )
    return out


def format_table(rows: Sequence[MemoryEstimate]) -> str:
    """A fixed-width table of estimates in GiB.

    Example::

        print(format_table(estimate_table(1_000_000_000, world_size=64)))
    """

    def gib(b: int | None) -> str:
        return "-" if b is None else f"{b / 2**30:.2f}"

    head = (
        f"{'stage':>5} {'off_opt':>7} {'off_par':>7} {'params':>8} {'grads':>8} "
        f"{'optim':>8} {'device':>8} {'host':>8} {'nvme':>8} {'gathered':>8} "
        f"{'ds_gpu':>8} {'ds_cpu':>8} {'paper':>8}"
    )
    lines = [f"per-rank GiB, {rows[0].num_params:,} params, world size {rows[0].world_size}", head]
    for r in rows:
        lines.append(
            f"{r.stage:>5} {r.offload_optimizer:>7} {r.offload_param:>7} {gib(r.params):>8} "
            f"{gib(r.grads):>8} {gib(r.optimizer):>8} {gib(r.device_model_states):>8} "
            f"{gib(r.host_bytes):>8} {gib(r.nvme_bytes):>8} {gib(r.gathered_params):>8} "
            f"{gib(r.deepspeed_gpu):>8} {gib(r.deepspeed_cpu):>8} {gib(r.zero_paper):>8}"
        )
    return "\n".join(lines)


def parse_count(text: str) -> int:
    """A parameter count such as "1.3B", "350M", "7e9" or "125000000".

    Example::

        >>> parse_count("1.3B")
        1300000000
    """
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
    t = text.strip().upper()
    try:
        if t and t[-1] in scale:
            return round(float(t[:-1]) * scale[t[-1]])
        return round(float(t))
    except ValueError:
        raise ValueError(
            f"a parameter count must be a number with an optional K/M/B/T suffix (e.g. 1.3B); "
            f"got {text!r}"
        ) from None


def estimate_report(
    model_or_num_params: nn.Module | int,
    cfg: Config,
    world_size: int,
    *,
    sample_inputs: tuple[Any, ...] | None = None,
    largest_layer_params: int | None = None,
    gpus_per_node: int | None = None,
) -> str:
    """The text `fsdpx estimate` prints: the table over SETTINGS, then `cfg`'s own row
    (measured activations and peak when sample inputs are given).

    Example::

        print(estimate_report(1_000_000_000, Config(), 64, largest_layer_params=50_000_000))
    """
    kw: dict[str, Any] = {"largest_layer_params": largest_layer_params}
    kw["gpus_per_node"] = gpus_per_node
    table = format_table(estimate_table(model_or_num_params, cfg, world_size, **kw))
    own = estimate_memory(model_or_num_params, cfg, world_size, sample_inputs=sample_inputs, **kw)
    gib = 2**30
    lines = [
        table,
        "",
        f"this config: stage {own.stage}, shard group {own.shard_size}, offload optimizer "
        f"{own.offload_optimizer} / param {own.offload_param}: device model states "
        f"{own.device_model_states / gib:.3f} GiB (params {own.params / gib:.3f}, grads "
        f"{own.grads / gib:.3f}, optimizer {own.optimizer / gib:.3f}), host "
        f"{own.host_bytes / gib:.3f} GiB, nvme {own.nvme_bytes / gib:.3f} GiB",
    ]
    if own.expert_params:
        lines.append(
            f"experts (mesh.ep {own.ep}): {own.expert_params / gib:.3f} GiB of the params "
            "(their grads and optimizer state in proportion)"
        )
    if own.peak is not None and own.activations is not None:
        lines.append(
            f"measured (fake run of the real sharding): activations "
            f"{own.activations / gib:.3f} GiB, peak {own.peak / gib:.3f} GiB per rank"
        )
    lines.append(
        "fsdpx: the sharded fp32 parameters are the master copy (16 bytes/param/shard with "
        "Adam); the compute-dtype copy exists only while gathered ('gathered'). ds_gpu/"
        "ds_cpu: DeepSpeed's estimators (16-bit params + fp32 master; cpu per node, x1.5); "
        "paper: the ZeRO paper's mixed-precision model states."
    )
    return "\n".join(lines)
