"""`save_16bit_model`: the full weights in the training precision, in one file.

DeepSpeed gathers the ZeRO-partitioned weights one tensor at a time and `torch.save`s the
resulting state dict from rank 0 (`pytorch_model.bin` by default), a file
`model.load_state_dict(torch.load(f))` reads back into the unwrapped model. The same here:
every rank takes part in each tensor's gather, rank 0 keeps the full tensor on the host.
A `.safetensors` file name goes through fsdpx's safetensors export instead (no rank
holds the whole model there).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdpx.engine import Engine
from fsdpx.export import save_full_model
from fsdpx.precision import torch_dtype


def save_16bit(engine: Engine, save_dir: Path, save_filename: str) -> None:
    """Write `engine`'s full model to `save_dir / save_filename` (see the module docstring).

    Raises:
        ValueError: a file name that is neither .bin/.pt/.pth nor .safetensors.
        NotImplementedError: under pipeline parallelism (no stage holds the whole model).
    """
    dtype = engine.config.precision.param_dtype
    if engine.parallel_dims.pp > 1:
        # Each stage holds part of the model; a gather over one stage would write a
        # silently incomplete file.
        raise NotImplementedError(
            "save_16bit_model under pipeline parallelism: each stage holds part of the "
            "model; use save_checkpoint, then `fsdpx-ckpt consolidate` for the full weights"
        )
    if save_filename.endswith(".safetensors"):
        save_full_model(engine.module, save_dir, dtype=dtype)
        return
    if not save_filename.endswith((".bin", ".pt", ".pth")):
        raise ValueError(
            f"save_filename {save_filename!r}: expected a .bin/.pt/.pth (torch.save) or a "
            ".safetensors name"
        )
    cast = torch_dtype(dtype)
    rank = dist.get_rank() if dist.is_initialized() else 0
    state = {}
    for name, value in engine.module.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        if rank == 0:
            full = full.detach()
            if full.is_floating_point():
                full = full.to(cast)
            state[name] = full.cpu().clone()
    if rank == 0:
        save_dir.mkdir(parents=True, exist_ok=True)
        path = save_dir / save_filename
        tmp = path.with_name(path.name + ".tmp")
        torch.save(state, tmp)
        tmp.replace(path)
    if dist.is_initialized():
        dist.barrier()  # the file is complete when the call returns on any rank
