"""`zero.GatheredParameters` on FSDP2: full parameters inside a `with`, written back on exit.

[Note: GatheredParameters on FSDP2]
DeepSpeed gathers a ZeRO-3 parameter in place (the same Parameter object gets its full
data) and re-partitions it on exit. FSDP2 gives a parameter no back-pointer to its owner,
so the owner is found through FSDP2's registry of states (`_module_state_mapping`, the map
`fully_shard` fills): each state's param groups list their FSDPParams, whose
`sharded_param` is the DTensor `model.parameters()` yields and whose `_module_info` names
every (module, attribute) holding it, tied weights included.

Why not FSDP2's own unshard()/reshard(): unshard gathers in the mixed-precision
`param_dtype` (bf16 values are not the fp32 masters), covers the whole param group, and
reshard throws the unsharded copy away, so a write could not be kept. Instead, on enter:

1. each parameter's shards are gathered with DTensor's `full_tensor()` (CPU-offloaded
   shards are first moved to FSDP's compute device), at the master dtype, over the
   parameter's whole mesh: FSDP's axes and a TP axis alike;
2. a new Parameter around that full tensor is put in place of the sharded one on every
   owning module, so `model.layer.weight` reads the full tensor. A gather that merely
   returns the local tensor (stage 0: the mesh is (dp, 1)) is cloned, so writes never
   reach the shard behind the context's back.

On exit the sharded Parameter is put back. With `modifier_rank` set, that rank's full
tensor (`.data` of the Parameter the module held, so `p.data = t`, `p.data.copy_(t)` and
`p[i] = v` all count) is broadcast along each mesh axis in turn (a (dp_replicate,
dp_shard) or (dp, tp) mesh has no single group) and every rank copies its own slice into
its shard in place, so the optimizer's state keeps pointing at the same tensors. A tensor
of another shape or dtype on that rank is an error there; a flag broadcast first tells the
other ranks to write nothing rather than wait. With `modifier_rank=None` nothing is
written: changes made inside are dropped (DeepSpeed re-partitions without an update too).
Same for a `with` body that raises: the parameters are restored without any collective,
since other ranks may not be at the exit. Like DeepSpeed, all the parameters given are
full at once (memory: their full sizes); a reference kept past the context is a copy no
longer connected to the model.

ZeRO-Offload keeps the fp32 masters in its optimizer (fsdpx/offload/cpu.py) and copies
them onto the parameters after each step, which would undo a write; so the shards
written are also copied into the masters of the offloaded optimizer that owns them (found
through fsdpx.checkpoint.external's registry), through the same checkpoint view
a model load uses. A 16-bit device copy rounds what was written, as in DeepSpeed.

`modifier_rank` is a rank within the parameter's mesh (its flattened rank list); when the
mesh spans the world, as without pipeline parallelism, that is the global rank.
DeepSpeed's counterpart is the rank within the parameter's data-parallel group.

A parameter FSDP2 holds unsharded at the moment (ZeRO 0-2 between micro-steps of
accumulation) is resharded first, which only costs the next forward a gather; inside
forward or backward (FSDP2 not idle) the context refuses. So it refuses `fwd_module`:
DeepSpeed uses it to let a module read another module's ZeRO-3 weight in forward, whose
gradient would not reach the sharded parameter here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable_state import _get_module_state, _module_state_mapping
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
from torch.distributed.fsdp._fully_shard._fsdp_param import (
    FSDPParam,
    ShardedState,
    unsafe_setattr_param,
)
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
from torch.distributed.tensor import DTensor, distribute_tensor

from fsdpx.checkpoint.external import ExternalState, external_state_owner
from fsdpx.comm.fsdp_groups import param_groups

# id(sharded Parameter) and id(full Parameter) of every parameter gathered right now.
_ACTIVE: set[int] = set()


@dataclass
class _Entry:
    fsdp_param: FSDPParam
    sharded: DTensor  # the (DTensor) Parameter FSDP2 owns, which the optimizer holds
    full: torch.Tensor  # this rank's gathered copy; non-modifier ranks receive into it
    held: nn.Parameter  # what the owning modules hold inside the context


def _fsdp_index() -> dict[int, tuple[FSDPParam, FSDPParamGroup]]:
    """id(parameter) -> its FSDPParam and group, for every FSDP2 state alive, under the
    sharded Parameter's id and under the ids of its unsharded forms."""
    index: dict[int, tuple[FSDPParam, FSDPParamGroup]] = {}
    seen: set[int] = set()
    for module in list(_module_state_mapping.keys()):
        state = _get_module_state(module)
        if not isinstance(state, FSDPState) or id(state) in seen:
            continue
        seen.add(id(state))
        for group in param_groups(state):
            for fp in group.fsdp_params:
                index[id(fp.sharded_param)] = (fp, group)
                for attr in ("_unsharded_param", "_sharded_post_forward_param"):
                    other = getattr(fp, attr, None)
                    if other is not None:
                        index[id(other)] = (fp, group)
    return index


