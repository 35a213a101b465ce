"""Export a sharded model as Hugging Face-style safetensors files (full, unsharded weights).

`save_full_model` streams the model to disk one tensor at a time: every rank gathers the
same tensor (`DTensor.full_tensor()` is a collective, so all ranks walk the state dict in
the same order), rank 0 writes its bytes and drops it. No rank ever holds more than one
full tensor beyond its own shards, so a model that only fits sharded still exports.

[Note: streaming safetensors] A safetensors file is an 8-byte little-endian header length
N, N bytes of JSON (name -> dtype, shape, data_offsets; offsets count from the first byte
after the header), then the raw little-endian tensor bytes. Shapes and dtypes are known
from the sharded parameters' metadata (a DTensor's `.shape` is the global shape), so the
whole header is computed before anything is gathered, and each tensor's bytes are
appended as soon as it arrives. Nothing is pickled; the files load with
`safetensors.torch.load_file` and with `transformers`' `from_pretrained`.

Each file is written as `<name>.tmp`, fsynced and renamed into place; with several shards
the index (`model.safetensors.index.json`) is renamed last, so a reader never sees an
index naming a file that is not complete.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from collections.abc import Collection
from pathlib import Path
from typing import BinaryIO

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from checkpoint_tools.format.root import fsync_dir, fsync_file

# One safetensors writer: the offline checkpoint tools own it (they must not import the
# runtime); the runtime export reuses its naming, sharding plan, header and index.
from checkpoint_tools.safetensors_out import (
    INDEX_FILE,
    SINGLE_FILE,
    ST_DTYPES,
    Entry,
    header,
    plan_files,
    remove_stale,
    write_index,
)

__all__ = ["INDEX_FILE", "SINGLE_FILE", "save_full_model"]

_CASTS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}


def save_full_model(
    module: nn.Module,
    out_dir: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    exclude: Collection[str] = (),
) -> list[Path]:
    """Write `module`'s full state dict as safetensors under `out_dir`. Every rank calls it.

    Args:
        module: a model sharded by fsdpx.shard / fully_shard (e.g. `engine.module`), or a
            plain unsharded module. Its `state_dict()` keys are the tensor names, so the
            files load into the unsharded model with `load_state_dict(strict=True)`.
        out_dir: directory to write into (created if missing). Files from an earlier
            export with another sharding (`model.safetensors`, `model-*-of-*.safetensors`,
            the index) are removed after the new ones are in place.
        dtype: None keeps each tensor's dtype (fp32 master weights stay fp32); "bf16",
            "fp16" or "fp32" casts floating-point tensors (integer buffers are kept).
        max_shard_bytes: largest file size before the export is split into
            `model-00001-of-0000N.safetensors` files plus `model.safetensors.index.json`.
            A single tensor larger than this gets a file of its own.
        exclude: state-dict keys not to write (fsdpx.hf drops the second name of a tied
            weight, as transformers' save_pretrained does).
    Returns:
        The paths written (the safetensors files in order, then the index when sharded),
        the same list on every rank. Files are complete when the call returns on any rank.

    Example::

        engine = fsdpx.shard(model, cfg)
        ...  # train
        fsdpx.export.save_full_model(engine.module, "out/model", dtype="bf16")
        # later, anywhere: model.load_state_dict(safetensors.torch.load_file(
        #     "out/model/model.safetensors"))
    """
    if dtype is not None and dtype not in _CASTS:
        raise ValueError(f"dtype must be None, 'fp32', 'bf16' or 'fp16'; got {dtype!r}")
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive; got {max_shard_bytes=}")
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors export needs a little-endian host")
    cast = _CASTS[dtype] if dtype is not None else None
    out = Path(out_dir)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0

    # state_dict() (not named_parameters) so FSDP's pre-save hook reshards parameters to
    # DTensors and the keys are the unsharded module's keys, buffers included.
    state = {k: v for k, v in module.state_dict().items() if k not in exclude}
    entries = [_entry(name, value, cast) for name, value in state.items()]
    files = plan_files(entries, max_shard_bytes)
    paths = [out / file_name for file_name, _ in files]
    if len(files) > 1:
        paths.append(out / INDEX_FILE)

    error: BaseException | None = None
    if rank == 0:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except Exception as exc:
            error = exc
    for file_name, group in files:
        writer = None
        if rank == 0 and error is None:
            try:
                writer = _open_writer(out / file_name, group)
            except Exception as exc:
                error = exc
        for entry in group:
            full = _gather(state[entry.key], cast)  # collective: every rank, same order
            if writer is not None:
                try:
                    _write_tensor(writer, full)
                except Exception as exc:
                    _abandon(writer)
                    error, writer = exc, None
        if writer is not None:
            try:
                _commit(writer, out / file_name)
            except Exception as exc:
                error = exc
    if rank == 0 and error is None and len(files) > 1:
        try:
            write_index(out, files)
            fsync_dir(out)
        except Exception as exc:
            error = exc
    if rank == 0 and error is None:
        try:
            remove_stale(out, {p.name for p in paths})
        except Exception as exc:
            error = exc
    _agree_on_success(error, rank, state, distributed)
    return paths


# --- planning -------------------------------------------------------------------------


def _entry(name: str, value: torch.Tensor, cast: torch.dtype | None) -> Entry:
    out_dtype = cast if cast is not None and value.is_floating_point() else value.dtype
    if out_dtype not in ST_DTYPES:
        raise ValueError(
            f"tensor {name!r} has dtype {out_dtype}, which safetensors cannot store; "
            f"supported: {', '.join(str(d) for d in ST_DTYPES)}"
        )
    shape = tuple(value.shape)  # a DTensor's shape is the global shape
    numel = 1
    for size in shape:
        numel *= size
    itemsize = torch.empty((), dtype=out_dtype).element_size()
    return Entry(name, shape, out_dtype, numel * itemsize)


# --- gathering and writing ------------------------------------------------------------


def _gather(value: torch.Tensor, cast: torch.dtype | None) -> torch.Tensor:
    full = value.full_tensor() if isinstance(value, DTensor) else value
    full = full.detach()
    if cast is not None and full.is_floating_point():
        full = full.to(cast)
    return full


def _open_writer(path: Path, entries: list[Entry]) -> BinaryIO:
    f = open(_tmp(path), "wb")  # noqa: SIM115 - closed by _commit or _abandon
    try:
        f.write(header(entries))
    except BaseException:
        _abandon(f)
        raise
    return f


def _write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    t = tensor.cpu().contiguous()
    if t.numel() == 0:
        return
    # A view of the tensor's memory, not a copy; `t` stays alive until write returns.
    raw = (ctypes.c_ubyte * t.nbytes).from_address(t.data_ptr())
    f.write(memoryview(raw))


def _commit(f: BinaryIO, path: Path) -> None:
    try:
        fsync_file(f)
    finally:
        f.close()
    os.replace(_tmp(path), path)
    fsync_dir(path.parent)


def _abandon(f: BinaryIO) -> None:
    f.close()
    with contextlib.suppress(OSError):
        os.unlink(f.name)


def _tmp(path: Path) -> Path:
    return path.with_name(path.name + ".tmp")


def _agree_on_success(
    error: BaseException | None,
    rank: int,
    state: dict[str, torch.Tensor],
    distributed: bool,
) -> None:
    """Rank 0 keeps gathering after a write error (its peers are inside the same
    collectives), then every rank learns the outcome, so all raise or none does."""
    failed = error is not None
    if distributed and dist.get_world_size() > 1:
        device = next(
            (v.device for v in state.values() if isinstance(v, DTensor)), torch.device("cpu")
        )
        flag = torch.tensor([int(failed)], device=device)
        dist.broadcast(flag, src=0)
        failed = bool(flag.item())
    if error is not None:
        raise error
    if failed:
        raise OSError(f"rank 0 failed to write the model export; rank {rank} stops too")
