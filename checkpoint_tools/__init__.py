"""Offline checkpoint tools: `fsdpx-ckpt consolidate|inspect|verify` and a Python API.

Imports only the checkpoint format (`checkpoint_tools.format`), never the fsdpx runtime
or torch.distributed process groups, and needs no GPU.

Example::

    from checkpoint_tools import load_state_dict
    model.load_state_dict(load_state_dict("ckpt"))      # follows ckpt/latest
"""

from checkpoint_tools.consolidate import consolidate, load_state_dict
from checkpoint_tools.format.root import resolve_checkpoint

__all__ = ["consolidate", "load_state_dict", "resolve_checkpoint"]