def _offloaded_optimizers() -> list[ExternalState]:
    """The optimizers holding external fp32 masters (offload) for models FSDP2 shards
    (fsdpx.checkpoint.external's registry)."""
    found: dict[int, ExternalState] = {}
    for module in list(_module_state_mapping.keys()):
        opt = external_state_owner(module, None)
        if isinstance(opt, ExternalState):
            found[id(opt)] = opt
    return list(found.values())


def _update_offloaded_masters(entries: list[_Entry]) -> None:
    written = {id(e.sharded): e.sharded for e in entries}
    if not written:
        return
    for opt in _offloaded_optimizers():
        with opt.checkpoint_view() as masters:
            mine = [pid for pid in written if pid in masters]
            for pid in mine:
                master = masters[pid]
                local = master.to_local() if isinstance(master, DTensor) else master
                local.copy_(written[pid].to_local())
        if mine:
            opt.after_load()  # masters -> device parameters


def _as_list(params: Any) -> list[torch.Tensor]:
    # DeepSpeed: a tensor is one parameter; any other iterable (a generator such as
    # module.parameters() included) is read once; non-tensors are ignored.
    items = (
        list(params)
        if isinstance(params, Iterable) and not isinstance(params, torch.Tensor)
        else [params]
    )
    out: list[torch.Tensor] = []
    ids: set[int] = set()
    for p in items:
        if isinstance(p, torch.Tensor) and id(p) not in ids:
            ids.add(id(p))
            out.append(p)
    return out


def _owners(fp: FSDPParam) -> list[tuple[nn.Module, str]]:
    info = fp._module_info
    return [
        (info.module, info.param_name),
        *zip(info.shared_modules, info.shared_param_names, strict=True),
    ]


def _broadcast_over_mesh(tensor: torch.Tensor, mesh: DeviceMesh, src_index: int) -> None:
    """Broadcast from the mesh's `src_index`-th rank to all its ranks, one axis at a time.

    After the pass over axis d, every rank whose coordinates on the axes after d equal the
    source's holds the data; after the last axis, every rank does."""
    src_global = int(mesh.mesh.flatten()[src_index])
    coord = [int(c) for c in (mesh.mesh == src_global).nonzero()[0]]
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            dist.broadcast(tensor, group=mesh.get_group(dim), group_src=coord[dim])


class GatheredParameters:
    """Inside the `with`, `params` are full tensors on every rank; with `modifier_rank`
    set, that rank's values at exit become every rank's shards ([Note: GatheredParameters
    on FSDP2] in fsdpx/deepspeed/_gathered.py).

    Example::

        with deepspeed.zero.GatheredParameters(model.head.weight, modifier_rank=0):
            if deepspeed.comm.get_rank() == 0:
                model.head.weight.data.normal_(std=0.02)
    """

    def __init__(
        self,
        params: Any,
        modifier_rank: int | None = None,
        fwd_module: nn.Module | None = None,
        enabled: bool = True,
    ) -> None:
        if fwd_module is not None:
            raise ValueError(
                "zero.GatheredParameters(fwd_module=...) registers a ZeRO-3 parameter for use "
                "in another module's forward; under FSDP2 its gradient would not reach the "
                "sharded parameter. Shard the modules that share the weight as one FSDP unit "
                "(or tie the weight) and read it in forward without GatheredParameters"
            )
        if modifier_rank is not None and (
            isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)
        ):
            raise TypeError(
                f"zero.GatheredParameters: modifier_rank must be an int or None, got {modifier_rank!r}"
            )
        self.enabled = enabled
        self.modifier_rank = modifier_rank
        self._params = _as_list(params) if enabled else []
        self._entries: list[_Entry] = []

    def __enter__(self) -> None:
        if not self.enabled or not self._params:
            return
        resolved = self._resolve()
        with torch.no_grad():
            for fp, _ in resolved:
                self._entries.append(self._gather(fp))
        for e in self._entries:
            for module, name in _owners(e.fsdp_param):
                unsafe_setattr_param(module, name, e.held)
            _ACTIVE.update((id(e.sharded), id(e.held)))

    def _resolve(self) -> list[tuple[FSDPParam, FSDPParamGroup]]:
        """The FSDPParams behind the parameters, checked before any collective runs."""
        index = _fsdp_index()
        resolved: list[tuple[FSDPParam, FSDPParamGroup]] = []
        for p in self._params:
            if id(p) in _ACTIVE:
                raise RuntimeError(
                    "zero.GatheredParameters: a parameter of shape "
                    f"{tuple(p.shape)} is already gathered by an enclosing GatheredParameters; "
                    "nested contexts cannot overlap parameters (as in DeepSpeed)"
                )
            found = index.get(id(p))
            if found is None:
                if isinstance(p, DTensor):
                    raise ValueError(
                        f"zero.GatheredParameters: a DTensor parameter of shape {tuple(p.shape)} "
                        f"(placements {p.placements}) is not managed by FSDP2's fully_shard, so "
                        "its owning module is unknown; pass parameters of a model sharded by "
                        "deepspeed.initialize / fsdpx.shard"
                    )
                continue  # not sharded (a plain or meta tensor): nothing to gather, as in DeepSpeed
            fp, group = found
            if any(fp is other for other, _ in resolved):
                continue  # the same parameter under two forms
            if group._training_state != TrainingState.IDLE:
                raise RuntimeError(
                    "zero.GatheredParameters cannot run inside the forward or backward of the "
                    f"module that owns the parameter (FSDP2 state {group._training_state.name}); "
                    "gather it before forward or after the optimizer step"
                )
            if fp.sharded_param.device.type == "meta":
                raise ValueError(
                    "zero.GatheredParameters: the parameter is sharded but still on the meta "
                    "device; gather it after deepspeed.initialize has materialised the model"
                )
            mesh_size = cast(DTensor, fp.sharded_param).device_mesh.size()
            if self.modifier_rank is not None and not 0 <= self.modifier_rank < mesh_size:
                raise ValueError(
                    f"zero.GatheredParameters: modifier_rank={self.modifier_rank} is not a rank of "
                    f"the parameter's mesh of {mesh_size} ranks; expected 0..{mesh_size - 1}"
                )
            resolved.append((fp, group))
        for fp, group in resolved:
            if fp.sharded_state != ShardedState.SHARDED:
                group.reshard()  # between micro-steps: FSDP2 gathers again at the next forward
        return resolved

    @staticmethod
    def _gather(fp: FSDPParam) -> _Entry:
        sharded = fp.sharded_param
        assert isinstance(sharded, DTensor)
        local = sharded.to_local()
        shard = local.to(fp.device) if local.device != fp.device else local
        full = DTensor.from_local(
            shard,
            sharded.device_mesh,
            sharded.placements,
            run_check=False,
            shape=sharded.shape,
            stride=sharded.stride(),
        ).full_tensor()
        if full.untyped_storage().data_ptr() == local.untyped_storage().data_ptr():
            full = full.clone()  # a replicated parameter: the gather returned the shard itself
        held = nn.Parameter(full, requires_grad=sharded.requires_grad)
        return _Entry(fp, sharded, full, held)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._entries:
            return
        entries, self._entries = self._entries, []
        problems: list[str] = []
        try:
            if self.modifier_rank is not None and exc_type is None:
                with torch.no_grad():
                    written = []
                    for e in entries:
                        problem = self._write_back(e, self.modifier_rank)
                        if problem is None:
                            written.append(e)
                        else:
                            problems.append(problem)
                    _update_offloaded_masters(written)
        finally:
            for e in entries:
                for module, name in _owners(e.fsdp_param):
                    unsafe_setattr_param(module, name, cast(nn.Parameter, e.sharded))
                _ACTIVE.difference_update((id(e.sharded), id(e.held)))
        if problems:
            raise RuntimeError(problems[0])
        if exc_type is None and any(e.held.grad is not None for e in entries):
            raise RuntimeError(
                "zero.GatheredParameters: a gradient was computed for a gathered parameter "
                "inside the context; it belongs to the temporary full tensor and is dropped. "
                "Run forward/backward outside GatheredParameters"
            )

    @staticmethod
    def _write_back(e: _Entry, modifier_rank: int) -> str | None:
        """Broadcast modifier_rank's full tensor and copy this rank's slice into the shard.
        Returns the error to raise on modifier_rank when its tensor no longer fits; every
        rank then learns it from a flag broadcast first and writes nothing, so none hangs."""
        mesh = e.sharded.device_mesh
        problem = None
        buf = e.full
        if dist.get_rank() == int(mesh.mesh.flatten()[modifier_rank]):
            data = e.held.data
            if data.shape != e.full.shape or data.dtype != e.full.dtype:
                problem = (
                    "zero.GatheredParameters: on modifier_rank the parameter's data became "
                    f"{tuple(data.shape)} {data.dtype}, expected {tuple(e.full.shape)} "
                    f"{e.full.dtype}; nothing was written. Write values into it, do not "
                    "reshape or recast it"
                )
            else:
                buf = data.to(e.full.device).contiguous()
        flag = torch.tensor([problem is not None], dtype=torch.int32, device=e.full.device)
        _broadcast_over_mesh(flag, mesh, modifier_rank)
        if flag.item():
            return problem
        _broadcast_over_mesh(buf, mesh, modifier_rank)
        # Every rank now holds the same full tensor: slicing it locally is exact.
        mine = distribute_tensor(buf, mesh, e.sharded.placements, src_data_rank=None).to_local()
        e.sharded.to_local().copy_(mine)
        return None
