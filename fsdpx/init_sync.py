"""Rank 0's initial weights on every rank, as `deepspeed.initialize` gives them.

The parallelize recipe (fsdpx/parallelize.py) calls `broadcast_initial_state_` once, after
the model is on its device and before anything splits it (pipeline stages, tensor-parallel shards, FSDP shards).

[Note: rank 0's initial weights] A script that sets no common seed builds a different
model on every rank. DeepSpeed hides that: its engine broadcasts rank 0's parameters
(and `zero.Init` broadcasts each parameter from rank 0 before partitioning it), so the
ranks train one model. Without the same, ZeRO-0 trains N diverging replicas without an
error, and ZeRO 1-3 train a patchwork in which each shard holds its owner's init.

*Where.* The sync runs on the unsplit model, before sharding, from global rank 0 to all
ranks, one tensor at a time, in place. After sharding it is too late to get rank 0's
values: FSDP keeps only each rank's shard and frees the rest, so rank 0 no longer holds
the values of the shards the other ranks own, and a shard-wise sync from "the dp rank 0
with the same shard" would give a consistent model but not rank 0's one (shard s would
come from the init of the rank owning s). Before sharding every rank holds the whole
model anyway (it built it on real tensors), so receiving into that storage costs no
memory: a contiguous tensor is received in place, a non-contiguous one through one
temporary copy (transient memory: one tensor). Every layout then starts from the same
full model, global rank 0's: ZeRO 0-3 and HSDP shard it, tensor parallelism cuts it, and
each pipeline stage keeps its part of it, so a pp / tp run also starts from exactly the
model a single process with rank 0's seed builds (DeepSpeed's pipeline engine instead
syncs each stage from its first data-parallel rank, because each of its stages builds
only its own layers; fsdpx ranks build the whole model, so one source serves all).
The price is that each rank receives the whole model once (not only its shard), one
collective per tensor; measured on 2 gloo CPU ranks: 36 ms for a 30k-parameter GPT
(20 tensors), 98 ms for 3.7M parameters, 240 ms for 27M, against a forward/backward of
seconds for the latter. A model too large for that belongs on the meta device.

*Meta device.* Tensors still on the meta device hold no values and are skipped: a fully
meta-built model costs only the structure check below (one 16-byte all-reduce). Its materialisation after sharding is already
identical on every rank that holds the same shard (fsdpx/materialize.py, [Note: init on
shards]: seeded by cfg.seed, and by (seed, name) under per_param_init). Real tensors of a
partly meta model (e.g. buffers made with an explicit device) are synced like any other.

*Buffers.* Every buffer, persistent or not, is synced too: running statistics, and
random buffers (e.g. fixed projections) that would otherwise differ per rank.

*Mismatch.* Before any values move, the ranks compare a fingerprint of the tensor list
(names, shapes, dtypes): a rank that built another model would otherwise hang in, or
receive garbage from, a broadcast of another size, so it is a ValueError on every rank.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpx.distributed import failure_guard

logger = logging.getLogger("fsdpx")


def broadcast_initial_state_(model: nn.Module, *, src: int = 0) -> int:
    """Overwrite every parameter and buffer of `model` with global rank `src`'s values,
    in place; see [Note: rank 0's initial weights].

    Every rank must call it, with a model of the same structure, before the model is split
    or sharded. Tensors on the meta device are skipped.

    Args:
        model: the unsharded model, its tensors on the device the process group uses
            (or on meta).
        src: the global rank whose values every rank receives.
    Returns:
        The number of bytes each rank received (0 without a process group, at world size
        1, or when every tensor is on meta).
    Raises:
        ValueError: the ranks' models differ in names, shapes or dtypes, or a parameter is
            already a DTensor (a model fsdpx.shard did not build the layout of).

    Example::

        model = GPT(cfg).to(device)        # any seed, per rank
        broadcast_initial_state_(model)    # now rank 0's values everywhere
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0
    tensors = list(_state(model))
    device = _comm_device(tensors)
    with failure_guard():
        _check_same_structure(tensors, device)
        start = time.perf_counter()
        total = 0
        with torch.no_grad():
            for _, t in tensors:
                if t.is_meta:
                    continue
                _broadcast_in_place(t, src, device)
                total += t.numel() * t.element_size()
    logger.debug(
        "fsdpx: rank %d received rank %d's initial weights (%d tensors, %.1f MB) in %.3f s",
        dist.get_rank(),
        src,
        len(tensors),
        total / 1e6,
        time.perf_counter() - start,
    )
    return total


def _state(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, then buffers, each once (tied ones under their first name)."""
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        if isinstance(t, DTensor):
            raise ValueError(
                f"{name} is already a DTensor (placements {t.placements}) when fsdpx.shard "
                "starts; pass the plain model and let the Config's mesh and tensor_parallel "
                "settings distribute it"
            )
        yield name, t.detach()


def _check_same_structure(tensors: list[tuple[str, torch.Tensor]], device: torch.device) -> None:
    text = "\n".join(f"{n} {tuple(t.shape)} {t.dtype} {t.is_meta}" for n, t in tensors)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
    # One all-reduce of (h, -h) under MAX gives every rank the largest and smallest
    # fingerprint: they agree iff all ranks built the same structure, so all raise or none.
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if int(both[0]) != digest or int(both[1]) != -digest:
        raise ValueError(
            "the ranks built different models (parameter/buffer names, shapes or dtypes "
            f"differ; rank {dist.get_rank()} has {len(tensors)} tensors): fsdpx.shard "
            "broadcasts rank 0's initial weights and needs the same model on every rank; "
            "build the model with the same code and arguments on all ranks"
        )


def _broadcast_in_place(t: torch.Tensor, src: int, device: torch.device) -> None:
    # gloo has no bool broadcast: send the bytes.
    view = t.view(torch.uint8) if t.dtype == torch.bool else t
    if view.is_contiguous() and view.device == device:
        dist.broadcast(view, src=src)
    else:
        # One temporary tensor: a non-contiguous view, or a host tensor of a partly meta
        # model under NCCL (which sends device memory only).
        tmp = view.to(device, memory_format=torch.contiguous_format, copy=True)
        dist.broadcast(tmp, src=src)
        view.copy_(tmp)


def _comm_device(tensors: list[tuple[str, torch.Tensor]]) -> torch.device:
    """Where the collectives run: CUDA under NCCL, else where the tensors are."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return next((t.device for _, t in tensors if not t.is_meta), torch.device("cpu"))
