"""FSDP2's parameter groups of one state, across the torch versions fsdpx meets.

[Note: FSDP state across torch versions] torch 2.13's `FSDPState` keeps a list of
parameter groups (`_fsdp_param_groups`); torch 2.11, the image of the GPU machines the
CUDA tests run on, keeps at most one (`_fsdp_param_group`, None when the module holds no
parameters of its own). Everything in fsdpx that walks a state's groups asks here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["param_groups"]


def param_groups(state: Any) -> list[Any]:
    """The `FSDPParamGroup`s of an `FSDPState` (empty when it holds none)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)
    return [] if one is None else [one]
