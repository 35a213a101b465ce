"""Expert parallelism on mesh.ep, and FSDP of the experts over the expert-data-parallel ranks.

[Note: the expert mesh] ep ranks are carved out of dp_shard, torchtitan-style: the
dp_shard axis of the world mesh, of size D, is viewed as (edp = D / ep, ep) with ep
innermost, so an expert-parallel group is ep consecutive dp_shard ranks and the
expert-data-parallel group (DeepSpeed's name) is the ranks holding the same experts. The
world mesh is left as it is; `build_expert_mesh` makes a second mesh over the same ranks
with axes (pp, dp_replicate, edp, ep, tp). Expert weights are DTensors `Shard(0)` over its
ep axis and FSDP shards them over its (dp_replicate,) edp axes; both axes come from one
root, which FSDP2 requires of a parameter that is already a DTensor (its FSDP + EP path).
Every non-expert weight is sharded over all of dp_shard as before.

[Note: expert gradient scale] The loss of each data-parallel rank is its own mean; FSDP
averages non-expert gradients over the dp ranks. An expert's gradient on its owner rank
already sums the contributions of every token of the ep group (all_to_all's backward
brings them home), so summing over the edp group covers every dp rank once, and the
average over the dp ranks is that sum divided by dp = ep * edp (* dp_replicate), while
FSDP's default for the expert mesh divides by edp (* dp_replicate) only. The local expert
gradients are therefore multiplied by 1 / ep before FSDP's reduction (`Experts.grad_scale`).
FSDP2's own `set_gradient_divide_factor` is not used: in torch 2.13, on a one-rank shard
group (edp = 1) it divides twice (once in the skipped reduce-scatter's copy, once after).
The result equals the single-process gradient of the mean loss (tests/test_moe_parallel.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor

from fsdpx.config import ZeroConfig
from fsdpx.moe.experts import Experts
from fsdpx.moe.hf_experts import check_fused, enable_fused_ep, fused_experts
from fsdpx.moe.hf_per_expert import check_per_expert, enable_per_expert_ep, per_expert_blocks
from fsdpx.moe.layer import MoE, MOELayer
from fsdpx.moe.plan import planned_blocks
from fsdpx.parallel_dims import Axis, ParallelDims
from fsdpx.zero import install_comms

EDP = "edp"
EP = "ep"
_EXPERT_AXES = (Axis.PP.value, Axis.DP_REPLICATE.value, EDP, EP, Axis.TP.value)


def moe_layers(model: nn.Module) -> Iterator[tuple[str, MOELayer]]:
    """Every MOELayer of `model` with its qualified name."""
    for name, module in model.named_modules():
        if isinstance(module, MOELayer):
            yield name, module


def expert_param_ids(model: nn.Module) -> set[int]:
    """ids of the parameters expert parallelism splits: every fsdpx.moe layer's stacked
    experts and every Hugging Face fused experts module's 3-D weights (the estimator's
    expert terms, fsdpx/estimate.py)."""
    ids = {id(p) for _, layer in moe_layers(model) for p in layer.experts.parameters()}
    ids |= {id(p) for _, _, experts in planned_blocks(model) for p in experts.parameters()}
    ids |= {id(p) for _, module in fused_experts(model) for p in module.parameters()}
    for _, block in per_expert_blocks(model):
        ids |= {id(p) for p in block.get_submodule("experts").parameters()}
    return ids


def check_expert_parallel(model: nn.Module, dims: ParallelDims, zero_stage: int) -> None:
    """The checks every rank makes before any collective (same inputs, same verdict).
    (A meta-built model under mesh.ep > 1 needs init_fn: fsdpx.parallelize checks that.)

    Raises:
        ValueError: an MoE whose ep_size differs from mesh.ep; mesh.ep > 1 with no MoE
            layer, at ZeRO stage 0, or with experts not divisible by mesh.ep.
    """
    layers = list(moe_layers(model))
    for name, module in model.named_modules():
        if isinstance(module, MoE) and module.ep_size != dims.ep:
            raise ValueError(
                f"MoE layer {name!r} was built with ep_size={module.ep_size} but mesh.ep is "
                f"{dims.ep}: they must be equal (expert parallelism runs on mesh.ep); build "
                f"the layer with ep_size={dims.ep} or set mesh.ep to {module.ep_size}"
            )
    if dims.ep == 1:
        return
    fused = fused_experts(model)
    per_expert = per_expert_blocks(model)
    planned = [(name, experts) for name, _, experts in planned_blocks(model)]
    if not layers and not fused and not per_expert and not planned:
        raise ValueError(
            f"mesh.ep = {dims.ep} but the model has no fsdpx.moe MoE layer, no Hugging "
            "Face fused experts (3-D gate_up_proj / down_proj), no Mixtral / Qwen-MoE block "
            "with one module per expert (experts.N.w1 / gate_proj ...) and no block matched "
            "by moe.plan to split: set mesh.ep to 1, build the model's expert layers with "
            "fsdpx.moe.MoE, or describe its MoE blocks in moe.plan"
        )
    for name, experts in planned:
        if experts.num_experts % dims.ep != 0:
            raise ValueError(
                f"moe.plan block {name!r} has {experts.num_experts} experts, not divisible "
                f"by mesh.ep ({dims.ep}); choose an ep that divides the number of experts"
            )
    for name, module in fused:
        check_fused(name, module, dims.ep)
    for name, block in per_expert:
        check_per_expert(name, block, dims.ep)
    if zero_stage == 0:
        raise ValueError(
            f"mesh.ep = {dims.ep} needs ZeRO stage 1, 2 or 3 (stage 0 replicates every "
            "weight over all data-parallel ranks); set zero.stage >= 1 or mesh.ep to 1"
        )
    for name, layer in layers:
        if layer.num_experts % dims.ep != 0:
            raise ValueError(
                f"MoE layer {name!r} has {layer.num_experts} experts, not divisible by "
                f"mesh.ep ({dims.ep}); choose an ep that divides the number of experts"
            )


def build_expert_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The (pp, dp_replicate, edp, ep, tp) mesh of [Note: the expert mesh]; every rank calls it."""
    shape = (dims.pp, dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep, dims.tp)
    ranks = torch.arange(dims.world_size).reshape(shape)
    return DeviceMesh(device_type, ranks, mesh_dim_names=_EXPERT_AXES)


