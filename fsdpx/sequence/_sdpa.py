"""Binding a `F.scaled_dot_product_attention` call's arguments by name, for the torch
function modes that run it sequence-parallel (UlyssesSDPA, RingSDPA)."""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor


def _sdpa_arguments(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> None:
    """F.scaled_dot_product_attention's parameters."""


_SDPA_SIGNATURE = inspect.signature(_sdpa_arguments)


def bind_sdpa(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of one SDPA call by name, defaults filled in."""
    bound = _SDPA_SIGNATURE.bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)
