"""What a checkpoint holds, collected from live objects: tensors as rectangles of global
tensors, everything else as msgpack-able values.

[Note: pieces] Every tensor is saved as the pieces the ranks hold, each a rectangle of the
global tensor (`global_shape`, `offsets`, local shape). A DTensor's rectangle comes from its
placements (`compute_local_shape_and_global_offset`, the same chunking FSDP2 uses, so odd
sizes and empty shards come out right); a plain tensor is one piece covering all of it.
Replicas are written once: a rank writes a piece only when its coordinate is 0 on every
mesh axis that replicates the tensor; a plain tensor by rank 0, or under pipeline
parallelism by one rank per stage (`plain_writer`, see [Note: pipeline checkpoints] in
saving.py: overlapping pieces are allowed and hold equal values). Loading is the mirror
image: each rank computes the rectangle of each of *its* tensors under the *new* layout
and reads exactly that, so world size, ZeRO stage and mesh may all change in between.

Names (checkpoint_tools/FORMAT.md): "model/<state-dict key>" for parameters and buffers,
"optim/<parameter fqn>/<state key>" for optimizer state (Adam's `step` is a 0-d tensor).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

try:
    from torch.distributed.tensor.placement_types import _StridedShardOffsetMode
except ImportError:  # torch < 2.13 (e.g. a GPU image's older torch): no FSDP-over-TP saves
    _StridedShardOffsetMode = None  # type: ignore[assignment,misc]

from checkpoint_tools.format import MODEL_PREFIX, optim_name, rank_optim_prefix
from fsdpx.dtensor import to_local

_MSGPACK_INT = (-(2**63), 2**64 - 1)


@dataclass(frozen=True)
class Piece:
    """This rank's rectangle of one global tensor."""

    name: str
    tensor: torch.Tensor
    """The local data (a plain tensor; a view of the live tensor unless snapshotted)."""
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def _strided_is_rectangle(t: DTensor) -> bool:
    """Whether this rank's elements of a DTensor with _StridedShard placements (FSDP2 over
    tensor parallelism: a shard of a shard) form one rectangle of the global tensor.

    torch's compute_local_shape_and_global_offset returns only the first index per dim;
    here the index lists are followed placement by placement, as torch does internally.
    """
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return True
    if _StridedShardOffsetMode is None:
        raise NotImplementedError(
            f"checkpointing FSDP-over-TP shards needs torch >= 2.13, this is {torch.__version__}"
        )
    sizes = list(t.shape)
    index: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(t.placements):
        n, r = t.device_mesh.size(mesh_dim), coord[mesh_dim]
        if isinstance(p, _StridedShard):
            size, offs = p._local_shard_size_and_offset(
                sizes[p.dim], n, r, offset_mode=_StridedShardOffsetMode.ALL
            )
            local = torch.tensor(offs if isinstance(offs, list) else [], dtype=torch.long)
        elif isinstance(p, Shard):
            size, off = p._local_shard_size_and_offset(sizes[p.dim], n, r)
            local = torch.arange(int(off), int(off) + int(size))
        else:
            continue
        prev = index.get(p.dim)
        index[p.dim] = local[: int(size)] if prev is None else prev[local[: int(size)]]
        sizes[p.dim] = int(size)
    return all(
        len(v) == 0 or torch.equal(v, torch.arange(int(v[0]), int(v[0]) + len(v)))
        for v in index.values()
    )


def rectangle(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, global offsets) of this rank's part of `t` (all of it when plain)."""
    if isinstance(t, DTensor):
        strided = False
        for p in t.placements:
            strided = strided or isinstance(p, _StridedShard)
            if not isinstance(p, Shard | Replicate | _StridedShard):
                raise NotImplementedError(
                    f"cannot checkpoint a DTensor with placement {p} (only Shard, "
                    f"Replicate and FSDP-over-TP strided shards are supported); got "
                    f"placements {t.placements}"
                )
        if strided and not _strided_is_rectangle(t):
            raise NotImplementedError(
                f"placements {t.placements} give this rank elements that are not one "
                "rectangle of the global tensor; the checkpoint format stores rectangles"
            )
        shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return tuple(shape), tuple(offsets)
    return tuple(t.shape), (0,) * t.dim()


def writes_piece(t: torch.Tensor, rank: int, plain_writer: bool | None = None) -> bool:
    """Whether this rank writes its piece of `t` (one writer per replicated piece).
    plain_writer decides for plain tensors (None: rank 0 writes them)."""
    if not isinstance(t, DTensor):
        return rank == 0 if plain_writer is None else plain_writer
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return False
    return all(c == 0 for c, p in zip(coord, t.placements, strict=True) if isinstance(p, Replicate))


def _piece(
    name: str, t: torch.Tensor, rank: int, plain_writer: bool | None, every_held: bool
) -> Piece | None:
    if every_held:  # [Note: node-local checkpoints]: what this rank holds, even if empty
        if isinstance(t, DTensor) and t.device_mesh.get_coordinate() is None:
            return None
    elif not writes_piece(t, rank, plain_writer):
        return None
    shape, offsets = rectangle(t)
    local = to_local(t).detach()
    assert tuple(local.shape) == shape, f"{name}: {local.shape=} but placement says {shape}"
    if local.numel() == 0 and t.numel() != 0 and not every_held:
        return None  # an empty shard of a non-empty tensor carries nothing
    return Piece(name, local, tuple(t.shape), offsets)


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict. For FSDP2 modules its pre-hook puts the parameters into
    their sharded form first, so `named_parameters()` afterwards yields the very
    parameters the optimizer steps."""
    return dict(model.state_dict())


def param_names(model: nn.Module) -> dict[int, str]:
    """id(parameter) -> fully qualified name (call after model_tensors, see there)."""
    return {id(p): name for name, p in model.named_parameters()}


def _group_params(
    optimizer: torch.optim.Optimizer, names: dict[int, str]
) -> Iterator[tuple[int, str, torch.Tensor]]:
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param group {gi} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a parameter of the model; checkpoints "
                    "name optimizer state by the model's parameter names, so build the "
                    "optimizer over model.parameters() (after sharding)"
                )
            yield gi, names[id(p)], p


def with_masters(
    model: nn.Module, tensors: dict[str, torch.Tensor], masters: dict[int, Any]
) -> dict[str, torch.Tensor]:
    """`tensors` (the model's state dict) with each offloaded parameter replaced by its
    fp32 master (call after model_tensors, see there)."""
    if not masters:
        return tensors
    by_name = {n: masters[id(p)] for n, p in model.named_parameters() if id(p) in masters}
    return {k: by_name.get(k, t) for k, t in tensors.items()}


def collect_pieces(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    rank: int,
    plain_writer: bool | None = None,
    masters: dict[int, Any] | None = None,
    every_held: bool = False,
) -> tuple[list[Piece], dict[str, Any] | None]:
    """The pieces this rank writes, and the optimizer's non-tensor state (msgpack-able).

    Args:
        model, optimizer: what to save (optimizer may be None).
        rank: this rank in the checkpoint's process group.
        plain_writer: whether this rank writes plain (non-DTensor) tensors; None: rank 0.
        masters: from external_state_view: fp32 masters saved in place of parameters.
        every_held: write every piece this rank holds, replicas, plain tensors and empty
            shards included, so the files of each node's ranks hold everything those
            ranks need to load ([Note: node-local checkpoints]); plain_writer is unused.

    Returns:
        (pieces, optimizer_meta) where optimizer_meta is None without an optimizer, else
        {"param_groups": [{"params": [fqn, ...], <hyperparameters>}, ...],
         "tensor_keys": {fqn: [state key, ...]}, "extra": {fqn: {key: value}}}.
    """
    pieces = []
    for key, t in with_masters(model, model_tensors(model), masters or {}).items():
        piece = _piece(MODEL_PREFIX + key, t, rank, plain_writer, every_held)
        if piece is not None:
            pieces.append(piece)
    if optimizer is None:
        return pieces, None
    names = param_names(model)
    groups: list[dict[str, Any]] = [
        {**{k: v for k, v in g.items() if k != "params"}, "params": []}
        for g in optimizer.param_groups
    ]
    tensor_keys: dict[str, list[str]] = {}
    extra: dict[str, dict[str, Any]] = {}
    for gi, fqn, p in _group_params(optimizer, names):
        groups[gi]["params"].append(fqn)
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                tensor_keys.setdefault(fqn, []).append(k)
                piece = _piece(optim_name(fqn, k), v, rank, plain_writer, every_held)
                if piece is not None:
                    pieces.append(piece)
            else:
                extra.setdefault(fqn, {})[k] = v
    meta = {"param_groups": groups, "tensor_keys": tensor_keys, "extra": extra}
    pieces.extend(rank_local_pieces(optimizer, rank))
    return pieces, to_plain(meta, "optimizer state")


def rank_local_pieces(optimizer: torch.optim.Optimizer, rank: int) -> list[Piece]:
    """This rank's own optimizer state, `rank/<rank>/optim/<key>`.

    [Note: per-rank optimizer state] The 1-bit optimizers (fsdpx/onebit_adam.py and its
    siblings) keep error-feedback buffers that differ on every rank, unlike the rest of
    their state, which replicas share. An optimizer with `rank_local_state()` (key ->
    tensor) and `load_rank_local_state(dict)` has each rank write its own tensors under
    its own names (each one piece covering the whole tensor), so a resume at the same
    world size continues exactly.

    [Note: per-rank optimizer state at another world size] The buffers cannot be
    resharded: each holds what one rank's sign compression lost (the worker buffer) and
    what its server chunk lost (1/W of the padded tensor), and neither sums nor splits
    into what W' other ranks would have lost. So the loader hands the optimizer nothing
    and rank 0 logs a warning naming both world sizes: the feedback restarts at zero, as
    DeepSpeed's OnebitAdam / ZeroOneAdam / OnebitLamb reset it on *every* load (their
    load_state_dict pops worker_error and server_error: "you need to have the exact same
    number of GPUs in order to load them correctly"). The rest of their state is shared
    by the replicas and loads at any world size; tests/test_onebit_reshard.py checks both
    directions (4 -> 2, 2 -> 4) for the three optimizers.
    """
    state = getattr(optimizer, "rank_local_state", None)
    if not callable(state):
        return []
    prefix = rank_optim_prefix(rank)
    out = []
    for key, t in state().items():
        local = t.detach()
        out.append(Piece(prefix + key, local, tuple(local.shape), (0,) * local.dim()))
    return out


def merge_optimizer_meta(metas: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One optimizer description from the ranks' collect_pieces metadata, for a model
    whose ranks hold different parameters (pipeline stages).

    Each param group keeps the first rank's hyperparameters (every stage builds its
    optimizer from the same config) and lists every rank's parameters once, in rank
    order; tensor_keys and extra are the union over ranks.

    Example::

        merge_optimizer_meta([stage0_meta, stage1_meta])["param_groups"][0]["params"]
        # ["wte.weight", "blocks.0.attn.weight", ..., "lm_head.weight"]
    """
    present = [m for m in metas if m is not None]
    if not present:
        return None
    groups = [{**g, "params": []} for g in present[0]["param_groups"]]
    seen: set[str] = set()
    tensor_keys: dict[str, list[str]] = {}
    extra: dict[str, dict[str, Any]] = {}
    for meta in present:
        if len(meta["param_groups"]) != len(groups):
            raise ValueError(
                f"the ranks' optimizers have different numbers of param groups "
                f"({len(groups)} and {len(meta['param_groups'])}); build every stage's "
                "optimizer with the same param groups"
            )
        for merged, group in zip(groups, meta["param_groups"], strict=True):
            for fqn in group["params"]:
                if fqn not in seen:
                    seen.add(fqn)
                    merged["params"].append(fqn)
        tensor_keys.update(meta["tensor_keys"])
        extra.update(meta["extra"])
    return {"param_groups": groups, "tensor_keys": tensor_keys, "extra": extra}


def snapshot(pieces: list[Piece], staging: dict[str, torch.Tensor] | None = None) -> list[Piece]:
    """Copies of the pieces in host memory, independent of the live tensors (async save).

    Args:
        pieces: what collect_pieces returned.
        staging: host buffers by piece name, reused when shape and dtype still match and
            refilled in place (allocating and faulting in fresh pages is most of the cost
            of a snapshot); new buffers are added to it. The caller must not reuse it
            while a previous snapshot is still being written.
    """
    staging = {} if staging is None else staging
    out = []
    for p in pieces:
        buf = staging.get(p.name)
        if buf is None or buf.shape != p.tensor.shape or buf.dtype != p.tensor.dtype:
            # Pinned memory makes device-to-host copies asynchronous and faster.
            buf = torch.empty(p.tensor.shape, dtype=p.tensor.dtype, pin_memory=p.tensor.is_cuda)
            staging[p.name] = buf
        buf.copy_(p.tensor, non_blocking=p.tensor.is_cuda)
        out.append(Piece(p.name, buf, p.global_shape, p.offsets))
    if any(p.tensor.is_cuda for p in pieces):
        torch.cuda.synchronize()
    return out


# --- plain values ----------------------------------------------------------------------


def to_plain(value: Any, where: str) -> Any:
    """`value` as msgpack-able data (tuples become lists), or a ValueError naming the path
    of the first value that is not: checkpoint metadata never falls back to pickle.

    Example::

        to_plain({"epoch": 3, "betas": (0.9, 0.99)}, "client_state")
        # {"epoch": 3, "betas": [0.9, 0.99]}
    """
    if value is None or isinstance(value, bool | float | str | bytes):
        return value
    if isinstance(value, int):
        if not _MSGPACK_INT[0] <= value <= _MSGPACK_INT[1]:
            raise ValueError(f"{where} = {value} does not fit in 64 bits (msgpack)")
        return value
    if isinstance(value, list | tuple):
        return [to_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str | int) or isinstance(k, bool):
                raise ValueError(
                    f"{where} has a key {k!r} of type {type(k).__name__}; checkpoint "
                    "dictionaries need str or int keys"
                )
            out[k] = to_plain(v, f"{where}[{k!r}]")
        return out
    hint = " (use .tolist() or .item())" if isinstance(value, torch.Tensor) else ""
    raise ValueError(
        f"{where} is a {type(value).__name__}, which a checkpoint cannot store: values "
        "must be msgpack-able (None, bool, int, float, str, bytes, lists, dicts with str "
        f"or int keys){hint}. Tensors belong in the model or optimizer."
    )


def restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """Set each param group's hyperparameters (lr, betas, initial_lr, ...) from `saved`,
    keeping tuple-valued options tuples (msgpack returns lists)."""
    for group, s in zip(optimizer.param_groups, saved, strict=True):
        for k, v in s.items():
            if k == "params":
                continue
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v


# --- random number generators ----------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """This process's generator states as msgpack-able values (torch CPU, CUDA when in
    use, python `random`, numpy when imported)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().numpy().tobytes(),
        "python": [version, list(internal), gauss],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.numpy().tobytes() for s in torch.cuda.get_rng_state_all()]
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, keys.tobytes(), int(pos), int(has_gauss), float(cached)]
    return state


def _byte_tensor(raw: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what rng_state() captured (generators it did not capture are left alone)."""
    torch.set_rng_state(_byte_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_byte_tensor(s) for s in cuda])
    np = sys.modules.get("numpy")
    if "numpy" in state and np is not None:
        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.frombuffer(keys, dtype=np.uint32), pos, has_gauss, cached))
