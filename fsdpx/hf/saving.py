"""`save_pretrained`: a sharded model written in Hugging Face layout.

`config.json`, `generation_config.json` (when the model has one) and safetensors
(`model.safetensors`, or `model-0000K-of-0000N.safetensors` + `model.safetensors.index.json`
above `max_shard_bytes`), so `AutoModel*.from_pretrained(dir)` in plain transformers loads
it. The weights go through `fsdpx.export.save_full_model`: one tensor gathered at a time,
rank 0 writes. A weight shared by several modules (tied embeddings) is written once under
its first name, as transformers does (safetensors cannot hold aliases; transformers ties
the other name again on load).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from fsdpx.hf.checkpoint_files import model_tensors

__all__ = ["save_pretrained"]


def _unwrap(model: Any) -> nn.Module:
    module = getattr(model, "module", model)  # an Engine or a DeepSpeedEngine
    module = getattr(module, "module", module)
    if not isinstance(module, nn.Module):
        raise TypeError(f"save_pretrained takes an fsdpx Engine or a model; got {type(model)}")
    return module


def save_pretrained(
    model: Any,
    save_directory: str | os.PathLike[str],
    *,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[Path]:
    """Write `model` (an fsdpx Engine or its module) in Hugging Face layout. Every rank
    calls it; rank 0 writes. Returns the weight files written (same on every rank).

    dtype None keeps each tensor's dtype (fp32 masters stay fp32); "bf16" / "fp16" /
    "fp32" casts floating tensors.

    Example::

        engine.save_pretrained("out/model")   # then AutoModelForCausalLM.from_pretrained
    """
    # Imported here: `import fsdpx.hf` (every from_pretrained) would otherwise load the
    # checkpoint format package with it ([Note: engine imports on first use]).
    from fsdpx.export import save_full_model

    module = _unwrap(model)
    out = Path(save_directory)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    tied = [n for names, _ in model_tensors(module) for n in names[1:]]
    # Weights first: save_full_model agrees on success across ranks, so a failed write is
    # raised everywhere before rank 0 writes the config next to an incomplete model.
    paths = save_full_model(
        module, out, dtype=dtype, max_shard_bytes=max_shard_bytes, exclude=set(tied)
    )
    if rank == 0:
        config = getattr(module, "config", None)
        if config is not None:
            config = copy.deepcopy(config)  # the model's own config keeps its dtype
            if dtype is not None:
                config.dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype]
            config.save_pretrained(out)
        gen = getattr(module, "generation_config", None)
        can_generate = getattr(module, "can_generate", None)
        if gen is not None and callable(can_generate) and can_generate():
            gen.save_pretrained(out)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the config is there when any rank returns
    return paths
