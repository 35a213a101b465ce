"""`fsdpx.parallelize`: the one recipe that turns a model into its parallelised, sharded
and materialised parts on a mesh (torchtitan's `parallelize` shape).

    place -> [pp: split into this rank's stages] ->
        per part: tensor parallel -> expert parallel -> activation checkpointing -> compile
                  -> FSDP (ZeRO; experts over the expert-data-parallel ranks first)
    -> materialise (meta-built models) -> [pp: pipeline runner]

Data parallelism is the case of one part (the model) and no TP plan; pipeline parallelism
splits the model into its local stages first (fsdpx/pipeline_parallel.py) and runs the same
per-part steps on each. fsdpx.shard builds the mesh and calls `parallelize`; the measured
memory estimate (fsdpx/estimate_measured.py) calls it too, without materialising.

[Note: recipe order] Tensor parallelism comes first: its plan names modules of the unwrapped
model and turns their parameters into DTensors on the tp mesh, which FSDP then shards over
the data axes (2D). Activation checkpointing is hooked onto the block before compile so the
compiled block is the checkpointed one. FSDP comes last: `fully_shard` must see the final
parameters (tp DTensors) and its hooks run around the checkpointed, compiled block. DESIGN.md
(Round 2) fixes where the coming techniques go: TP -> SP/CP -> EP -> AC -> compile -> FSDP,
i.e. context parallelism (mesh.sp) and then expert parallelism (mesh.ep) are applied per part
between tensor parallelism and activation checkpointing. Expert parallelism is there
(fsdpx/moe/parallel.py): it turns the stacked expert weights into DTensors on the ep axis
of the expert mesh, which FSDP then shards over that mesh's expert-data-parallel axis
before the blocks around them are sharded.

[Note: materialise once] A model built on the meta device is materialised after every part
is sharded, so each rank allocates only its shards, in one place (`_materialize`) for every
layout. Parameters FSDP offloads to the host (zero.offload_param) are materialised on the
host, because FSDP2 keeps offloaded shards there and refuses device ones; their buffers then
move to the device. After `_materialize` every part is sharded and holds its initial values:
steps on the initial weights belong right there, before a pipeline runner is built around
the parts.

[Note: MoE and sequence on first use] fsdpx.moe (24 modules with fsdpx.zero's) and
fsdpx.sequence (11) are imported where a layout uses them: moe.plan, mesh.ep > 1, a model
holding an fsdpx MoE layer (which needs fsdpx.moe imported to exist, so `fsdpx.moe` in
sys.modules is the cheap test), mesh.sp > 1 or context_parallel.mlp_tile_tokens. A plain
ZeRO run, and fsdpx.hf.from_pretrained in particular, skipped them: on 2 CPU ranks they
were ~0.5 MiB of each rank's peak RSS and 25-70 ms inside the first fsdpx.shard
(tests/hf_bodies.py DEFERRED_MODULES pins it).

[Note: no resharding under PP] Under pipeline parallelism every FSDP block keeps its
parameters gathered after forward (`reshard_after_forward=False`) whatever the ZeRO
stage says. Zero-bubble schedules split backward into an input-gradient and a later
weight-gradient pass; with per-block resharding the weight pass runs against resharded
parameters and the gradients come out wrong or missing, silently
(tests/test_pipeline_parallel.py shows the mismatch). Gradients are reduced once per
step, after the last micro-batch (the stage does that), so every ZeRO stage behaves like
stage 1/2 within a step.

[Note: no shared comm context] torchtitan shares one FSDP communication context between
the stage roots of a rank (`torch.distributed.fsdp.share_comm_ctx`) so that they use the
same CUDA streams. In torch 2.13 that context also holds the forward order used for
backward prefetching, and each stage's end-of-backward callback clears it while the
rank's other stage is still in backward: Interleaved1F1B and the V schedules then fail
with an IndexError inside FSDP's backward prefetch (tried on CPU/gloo). Each stage root
keeps its own context; on GPU this costs separate streams per local stage.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

from fsdpx.activation_checkpoint import apply_activation_checkpointing
from fsdpx.config import Config
from fsdpx.init_sync import broadcast_initial_state_
from fsdpx.materialize import materialize_
from fsdpx.offload.build import offload_policy
from fsdpx.optimizers import EXCHANGING_OPTIMIZERS
from fsdpx.parallel_dims import Axis, ParallelDims
from fsdpx.pipeline_split import merged_view
from fsdpx.precision import mp_policy
from fsdpx.tensor_parallel import apply_tensor_parallel, build_plan, check_plan
from fsdpx.tp_plans import TPPlan
from fsdpx.zero import apply_zero, stage_plan

if TYPE_CHECKING:
    from fsdpx.pipeline_parallel import PipelineRunner


@dataclass
class Parallelized:
    """What the recipe made on this rank."""

    module: nn.Module
    """The model (pp = 1) or a PipelineView of the local stages (pp > 1)."""
    parts: list[nn.Module]
    """The FSDP roots: the model, or one per local pipeline stage."""
    pipeline: PipelineRunner | None
    """The schedule runner (pp > 1)."""


def parallelize(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    *,
    cfg: Config,
    dims: ParallelDims,
    mesh: DeviceMesh,
    device: torch.device,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    materialize: bool = True,
    pp_block_reshard_after_forward: bool | int = False,
) -> Parallelized:
    """Split (pp), tensor-parallelise (tp), checkpoint, compile, shard (FSDP) and
    materialise `model`, as `cfg` says, on this rank.

    Args:
        model: the model, on any device or on meta; a model not on meta is moved to
            `device` first. Consumed: it becomes the FSDP root (pp = 1) or is cut into
            stages (pp > 1).
        blocks: its blocks (fsdpx.blocks.find_blocks).
        cfg, dims, mesh: the config and the world mesh (ParallelDims.build_mesh).
        device: this rank's device.
        loss_fn: `loss_fn(outputs, targets)`; required under pp (the last stage calls it).
        init_fn: initialises a meta-built model after sharding (else reset_parameters());
            required for a meta-built model under tp or pp.
        materialize: False leaves meta tensors on meta (the measured estimate allocates
            them as fake tensors itself).
        pp_block_reshard_after_forward: internal, for the regression test of
            [Note: no resharding under PP]; never change it in training.
    Returns:
        Parallelized.
    Raises:
        ValueError: a meta-built model without init_fn under tp or pp, a tp plan that
            does not fit (fsdpx.tensor_parallel), a pipeline layout the schedule cannot
            run or no loss_fn under pp (fsdpx.pipeline_parallel).
        NotImplementedError: tensor_parallel.loss_parallel with pp.

    Example::

        built = parallelize(gpt, find_blocks(gpt), cfg=cfg, dims=dims, mesh=mesh,
                            device=torch.device("cpu"), loss_fn=loss_fn)
    """
    on_meta = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    if on_meta and materialize and init_fn is None and (dims.tp > 1 or dims.pp > 1):
        # reset_parameters() would run per stage and per tp shard with one seed: stages
        # would repeat each other's values and tp ranks disagree on replicated ones.
        raise ValueError(
            f"a model built on the meta device with mesh.tp = {dims.tp} and mesh.pp = "
            f"{dims.pp} needs init_fn: pass fsdpx.shard(..., init_fn=fsdpx.per_param_init(fn)), "
            "which initialises each parameter from its full-model name, so every layout "
            "gets the values of the unsplit model"
        )
    if on_meta and materialize and init_fn is None and dims.ep > 1:
        # The stacked experts' template modules would reset [E / ep, ...] blocks as if
        # they were one expert's weight (wrong fan-in), every ep rank alike.
        raise ValueError(
            f"a model built on the meta device with mesh.ep = {dims.ep} needs init_fn: pass "
            "fsdpx.shard(..., init_fn=fsdpx.per_param_init(fn)), which initialises each "
            "parameter (a stacked expert tensor [num_experts, ...] too) from its full-model "
            "name, so every ep size gets the values of the unsplit model"
        )
    if cfg.precision.master_dtype == "bf16":
        # The sharded parameters are the masters: bf16 ones (PrecisionConfig.master_dtype),
        # cast before sharding (on meta, reset_parameters() then initialises in bf16).
        model.to(torch.bfloat16)
    # moe.plan's blocks get stacked experts and fsdpx's dispatch, at every ep
    # ([Note: planned blocks] in fsdpx/moe/plan.py); the same on every rank.
    if cfg.moe.plan:
        from fsdpx.moe.plan import apply_moe_plan

        apply_moe_plan(model, cfg.moe.plan)
    # Before the first collective: every rank gets the same verdict. A model can hold an
    # fsdpx MoE layer only once fsdpx.moe is imported ([Note: MoE and sequence on first use]).
    if dims.ep > 1 or "fsdpx.moe" in sys.modules:
        from fsdpx.moe.parallel import check_expert_parallel

        check_expert_parallel(model, dims, cfg.zero.stage)
    if not on_meta:
        model.to(device)
    if materialize:
        # Before any split, every rank takes rank 0's values ([Note: rank 0's initial weights]).
        broadcast_initial_state_(model)
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [names[id(b)] for b in blocks]
    tp_plan = _tp_plan(model, block_names, cfg=cfg, dims=dims)
    split = None
    if dims.pp > 1:
        # Lazily: torch.distributed.pipelining imports torch._dynamo and sympy (~30 MiB).
        from fsdpx.pipeline_parallel import split_stages

        split = split_stages(model, block_names, cfg=cfg, dims=dims, mesh=mesh, loss_fn=loss_fn)
    parts = split.parts if split is not None else [model]

    # The FSDP settings every part shares. The mixed-precision policy is built here only.
    precision = mp_policy(cfg.precision)
    # Offload: FSDP2's policy for zero.offload_param (None: parameters stay on device).
    offload = offload_policy(cfg)
    # See [Note: no resharding under PP]; None keeps the ZeRO stage's setting.
    block_raf = pp_block_reshard_after_forward if split is not None else None
    expert_mesh = None
    if dims.ep > 1:
        from fsdpx.moe.parallel import build_expert_mesh

        expert_mesh = build_expert_mesh(dims, device.type)

    for part in parts:
        present = {n for n, _ in part.named_modules()}
        parallelize_part(
            part,
            [part.get_submodule(n) for n in block_names if n in present],
            cfg=cfg,
            mesh=mesh,
            tp_plan=tp_plan,
            block_names=block_names,
            mp_policy=precision,
            offload_policy=offload,
            block_reshard_after_forward=block_raf,
            expert_mesh=expert_mesh,
            dims=dims,
        )
    if on_meta and materialize:
        _materialize(
            parts, device=device, params_on_host=offload is not None, seed=cfg.seed, init_fn=init_fn
        )
    # Post-materialise point: every part is sharded and (unless materialize=False) holds
    # its initial values; steps on the initial weights go here ([Note: materialise once]).

    if split is None:
        return Parallelized(module=model, parts=parts, pipeline=None)
    assert loss_fn is not None  # split_stages checked it
    from fsdpx.pipeline_parallel import build_runner

    runner = build_runner(split, cfg=cfg, dims=dims, mesh=mesh, device=device, loss_fn=loss_fn)
    return Parallelized(module=merged_view(parts), parts=parts, pipeline=runner)


def parallelize_part(
    part: nn.Module,
    blocks: Sequence[nn.Module],
    *,
    cfg: Config,
    mesh: DeviceMesh,
    tp_plan: TPPlan | None,
    block_names: Sequence[str],
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None,
    block_reshard_after_forward: bool | int | None,
    expert_mesh: DeviceMesh | None = None,
    dims: ParallelDims | None = None,
) -> None:
    """The per-part steps, in place, in the order of [Note: recipe order].

    Args:
        part: the model, or one pipeline stage of it.
        blocks: the blocks `part` holds.
        cfg, mesh: the config and the world mesh.
        tp_plan: from `_tp_plan` on the whole model; None without tensor parallelism.
        block_names: the whole model's block names (the sequence-parallel region's edges).
        mp_policy, offload_policy, block_reshard_after_forward: for fsdpx.zero.apply_zero.
        expert_mesh, dims: the expert mesh (fsdpx/moe/parallel.py) and the job's sizes
            when mesh.ep > 1; None otherwise.
    """
    # 1. Tensor parallelism (mesh.tp).
    if tp_plan is not None:
        apply_tensor_parallel(
            part,
            tp_plan,
            mesh[Axis.TP.value],
            sequence_parallel=cfg.tensor_parallel.sequence_parallel,
            first_block=block_names[0],
            last_block=block_names[-1],
        )
    # Sequence parallelism (mesh.sp; Hugging Face models: their attention registry, native
    # models: the engine's UlyssesSDPA mode) and tiled MLP ([Note: recipe order]).
    recompute_context = None
    if mesh[Axis.SP.value].size() > 1 or cfg.context_parallel.mlp_tile_tokens:
        from fsdpx.sequence.apply import apply_sequence_parallel

        recompute_context = apply_sequence_parallel(part, list(blocks), cfg=cfg, mesh=mesh)
    # Expert parallelism (mesh.ep): experts split over ep, tokens move by all_to_all.
    if expert_mesh is not None:
        from fsdpx.moe.parallel import apply_expert_parallel

        apply_expert_parallel(part, expert_mesh)
    # 2. Activation checkpointing.
    apply_activation_checkpointing(
        blocks, cfg.activation_checkpointing, recompute_context=recompute_context
    )
    # 3. Compile, block by block.
    if cfg.compile:
        for block in blocks:
            block.compile()
    # 4. FSDP: the experts over the expert-data-parallel ranks first (they sit inside
    # blocks), then the ZeRO stage's sharding, per block, then the part's root.
    if expert_mesh is not None:
        from fsdpx.moe.parallel import shard_experts

        assert dims is not None
        raf = stage_plan(cfg.zero).block_reshard_after_forward
        shard_experts(
            part,
            expert_mesh,
            dims,
            reshard_after_forward=raf
            if block_reshard_after_forward is None
            else block_reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            zero=cfg.zero,
        )
    apply_zero(
        part,
        list(blocks),
        mesh=ParallelDims.fsdp_mesh(mesh),
        zero=cfg.zero,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        block_reshard_after_forward=block_reshard_after_forward,
        fsdp_all_reduce=cfg.optimizer.type not in EXCHANGING_OPTIMIZERS,
    )


def _tp_plan(
    model: nn.Module, block_names: Sequence[str], *, cfg: Config, dims: ParallelDims
) -> TPPlan | None:
    """The checked tensor-parallel plan of the whole model, or None when mesh.tp = 1."""
    if dims.tp == 1:
        return None
    plan = build_plan(model, cfg.tensor_parallel, block_names)
    check_plan(model, plan, dims.tp)
    if cfg.tensor_parallel.loss_parallel and dims.pp > 1:
        raise NotImplementedError(
            "tensor_parallel.loss_parallel with pipeline parallelism (mesh.pp > 1) is not "
            "implemented yet; set loss_parallel to false (the last stage then gathers the "
            "logits and computes the loss on whole rows)"
        )
    return plan


def _materialize(
    parts: Sequence[nn.Module],
    *,
    device: torch.device,
    params_on_host: bool,
    seed: int,
    init_fn: Callable[[nn.Module], None] | None,
) -> None:
    """Allocate and initialise each sharded part ([Note: materialise once])."""
    for part in parts:
        materialize_(
            part, torch.device("cpu") if params_on_host else device, seed=seed, init_fn=init_fn
        )
        if params_on_host:
            _move_buffers_(part, device)


def _move_buffers_(model: nn.Module, device: torch.device) -> None:
    """Move every buffer (not the parameters) of `model` to `device`, in place."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
