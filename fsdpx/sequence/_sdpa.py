"""Binding a `F.scaled_dot_product_attention` call's arguments by name, for the torch
function modes that run it sequence-parallel (UlyssesSDPA, RingSDPA)."""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode


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


class SDPAMode(TorchFunctionMode):
    """Runs every `F.scaled_dot_product_attention` call under it through `attend` (its
    arguments bound by name) over `group`; every other function passes through."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        return self.attend(func, bind_sdpa(args, kwargs or {}))

    @abc.abstractmethod
    def attend(self, sdpa: Callable[..., Tensor], call: dict[str, Any]) -> Tensor:
        """The sequence-parallel attention of one SDPA call (`sdpa` is the kernel);
        UlyssesSDPA and RingSDPA define it."""
