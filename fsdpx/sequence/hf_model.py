"""Whether a module is a Hugging Face `transformers` model, without importing transformers.

fsdpx.hf is the only part of fsdpx that imports transformers (the `fsdpx[hf]` extra): a
model can only be a `PreTrainedModel` if its author already imported transformers, so the
class is looked up in `sys.modules` and the HF-specific code (fsdpx/hf/ulysses.py) is
imported only for such a model.
"""

from __future__ import annotations

import sys

from torch import nn


def is_hf_model(model: nn.Module) -> bool:
    """True for a transformers PreTrainedModel."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    return isinstance(model, transformers.PreTrainedModel)
