"""Copy each block's reduced gradients to host memory while the rest of backward runs.

[Note: when a block's gradients are final] FSDP2 reduce-scatters a block's gradients in
its post-backward, which an autograd function wrapped around the block's *inputs* triggers.
Our forward pre-hook is prepended after fully_shard, so it runs before FSDP's and wraps the
inputs first; in backward the order reverses: FSDP's post-backward (reduce-scatter issued,
`.grad` of the sharded parameters assigned) runs, then ours. The reduction itself runs on
FSDP's reduce-scatter stream; its completion is the param group's post-reduce event, which
our copy stream waits on before copying, so the copy overlaps the remaining backward.

Blocks whose hook did not fire (the root, whose inputs need no gradient, or a backward that
was not armed) are copied at step time by the optimizer; that fallback is also all that
runs when FSDP's internals are not where this module expects them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.utils.hooks import RemovableHandle

from fsdpx.dtensor import to_local


class _AfterBackward(torch.autograd.Function):
    """Identity in forward; calls `callback` once the gradients of its inputs are computed."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.callback = callback
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.callback()
        return (None, *grads)


def _fsdp_groups(model: nn.Module) -> list[tuple[nn.Module, Any]]:
    """(module, FSDP param group) for every FSDP unit with parameters; [] when FSDP's
    internals are not as expected (then nothing is streamed)."""
    out: list[tuple[nn.Module, Any]] = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        try:
            group = m._get_fsdp_state()._fsdp_param_group  # type: ignore[attr-defined]
        except AttributeError:
            return []
        if group is None:
            continue
        if not hasattr(group, "fsdp_params") or not hasattr(group, "_post_reduce_event"):
            return []
        out.append((m, group))
    return out


class GradStreamer:
    """Issues host copies of gradients as FSDP finishes reducing each block.

    Args:
        model: the FSDP-sharded model.
        copy_fn: `copy_fn(param, grad_local, stream)` copies one parameter's local gradient
            into its host buffer (on `stream` when not None) and returns nothing.
        stream: a CUDA stream for the copies, or None (CPU: copies are synchronous).

    Example::

        streamer = GradStreamer(model, copy_fn, torch.cuda.Stream())
        streamer.arm(is_boundary=True); loss.backward(); streamer.wait()
    """

    def __init__(
        self,
        model: nn.Module,
        copy_fn: Callable[[torch.Tensor, torch.Tensor, torch.cuda.Stream | None], None],
        stream: torch.cuda.Stream | None,
    ) -> None:
        self._copy_fn = copy_fn
        self._stream = stream
        self._armed = False
        self.copied: set[int] = set()
        """ids of the parameters whose gradient copy was issued since the last arm()."""
        self._reused: set[int] = set()
        """ids of param groups whose block ran more than once in this forward."""
        self._handles: list[RemovableHandle] = []
        for module, group in _fsdp_groups(model):
            self._handles.append(
                module.register_forward_pre_hook(
                    self._pre_forward(group), prepend=True, with_kwargs=True
                )
            )

    @property
    def active(self) -> bool:
        return bool(self._handles)

    def arm(self, is_boundary: bool) -> None:
        """Stream during the coming backward only when it ends an accumulation window
        (earlier micro-steps' gradients are partial)."""
        self._armed = is_boundary
        if is_boundary:
            self.copied = set()
            self._reused = set()

    def wait(self) -> None:
        """Block until every copy issued so far has landed in host memory."""
        if self._stream is not None:
            self._stream.synchronize()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _pre_forward(self, group: Any) -> Callable[..., Any]:
        def hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
            # Wrapped on every forward: whether to copy is decided in backward, after the
            # engine armed it (the forward runs before engine.backward knows the boundary).
            if not torch.is_grad_enabled():
                return None
            slots = [i for i, a in enumerate(args) if _needs_grad(a)]
            keys = [k for k, v in kwargs.items() if _needs_grad(v)]
            if not slots and not keys:
                return None  # no gradient flows into the block: FSDP's own fallback runs
            tensors = [args[i] for i in slots] + [kwargs[k] for k in keys]
            out = _AfterBackward.apply(lambda: self._after_reduce(group), *tensors)
            outs = out if isinstance(out, tuple) else (out,)
            new_args = list(args)
            for i, t in zip(slots, outs[: len(slots)], strict=True):
                new_args[i] = t
            new_kwargs = dict(kwargs)
            for k, t in zip(keys, outs[len(slots) :], strict=True):
                new_kwargs[k] = t
            return tuple(new_args), new_kwargs

        return hook

    def _after_reduce(self, group: Any) -> None:
        if not self._armed or id(group) in self._reused:
            return
        params = [fp.sharded_param for fp in group.fsdp_params]
        if any(id(p) in self.copied for p in params):
            # The block ran more than once in this forward (a reused layer): an earlier
            # callback may have copied a gradient FSDP had not finished accumulating. Leave
            # the whole group to the step-time copy, which sees the final gradient.
            self._reused.add(id(group))
            self.copied.difference_update(id(p) for p in params)
            return
        event = group._post_reduce_event
        stream = self._stream
        if stream is not None:
            if event is not None:
                stream.wait_event(event)
            else:
                stream.wait_stream(torch.cuda.current_stream())
        for p in params:
            if p.grad is None:
                continue
            self._copy_fn(p, to_local(p.grad), stream)
            self.copied.add(id(p))


def _needs_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad
