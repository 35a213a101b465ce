"""Consolidate a sharded checkpoint into full tensors: safetensors files streamed with
memory bounded by one block, a torch.save file, or an in-memory state dict.

This is DeepSpeed's zero_to_fp32 without its memory blow-up: pieces are rectangles of the
global tensors, so each output tensor is produced block by block in C order straight from
the chunks that hold it (CheckpointReader.iter_blocks), whatever the sharding was.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import torch

from checkpoint_tools import safetensors_out as st
from checkpoint_tools.format import MODEL_PREFIX, OPTIM_PREFIX, CheckpointReader, TensorMeta
from checkpoint_tools.format.root import fsync_file, resolve_checkpoint

CASTS: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
BLOCK_BYTES = 4 << 20


def _cast(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in CASTS:
        raise ValueError(f"dtype must be one of {sorted(CASTS)} or None; got {dtype!r}")
    return CASTS[dtype]


def select(
    reader: CheckpointReader, *, include_optimizer: bool, dtype: torch.dtype | None
) -> list[tuple[TensorMeta, st.Entry]]:
    """The tensors to output, in checkpoint order, with their output key and dtype.

    Model tensors `model/<fqn>` become `<fqn>` (the unwrapped model's state-dict keys) and
    are cast to `dtype` when floating point. With include_optimizer, `optim/<fqn>/<key>`
    tensors are added under their full name, in their stored dtype (casting Adam's second
    moment to fp16 would underflow)."""
    out = []
    for name in reader.names():
        meta = reader.meta(name)
        if name.startswith(MODEL_PREFIX):
            key = name[len(MODEL_PREFIX) :]
            to = dtype if dtype is not None and meta.dtype.is_floating_point else meta.dtype
        elif include_optimizer and name.startswith(OPTIM_PREFIX):
            key, to = name, meta.dtype
        else:
            continue
        nbytes = meta.numel * torch.empty((), dtype=to).element_size()
        out.append((meta, st.Entry(key, meta.shape, to, nbytes)))
    return out


def consolidate(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    to: Literal["safetensors", "torch"] | None = None,
    dtype: str | torch.dtype | None = None,
    include_optimizer: bool = False,
    max_shard_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Path]:
    """Write the full tensors of a checkpoint as safetensors or as one torch.save file.

    Args:
        src: checkpoint directory, or a root whose `latest` names one.
        out: for safetensors, a directory (gets `model.safetensors`, or HF-style shards
            plus `model.safetensors.index.json` when `max_shard_bytes` splits it) or a
            file path ending in `.safetensors`; for torch, the output file path.
        to: output kind; None infers torch from a .pt/.pth/.bin suffix, else safetensors.
        dtype: "fp32", "bf16", "fp16" or None (keep) for floating-point model tensors.
        include_optimizer: also write `optim/<fqn>/<key>` tensors.
        max_shard_bytes: safetensors only: split into files of at most this many bytes.
        progress: called with the number of output bytes just written.

    Returns:
        The files written (shards in order, then the index).

    Memory: safetensors output holds one block (~4 MiB) at a time; torch output holds
    the whole state dict, because torch.save pickles complete tensors.

    Example::

        consolidate("ckpt", "hf_out", dtype="bf16", max_shard_bytes=5 * 10**9)
    """
    cast = _cast(dtype)
    dst = Path(out)
    if to is None:
        to = "torch" if dst.suffix in (".pt", ".pth", ".bin") else "safetensors"
    if to not in ("safetensors", "torch"):
        raise ValueError(f"to must be 'safetensors' or 'torch'; got {to!r}")
    if max_shard_bytes is not None and (
        max_shard_bytes <= 0 or to == "torch" or dst.suffix == ".safetensors"
    ):
        raise ValueError(
            f"max_shard_bytes={max_shard_bytes} needs a positive size and a safetensors "
            "output directory (not a single .safetensors file or a torch file)"
        )
    with CheckpointReader(resolve_checkpoint(src)) as reader:
        chosen = select(reader, include_optimizer=include_optimizer, dtype=cast)
        if to == "torch":
            state = {e.key: _full(reader, m, e.dtype) for m, e in chosen}
            dst.parent.mkdir(parents=True, exist_ok=True)
            _atomic_torch_save(state, dst)
            if progress is not None:
                progress(sum(e.nbytes for _, e in chosen))
            return [dst]
        return _write_safetensors(reader, chosen, dst, max_shard_bytes, progress)


def _write_safetensors(
    reader: CheckpointReader,
    chosen: list[tuple[TensorMeta, st.Entry]],
    dst: Path,
    max_shard_bytes: int | None,
    progress: Callable[[int], None] | None,
) -> list[Path]:
    if dst.suffix == ".safetensors":
        dst.parent.mkdir(parents=True, exist_ok=True)
        files = [(dst.name, [e for _, e in chosen])]
        directory = dst.parent
    else:
        dst.mkdir(parents=True, exist_ok=True)
        files = st.plan_files([e for _, e in chosen], max_shard_bytes)
        directory = dst
    metas = {e.key: m for m, e in chosen}

    # Three of each buffer: the writer thread may still hold the two previous blocks.
    cast_bufs: list[torch.Tensor | None] = [None] * 3
    turn = 0

    def stream(entry: st.Entry) -> Iterator[torch.Tensor]:
        nonlocal turn
        for block in reader.iter_blocks(metas[entry.key].name, BLOCK_BYTES, buffers=3):
            part = block
            if block.dtype != entry.dtype:
                # cast into reused buffers: fresh multi-MiB tensors cost page faults
                turn = (turn + 1) % 3
                buf = cast_bufs[turn]
                if buf is None or buf.dtype != entry.dtype or buf.numel() < block.numel():
                    buf = cast_bufs[turn] = torch.empty(block.numel(), dtype=entry.dtype)
                part = buf[: block.numel()].copy_(block)
            if progress is not None:
                progress(part.numel() * part.element_size())
            yield part

    paths = []
    for name, group in files:
        st.write_file(directory / name, group, ((e, stream(e)) for e in group))
        paths.append(directory / name)
    if len(files) > 1:
        paths.append(st.write_index(directory, files))
    if dst.suffix != ".safetensors":
        st.remove_stale(directory, {p.name for p in paths})
    return paths


def _full(reader: CheckpointReader, meta: TensorMeta, dtype: torch.dtype) -> torch.Tensor:
    return reader.read(meta.name).to(dtype)


def _atomic_torch_save(state: dict[str, torch.Tensor], dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            fsync_file(f)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def load_state_dict(
    src: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype | None = None,
    include_optimizer: bool = False,
) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict of a checkpoint, like DeepSpeed's
    get_fp32_state_dict_from_zero_checkpoint, but for any dtype and without DeepSpeed.

    Args:
        src: checkpoint directory, or a root whose `latest` names one.
        dtype: "fp32", "bf16", "fp16" or None (stored dtype) for floating model tensors.
        include_optimizer: also return `optim/<fqn>/<key>` tensors.

    Returns:
        {fqn: tensor} ready for `model.load_state_dict(...)` on the unwrapped model.

    Example::

        from checkpoint_tools import load_state_dict
        model.load_state_dict(load_state_dict("ckpt", dtype="fp32"))
    """
    cast = _cast(dtype)
    with CheckpointReader(resolve_checkpoint(src)) as reader:
        chosen = select(reader, include_optimizer=include_optimizer, dtype=cast)
        return {e.key: _full(reader, m, e.dtype) for m, e in chosen}