def apply_expert_parallel(part: nn.Module, expert_mesh: DeviceMesh) -> None:
    """Split each MoE layer's stacked experts (and each Hugging Face fused experts module:
    fsdpx/moe/hf_experts.py) over the ep axis and give it its ep group."""
    ep_mesh = expert_mesh[EP]
    for _, module in fused_experts(part):
        enable_fused_ep(module, ep_mesh)
    for _, block in per_expert_blocks(part):
        enable_per_expert_ep(block, ep_mesh)
    for _, layer in moe_layers(part):
        _split_experts(layer.experts, ep_mesh)
        layer.ep_group = ep_mesh.get_group()
    for _, block, experts in planned_blocks(part):
        _split_experts(experts, ep_mesh)
        block._fsdpx_ep_group = ep_mesh.get_group()  # type: ignore[assignment]


def _split_experts(experts: Experts, ep_mesh: DeviceMesh) -> None:
    """Each stacked parameter as a DTensor Shard(0) over ep; gradients pre-scaled."""
    for name, param in list(experts.expert.named_parameters()):
        owner_name, _, leaf = name.rpartition(".")
        owner = experts.expert.get_submodule(owner_name) if owner_name else experts.expert
        # Every rank holds rank 0's values already ([Note: rank 0's initial weights]):
        # src_data_rank=None cuts the local block without a scatter.
        sharded = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
        setattr(owner, leaf, nn.Parameter(sharded, requires_grad=param.requires_grad))
    experts.grad_scale = 1.0 / ep_mesh.size()


def shard_experts(
    part: nn.Module,
    expert_mesh: DeviceMesh,
    dims: ParallelDims,
    *,
    reshard_after_forward: bool | int,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None,
    zero: ZeroConfig,
) -> None:
    """fully_shard each MoE layer's experts over the expert-data-parallel ranks (their
    gradients pre-scaled: [Note: expert gradient scale]); call before the blocks are sharded.
    Their collectives go through fsdpx's comm slot like every other unit's (counted, and
    quantized under ZeRO++: fsdpx.zero.install_comms)."""
    if dims.dp_replicate > 1:
        fsdp_mesh = expert_mesh[(Axis.DP_REPLICATE.value, EDP)]
    else:
        fsdp_mesh = expert_mesh[EDP]
    units: list[nn.Module] = [layer.experts for _, layer in moe_layers(part)]
    units += [experts for _, _, experts in planned_blocks(part)]
    units += [module for _, module in fused_experts(part)]
    units += [block.get_submodule("experts") for _, block in per_expert_blocks(part)]
    for unit in units:
        fully_shard(
            unit,
            mesh=fsdp_mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mp_policy,
            offload_policy=offload_policy or OffloadPolicy(),
        )
        install_comms(unit, zero)  # asserts the unit is an FSDPModule now
