"""ZeRO-Offload's host state store: fp32 masters and Adam moments in (pinned) host memory,
stepped by the fused CPU `adam_step` ([Note: state stores] in state_store.py).

Data flow of one step:

1. backward: as FSDP finishes reducing a block, its gradient shards are copied to pinned
   host buffers on a side stream (fsdpx/offload/grad_stream.py), overlapping the rest of
   backward. Whatever was not streamed is copied at step time.
2. step: `adam_step` updates master, exp_avg and exp_avg_sq in one memory pass, unscaling
   (fp16 loss scale) and clipping the gradient on the fly (`inv_grad_scale`) and writing
   the 16-bit copy of the new parameters into a pinned buffer (device params in bf16/fp16),
   bucket by bucket; each bucket's copy back to the device starts while the next bucket is
   computed.
3. the default stream waits for the copies (no host sync), so the next forward sees them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from fsdpx.dtensor import to_local as local
from fsdpx.offload.grad_stream import GradStreamer
from fsdpx.offload.slots import Slot, count_steps, wrap_like
from fsdpx.offload.state_store import StoreContext
from fsdpx.optim import group_adam_step

# Elements per adam_step call: small enough that copying a bucket back to the device
# overlaps computing the next, large enough that per-call overhead does not matter.
_BUCKET_NUMEL = 8 << 20


@dataclass
class _Host:
    """One parameter's host tensors (this rank's local shard)."""

    slot: Slot
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    copy: torch.Tensor | None
    """16-bit copy of the new parameter, copied to the device (16-bit device params)."""


class HostState:
    """The StateStore of zero.offload_optimizer.device "cpu".

    Args:
        ctx: the optimizer's slots, state, copy stream and settings.
        masters: id(param) -> fp32 local shard to start the master from.
    """

    host_bytes = 0
    file_bytes = 0
    saves_synchronously = False

    def __init__(self, ctx: StoreContext, masters: dict[int, torch.Tensor]) -> None:
        self._ctx = ctx
        self._copies = ctx.copies
        self._hosts: dict[int, _Host] = {}
        for slot in ctx.slots:
            src = masters[id(slot.param)]
            master = self._empty(src)
            master.copy_(src)
            copy = self._empty(src, ctx.copy_dtype) if ctx.copy_dtype is not None else None
            host = _Host(
                slot,
                master,
                self._empty(src).zero_(),
                self._empty(src).zero_(),
                self._empty(src, local(slot.param).dtype),
                copy,
            )
            self._hosts[id(slot.param)] = host
            self._publish_state(host, torch.zeros((), dtype=torch.float32))
        self._streamer: GradStreamer | None = None
        if ctx.model is not None:
            streamer = GradStreamer(ctx.model, self._copy_grad, self._copies.stream)
            self._streamer = streamer if streamer.active else None

    def _empty(self, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(like.shape, dtype=dtype, pin_memory=self._ctx.pin_memory)

    def _publish_state(self, host: _Host, step: torch.Tensor) -> None:
        """Put the host tensors in `state` in torch.optim.AdamW's layout."""
        p = host.slot.param
        self._ctx.state[p] = {
            "step": step,
            "exp_avg": wrap_like(p, host.exp_avg),
            "exp_avg_sq": wrap_like(p, host.exp_avg_sq),
        }

    def host_tensors(self) -> list[torch.Tensor]:
        return [
            t
            for h in self._hosts.values()
            for t in (h.master, h.exp_avg, h.exp_avg_sq, h.grad, h.copy)
            if t is not None
        ]

    # --- backward -----------------------------------------------------------------------

    def prepare_backward(self, is_boundary: bool) -> None:
        # Stream gradients to the host only in the backward that ends an accumulation window.
        if self._streamer is not None:
            self._streamer.arm(is_boundary)

    def _copy_grad(
        self, p: torch.Tensor, grad: torch.Tensor, stream: torch.cuda.Stream | None
    ) -> None:
        host = self._hosts[id(p)].grad
        if stream is None:
            host.copy_(grad)
            return
        with torch.cuda.stream(stream):
            grad.record_stream(stream)  # FSDP allocated it on its reduce stream
            host.copy_(grad, non_blocking=True)

    # --- step ---------------------------------------------------------------------------

    def step(self, inv_grad_scale: float) -> None:
        self._adopt_loaded_state()
        copies = self._copies
        copies.begin()
        streamed = self._streamer.copied if self._streamer is not None else set()
        if self._streamer is not None:
            self._streamer.wait()
        for slot in self._ctx.slots:
            g = slot.param.grad
            if g is not None and id(slot.param) not in streamed:
                self._copy_grad(slot.param, local(g), copies.stream)
        if copies.stream is not None:
            copies.stream.synchronize()
        copies.wait_done()  # the pinned copy buffers are free again
        for step, slots in count_steps(self._ctx.slots, self._ctx.state).items():
            for bucket in _buckets([self._hosts[id(s.param)] for s in slots]):
                copy = bucket[0].copy is not None
                group_adam_step(
                    self._ctx.param_groups[bucket[0].slot.group],
                    step,
                    [h.master for h in bucket],
                    [h.grad for h in bucket],
                    [h.exp_avg for h in bucket],
                    [h.exp_avg_sq for h in bucket],
                    inv_grad_scale=inv_grad_scale,
                    param_copies=[h.copy for h in bucket] if copy else None,  # type: ignore[misc]
                )
                for h in bucket:
                    copies.copy(local(h.slot.param), h.copy if h.copy is not None else h.master)
        copies.finish()

    def _adopt_loaded_state(self) -> None:
        """Take in state that something other than checkpoint_view put in `state`: a
        load of a checkpoint saved before any step (no state: start from zero), or tensors
        a loader created instead of filling ours."""
        for host in self._hosts.values():
            entry = self._ctx.state.get(host.slot.param)
            if not entry or "exp_avg" not in entry:
                host.exp_avg.zero_()
                host.exp_avg_sq.zero_()
                step = entry.get("step") if entry else None
                self._publish_state(
                    host, step if isinstance(step, torch.Tensor) else torch.zeros(())
                )
                continue
            for key, mine in (("exp_avg", host.exp_avg), ("exp_avg_sq", host.exp_avg_sq)):
                t = entry[key]
                if local(t).data_ptr() != mine.data_ptr():
                    mine.copy_(local(t))
                    entry[key] = wrap_like(host.slot.param, mine)

    # --- checkpoints --------------------------------------------------------------------

    @contextmanager
    def checkpoint_view(self) -> Iterator[dict[int, torch.Tensor]]:
        self._adopt_loaded_state()
        yield {pid: wrap_like(h.slot.param, h.master) for pid, h in self._hosts.items()}

    @torch.no_grad()
    def push_masters(self) -> None:
        copies = self._copies
        copies.wait_done()
        copies.begin()
        for host in self._hosts.values():
            if host.copy is not None:
                host.copy.copy_(host.master)
            copies.copy(local(host.slot.param), host.copy if host.copy is not None else host.master)
        copies.finish()

    def close(self) -> None:
        if self._streamer is not None:
            self._streamer.remove()
            self._streamer = None


def _buckets(hosts: list[_Host]) -> Iterator[list[_Host]]:
    """Runs of parameters of one param group (one set of hyperparameters), about
    _BUCKET_NUMEL elements each."""
    bucket: list[_Host] = []
    size = 0
    for h in hosts:
        if bucket and (size + h.slot.numel > _BUCKET_NUMEL or h.slot.group != bucket[0].slot.group):
            yield bucket
            bucket, size = [], 0
        bucket.append(h)
        size += h.slot.numel
    if bucket:
        yield bucket
