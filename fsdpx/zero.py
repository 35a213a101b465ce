"""ZeRO stages on FSDP2: which `fully_shard` settings each stage means, applied per block.

| stage | reshard_after_forward (blocks / root) | gradient sync during accumulation |
|-------|---------------------------------------|-----------------------------------|
| 0     | False / False, shard group of size 1  | only at the boundary (DDP no_sync) |
| 1     | False / False                         | only at the boundary               |
| 2     | False / False                         | reduce-scatter every micro-step    |
| 3     | True (or hpZ int) / False             | reduce-scatter every micro-step    |

Stage 0 is FSDP over a (dp, 1) mesh: a shard group of one rank is replication, and the
replicate axis all-reduces gradients, so DDP shares every code path with the other stages.

[Note: stale parameters] Stages 0-2 skip resharding after backward on non-boundary
micro-steps (the gathered parameters are reused by the next forward). On the boundary
micro-step resharding must be switched back on *before* backward: otherwise the optimizer
updates the sharded parameters while forward keeps using the old gathered copy, silently.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fsdpx.comm import fsdp_slot, qgz_hier
from fsdpx.config import ZeroConfig
from fsdpx.parallel_dims import Axis, ParallelDims


@dataclass(frozen=True)
class StagePlan:
    """The FSDP2 settings one ZeRO stage stands for."""

    block_reshard_after_forward: bool | int
    sync_grads_every_micro_step: bool


def stage_plan(zero: ZeroConfig) -> StagePlan:
    if zero.stage == 3:
        raf: bool | int = zero.hpz_partition_size if zero.hpz_partition_size > 1 else True
        return StagePlan(raf, sync_grads_every_micro_step=True)
    return StagePlan(False, sync_grads_every_micro_step=zero.stage == 2)


def dims_for_stage(dims: ParallelDims, zero: ZeroConfig) -> ParallelDims:
    """Stage 0 replicates: fold the shard axis into the replicate axis."""
    if zero.stage != 0:
        if zero.hpz_partition_size > 1 and dims.dp_shard % zero.hpz_partition_size != 0:
            raise ValueError(
                f"zero.hpz_partition_size ({zero.hpz_partition_size}) must divide the shard "
                f"group size mesh.dp_shard ({dims.dp_shard})"
            )
        return dims
    return dataclasses.replace(dims, dp_replicate=dims.dp, dp_shard=1)


def apply_zero(
    model: nn.Module,
    blocks: list[nn.Module],
    *,
    mesh: DeviceMesh,
    zero: ZeroConfig,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None = None,
    block_reshard_after_forward: bool | int | None = None,
    fsdp_all_reduce: bool = True,
) -> FSDPModule:
    """Shard each block, then the root, with the settings of `zero.stage`, in place.

    Args:
        model: the model (on its device, or on meta to be materialised after sharding).
        blocks: units sharded one by one (see fsdpx.blocks.find_blocks).
        mesh: the 2D (dp_replicate, dp_shard) mesh (ParallelDims.fsdp_mesh).
        block_reshard_after_forward: overrides the stage's block setting (pipeline
            parallelism forces False: [Note: no resharding under PP] in
            fsdpx/parallelize.py).
        fsdp_all_reduce: False at stage 0 shards over the one-rank shard axis only, so FSDP
            issues no gradient collective: the optimizer exchanges gradients itself
            ([Note: who owns the gradient exchange] in fsdpx/onebit_adam.py).
    Returns:
        The model, now an FSDPModule.
    """
    plan = stage_plan(zero)
    raf = plan.block_reshard_after_forward
    if block_reshard_after_forward is not None:
        raf = block_reshard_after_forward
    offload = offload_policy or OffloadPolicy()
    if not fsdp_all_reduce:
        if zero.stage != 0:
            raise ValueError(
                f"only ZeRO stage 0 can leave the gradient exchange to the optimizer "
                f"(full replicas); got stage {zero.stage}"
            )
        if mesh.ndim == 2:
            mesh = mesh[Axis.DP_SHARD.value]
    if zero.quantized_gradients_hierarchical:
        # Refused here, before any unit is sharded, rather than at the first backward.
        # FSDP shards over the mesh's last dim (dp_shard, or dp_shard x sp flattened).
        group = mesh.get_group(mesh.ndim - 1)
        ranks = [dist.get_global_rank(group, i) for i in range(group.size())]
        node_size = qgz_hier.resolve_node_size(zero.quantized_gradients_node_size)
        qgz_hier.plan(ranks, node_size, ranks[0])
    for block in blocks:
        fully_shard(
            block,
            mesh=mesh,
            reshard_after_forward=raf,
            mp_policy=mp_policy,
            offload_policy=offload,
        )
        install_comms(block, zero)
    # The root (embeddings, head) is needed right away in backward: never reshard it.
    fully_shard(
        model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload
    )
    install_comms(model, zero)
    assert isinstance(model, FSDPModule)
    return model


def install_comms(module: nn.Module, zero: ZeroConfig) -> None:
    """fsdpx owns every FSDP module's collective slot: counted, and quantized for ZeRO++."""
    assert isinstance(module, FSDPModule)
    fsdp_slot.install(
        module,
        quantized_weights=zero.quantized_weights,
        weights_dtype=zero.quantized_weights_dtype,
        quantized_gradients=zero.quantized_gradients,
        gradient_bits=zero.quantized_gradients_bits,
        block_size=zero.quantization_block_size,
        node_size=(
            qgz_hier.resolve_node_size(zero.quantized_gradients_node_size)
            if zero.quantized_gradients_hierarchical
            else 0
        ),
    )


def prepare_micro_step(model: FSDPModule, zero: ZeroConfig, *, is_boundary: bool) -> None:
    """Set gradient sync and resharding for the coming backward (see [Note: stale parameters])."""
    plan = stage_plan(zero)
    model.set_requires_gradient_sync(plan.sync_grads_every_micro_step or is_boundary)
    if zero.stage != 3:
        model.set_reshard_after_backward(is_boundary)
