"""fsdpx for Hugging Face transformers (`pip install fsdpx[hf]`).

- `Trainer`: `transformers.Trainer` on fsdpx, plus `fsdpx_config=` (fsdpx/hf/trainer.py).
- `from_pretrained(model_class, path, cfg)`: the model sharded by fsdpx, each rank reading
  only its shards' bytes of the safetensors files (fsdpx/hf/loading.py).
- `save_pretrained(engine, dir)` / `engine.save_pretrained(dir)`: Hugging Face layout out.

This package is the only part of fsdpx that imports transformers or accelerate.
"""

from __future__ import annotations

from typing import Any

try:
    import transformers  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised by a subprocess test
    raise ImportError(
        f"fsdpx.hf needs transformers and accelerate ({exc}); install them with "
        "`pip install fsdpx[hf]`"
    ) from exc

from fsdpx.hf.loading import from_pretrained
from fsdpx.hf.safetensors_read import SafetensorsError
from fsdpx.hf.saving import save_pretrained

__all__ = ["SafetensorsError", "Trainer", "from_pretrained", "save_pretrained"]


def __getattr__(name: str) -> Any:
    # The Trainer module pulls in transformers.Trainer (slow); load it when asked for.
    if name == "Trainer":
        from fsdpx.hf.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'fsdpx.hf' has no attribute {name!r}")
