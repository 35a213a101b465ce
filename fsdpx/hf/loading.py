"""`fsdpx.hf.from_pretrained`: a Hugging Face checkpoint loaded straight into fsdpx shards.

[Note: sharded from_pretrained] The model is built with its parameters on the meta device
(buffers real: rotary frequencies are computed in `__init__` and are not in checkpoints),
handed to `fsdpx.shard` with an `init_fn`, and `fsdpx.shard` materialises each rank's
shards only. The `init_fn` then reads, for every parameter, the byte runs of the
safetensors file(s) that this rank's shard covers ([Note: byte-range loading],
[Note: shard rectangles]) straight into the shard's memory (a CPU shard of the file's
dtype), else through one bounded staging buffer copied in chunk by chunk (a cast, or a
device copy: [Note: staging buffer]). No rank holds the full model in RAM or on the
device. The reads follow each parameter's placements, so any layout fsdpx shards is
covered; tested: ZeRO-3 at 2 and 4 ranks, TP 2 (pipeline parallelism is not tested).

Everything that can be wrong with the files or the names is found before sharding, on
every rank alike (headers, shapes, dtypes, missing keys), so a bad checkpoint raises
the same error everywhere and leaves nothing half-loaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdpx.config import Config
from fsdpx.dtensor import to_local
from fsdpx.engine import Engine
from fsdpx.hf.checkpoint_files import CheckpointFiles, match_names, model_tensors
from fsdpx.hf.local_slices import element_runs, local_index_lists, split_runs
from fsdpx.hf.safetensors_read import SafetensorsError
from fsdpx.materialize import _unwrapped_name

__all__ = ["from_pretrained"]

log = logging.getLogger("fsdpx")

STAGING_BYTES = 16 * 2**20
"""[Note: staging buffer] A tensor that is cast (a bf16 checkpoint into fp32 parameters)
or copied to an accelerator is read through one buffer of at most this many bytes, reused
chunk by chunk, not through a buffer the size of its shard: the transient stays 16 MiB
whatever the largest shard (a 32000 x 4096 embedding's half in bf16 is 125 MiB)."""


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    # transformers builds a model "in" a dtype by setting the default dtype meanwhile.
    old = torch.get_default_dtype()
    if dtype is not None:
        torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _build_on_meta(model_class: Any, config: Any, dtype: torch.dtype | None) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import PreTrainedModel
    from transformers.initialization import no_init_weights

    # no_init_weights: transformers' init_weights on meta parameters is pure overhead
    # (~0.5 s for a 16-layer Llama); buffers computed in __init__ stay real.
    with init_empty_weights(include_buffers=False), no_init_weights(), _default_dtype(dtype):
        if isinstance(model_class, type) and issubclass(model_class, PreTrainedModel):
            model = model_class(config)
        else:  # an Auto class
            model = model_class.from_config(config)
    # Under init_empty_weights transformers leaves tying to its own from_pretrained.
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()
    return model


def _dtype_of(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
    }
    if dtype not in names:
        raise ValueError(f"dtype must be a torch dtype or one of {sorted(names)}; got {dtype!r}")
    return names[dtype]


def from_pretrained(
    model_class: Any,
    path: str | os.PathLike[str],
    cfg: Config | None = None,
    *,
    config: Any = None,
    dtype: str | torch.dtype | None = None,
    key_mapping: dict[str, str] | None = None,
    output_loading_info: bool = False,
    **shard_kwargs: Any,
) -> Engine | tuple[Engine, dict[str, Any]]:
    """Build `model_class` from the checkpoint directory `path`, sharded by fsdpx, each
    rank reading only the bytes of its own shards. Every rank calls it.

    Args:
        model_class: a transformers model class (`LlamaForCausalLM`) or an Auto class
            (`AutoModelForCausalLM`).
        path: a directory with `config.json` and `model.safetensors` or
            `model.safetensors.index.json` + its shards (what `save_pretrained` writes).
        cfg: the fsdpx Config (default Config(): ZeRO-3).
        config: a transformers config to use instead of `path/config.json`.
        dtype: the parameters' dtype (None: the model's default, fp32); checkpoint tensors
            of another floating dtype are cast.
        key_mapping: regex -> replacement renames of checkpoint keys, as transformers'
            `from_pretrained(key_mapping=...)` ([Note: checkpoint names]).
        output_loading_info: also return transformers' loading-info dict
            (`missing_keys`, `unexpected_keys`, `mismatched_keys`, `error_msgs`) plus
            `bytes_read`, the safetensors bytes this rank read.
        shard_kwargs: passed to `fsdpx.shard` (optimizer, lr_scheduler, param_groups, ...).
    Returns:
        The Engine (and the loading info).
    Raises:
        FileNotFoundError: no safetensors checkpoint in `path`.
        SafetensorsError: a damaged or lying file (names file and tensor).
        ValueError: parameters the checkpoint lacks, or shapes / dtypes that do not match.

    Example::

        engine = fsdpx.hf.from_pretrained(AutoModelForCausalLM, "ckpt/", cfg)
    """
    from transformers import AutoConfig, GenerationConfig

    import fsdpx

    if "init_fn" in shard_kwargs:
        raise ValueError("from_pretrained initialises the model from the checkpoint; drop init_fn")
    path = Path(path)
    torch_dtype = _dtype_of(dtype)
    if config is None:
        config = AutoConfig.from_pretrained(path)
    files = CheckpointFiles(path)
    try:
        model = _build_on_meta(model_class, config, torch_dtype)
        can_generate = getattr(model, "can_generate", None)
        if (
            (path / "generation_config.json").is_file()
            and callable(can_generate)
            and can_generate()
        ):
            model.generation_config = GenerationConfig.from_pretrained(path)  # type: ignore[assignment]
        match = match_names(model, sorted(files.where), key_mapping)
        params = {id(p) for p in model.parameters()}
        names_of = {names[0]: (names, t) for names, t in model_tensors(model)}
        missing_params = [n for n in match.missing if id(names_of[n][1]) in params]
        if match.unexpected:
            log.warning(
                "fsdpx.hf.from_pretrained: %d checkpoint tensors are not used by %s: %s",
                len(match.unexpected),
                type(model).__name__,
                ", ".join(match.unexpected[:20]),
            )
        if missing_params:
            raise ValueError(
                f"{path}: the checkpoint has no tensor for {len(missing_params)} parameters of "
                f"{type(model).__name__}: {', '.join(missing_params[:20])}. fsdpx.hf does not "
                "initialise weights a checkpoint lacks (transformers would, randomly): load a "
                "checkpoint of this architecture, or pass key_mapping= for renamed keys"
            )
        _check_shapes(model, match.source, files, names_of)
        sources = {
            alias: match.source[first]
            for first, (names, _) in names_of.items()
            if first in match.source
            for alias in names
        }
        engine = fsdpx.shard(model, cfg, init_fn=_CoveringLoad(files, sources), **shard_kwargs)
        info = {
            "missing_keys": match.missing,
            "unexpected_keys": match.unexpected,
            "mismatched_keys": [],
            "error_msgs": [],
            "bytes_read": files.bytes_read,
        }
    finally:
        files.close()
    return (engine, info) if output_loading_info else engine


def _check_shapes(
    model: nn.Module,
    source: dict[str, str],
    files: CheckpointFiles,
    names_of: dict[str, tuple[list[str], torch.Tensor]],
) -> None:
    for first, key in source.items():
        tensor = names_of[first][1]
        info = files.info(key)
        if tuple(tensor.shape) != info.shape:
            raise ValueError(
                f"{files.where[key].path}: tensor {key!r} has shape {list(info.shape)}, but "
                f"{type(model).__name__}.{first} has shape {list(tensor.shape)}: the checkpoint "
                "is for another configuration"
            )
        if info.dtype.is_floating_point != tensor.dtype.is_floating_point or (
            not info.dtype.is_floating_point and info.dtype != tensor.dtype
        ):
            raise SafetensorsError(
                f"{files.where[key].path}: tensor {key!r} is {info.dtype}, but "
                f"{type(model).__name__}.{first} is {tensor.dtype}: a dtype that does not match"
            )


class _CoveringLoad:
    """The init_fn: `_load_part`, declared to write every meta tensor (`writes_every_meta_
    tensor`), so `fsdpx.shard` skips its sentinel fill and check ([Note: meta buffers]): the
    checks above (every parameter has a checkpoint tensor of its shape; buffers are built
    real) and `_load_tensor` (reads exactly the local shard's elements) already guarantee
    it, and the fill and check were two passes over every shard (~40% of the load's time
    on the 1 GB benchmark)."""

    writes_every_meta_tensor = True

    def __init__(self, files: CheckpointFiles, sources: dict[str, str]) -> None:
        self.files, self.sources = files, sources

    def __call__(self, part: nn.Module) -> None:
        _load_part(part, self.files, self.sources)


def _load_part(part: nn.Module, files: CheckpointFiles, sources: dict[str, str]) -> None:
    """init_fn: fill every parameter / buffer of `part` with its checkpoint's bytes."""
    seen: set[int] = set()
    named: list[tuple[str, torch.Tensor]] = list(part.named_parameters(remove_duplicate=False))
    named += list(part.named_buffers(remove_duplicate=False))
    with torch.no_grad():
        for name, tensor in named:
            key = sources.get(_unwrapped_name(name))
            if key is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            _load_tensor(tensor, files, key)


def _load_tensor(tensor: torch.Tensor, files: CheckpointFiles, key: str) -> None:
    info = files.info(key)
    idx = local_index_lists(tensor)
    local = to_local(tensor)
    local_shape = tuple(len(i) for i in idx)
    if local_shape != tuple(local.shape):
        raise AssertionError(
            f"{key}: computed local shape {local_shape} != actual {tuple(local.shape)}"
        )
    runs = element_runs(info.shape, idx)
    target = local.detach()
    source = files.where[key]
    if target.device.type == "cpu" and target.dtype == info.dtype and target.is_contiguous():
        # Straight into the shard's memory: no second copy of it exists at any time.
        source.read_into(key, target, runs)
        return
    if not target.is_contiguous():  # not an FSDP shard (those are contiguous): whole buffer
        buf = torch.empty(local_shape, dtype=info.dtype)
        source.read_into(key, buf, runs)
        target.copy_(buf)
        return
    # A cast or a device copy: through one bounded staging buffer ([Note: staging buffer]).
    flat = target.view(-1)
    step = max(1, STAGING_BYTES // info.dtype.itemsize)
    staging = torch.empty(min(step, flat.numel()), dtype=info.dtype)
    pos = 0
    for chunk in split_runs(runs, step):
        n = sum(count for _, count in chunk)
        source.read_into(key, staging[:n], chunk)
        flat[pos : pos + n].copy_(staging[:n])  # synchronous: the buffer is free after it
        pos += n
