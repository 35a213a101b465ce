"""ZeRO-Offload: fp32 master parameters and Adam states in host memory (or NVMe files),
stepped by the fused CPU `adam_step`, while the sharded parameters stay on the device.

Data flow of one step (device "cpu"):

1. backward: as FSDP finishes reducing a block, its gradient shards are copied to pinned
   host buffers on a side stream (fsdpx/offload/grad_stream.py), overlapping the rest of
   backward. Whatever was not streamed is copied at step time.
2. step: `adam_step` updates master, exp_avg and exp_avg_sq in one memory pass, unscaling
   (fp16 loss scale) and clipping the gradient on the fly (`inv_grad_scale`) and writing
   the 16-bit copy of the new parameters into a pinned buffer (device params in bf16/fp16),
   bucket by bucket; each bucket's copy back to the device starts while the next bucket is
   computed.
3. the default stream waits for the copies (no host sync), so the next forward sees them.

With device "nvme" the master and states live in a swap file (fsdpx/offload/nvme.py) and
the step streams them through a few fixed host buffers (fsdpx/offload/nvme_step.py).

Offload is pure data movement: with fp32 device parameters the results are bitwise those of
fsdpx.optim.AdamW on the same parameters without offload (the same kernel, same order).

Checkpoints (fsdpx/checkpoint): `checkpoint_view()` exposes the fp32 masters in place of the
device parameters ("model/<fqn>") and every state tensor in `self.state` ("optim/<fqn>/..."),
so the files are those of a run without offload; `after_load()` pushes loaded masters to the
device.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from fsdpx.checkpoint.state import OFFLOAD_OWNER
from fsdpx.config import OffloadConfig
from fsdpx.offload.grad_stream import GradStreamer, local
from fsdpx.ops import adam_step
from fsdpx.optim import adamw_defaults

# Elements per adam_step call: small enough that copying a bucket back to the device
# overlaps computing the next, large enough that per-call overhead does not matter.
_BUCKET_NUMEL = 8 << 20


@dataclass
class _Slot:
    """One parameter's offloaded state (host tensors hold this rank's local shard)."""

    param: torch.Tensor
    group: int
    numel: int
    offset: int = 0
    """Start in the flat NVMe layout (elements)."""
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    grad_host: torch.Tensor | None = None
    copy_host: torch.Tensor | None = None
    """16-bit copy of the new parameter, copied to the device (16-bit device params)."""


def wrap_like(param: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """`host` (this rank's local shard) as a tensor laid out like `param`: a DTensor with
    the parameter's mesh and placements when it is one (what checkpoints record)."""
    if isinstance(param, DTensor):
        # Not DTensor.from_local: it moves a host tensor to the mesh's device (a GPU copy
        # of the state, disconnected from the host buffers). The wrapper shares `host`.
        spec = DTensorSpec(
            param.device_mesh,
            param.placements,
            tensor_meta=TensorMeta(param.shape, param.stride(), host.dtype),
        )
        return DTensor(host, spec, requires_grad=False)
    return host


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW (Adam with `decoupled_weight_decay=False`) whose fp32 master weights and
    moments live off the device (module docstring). Built by fsdpx.shard when
    zero.offload_optimizer.device is "cpu" or "nvme".

    Args:
        params: the sharded device parameters (DTensors from fully_shard, or plain).
        lr, betas, eps, weight_decay, decoupled_weight_decay: as torch.optim.AdamW.
        offload: zero.offload_optimizer (device, nvme_path, pin_memory, buffer_mb).
        model: the sharded model, to stream gradients as blocks finish (None: copy at step).
        device_dtype: dtype to keep the device parameters in (bf16/fp16 halves their device
            memory; the fp32 master stays on the host). None keeps their dtype.
        rank: this process's global rank (names the NVMe swap file).

    Example::

        opt = OffloadedAdamW(model.parameters(), lr=1e-4, offload=OffloadConfig(device="cpu"))
        loss.backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        decoupled_weight_decay: bool = True,
        bias_correction: bool = True,
        offload: OffloadConfig,
        model: nn.Module | None = None,
        device_dtype: torch.dtype | None = None,
        rank: int = 0,
    ) -> None:
        if offload.device not in ("cpu", "nvme"):
            raise ValueError(
                f"OffloadedAdamW needs offload device 'cpu' or 'nvme', got {offload.device!r}"
            )
        defaults = adamw_defaults(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=False,
            maximize=False,
            decoupled_weight_decay=decoupled_weight_decay,
            bias_correction=bias_correction,
        )
        super().__init__(params, defaults)
        self.offload = offload
        params_list = [p for g in self.param_groups for p in g["params"]]
        on_accel = any(local(p).device.type != "cpu" for p in params_list)
        self._pin = on_accel if offload.pin_memory is None else offload.pin_memory
        self._stream = torch.cuda.Stream() if on_accel and torch.cuda.is_available() else None
        self._h2d_done: torch.cuda.Event | None = None
        self._slots: dict[int, _Slot] = {}
        offset = 0
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                n = local(p).numel()
                self._slots[id(p)] = _Slot(p, gi, n, offset)
                offset += n
        self._total_numel = offset
        self._nvme: Any = None
        self.host_buffer_bytes = 0
        """Host bytes of the NVMe streaming buffers (0 with device "cpu")."""
        masters = {id(p): local(p).detach().float() for p in params_list}
        if device_dtype is not None:
            cast_device_params_(params_list, device_dtype, model)
        copy_dtype = device_dtype if device_dtype in (torch.bfloat16, torch.float16) else None
        if offload.device == "cpu":
            self._init_host_state(masters, copy_dtype)
        else:
            from fsdpx.offload.nvme_step import NvmeState

            self._nvme = NvmeState(self, masters, copy_dtype, rank)
            self.host_buffer_bytes = self._nvme.host_bytes
        del masters
        if model is not None:
            # A model-only fsdpx.checkpoint.save/load finds the masters through this.
            setattr(model, OFFLOAD_OWNER, weakref.ref(self))
        self._streamer: GradStreamer | None = None
        if model is not None and offload.device == "cpu":
            streamer = GradStreamer(model, self._copy_grad, self._stream)
            self._streamer = streamer if streamer.active else None

    # --- set-up -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Called by torch.optim.Optimizer.__init__ before any offload state exists; a group
        # added later would get no host or swap-file state and never be stepped.
        if hasattr(self, "_slots"):
            raise NotImplementedError(
                "OffloadedAdamW cannot take parameter groups after construction (their "
                "offloaded state is laid out once); pass every group to fsdpx.shard's model"
            )
        super().add_param_group(param_group)

    def _host(self, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.empty(like.shape, dtype=dtype, pin_memory=self._pin)

    def _init_host_state(
        self, masters: dict[int, torch.Tensor], copy_dtype: torch.dtype | None
    ) -> None:
        for slot in self._slots.values():
            src = masters[id(slot.param)]
            slot.master = self._host(src)
            slot.master.copy_(src)
            slot.exp_avg = self._host(src).zero_()
            slot.exp_avg_sq = self._host(src).zero_()
            grad_dtype = local(slot.param).dtype
            slot.grad_host = self._host(src, grad_dtype)
            if copy_dtype is not None:
                slot.copy_host = self._host(src, copy_dtype)
            self._publish_state(slot, torch.zeros((), dtype=torch.float32))

    def _publish_state(self, slot: _Slot, step: torch.Tensor) -> None:
        """Put the slot's host tensors in self.state in torch.optim.AdamW's layout."""
        assert slot.exp_avg is not None and slot.exp_avg_sq is not None
        self.state[slot.param] = {
            "step": step,
            "exp_avg": wrap_like(slot.param, slot.exp_avg),
            "exp_avg_sq": wrap_like(slot.param, slot.exp_avg_sq),
        }

    # --- backward -----------------------------------------------------------------------

    def prepare_backward(self, is_boundary: bool) -> None:
        """Called by the engine before each backward: stream gradients to the host only in
        the backward that ends an accumulation window."""
        if self._streamer is not None:
            self._streamer.arm(is_boundary)

    def _copy_grad(
        self, p: torch.Tensor, grad: torch.Tensor, stream: torch.cuda.Stream | None
    ) -> None:
        slot = self._slots[id(p)]
        assert slot.grad_host is not None
        if stream is None:
            slot.grad_host.copy_(grad)
            return
        with torch.cuda.stream(stream):
            grad.record_stream(stream)  # FSDP allocated it on its reduce stream
            slot.grad_host.copy_(grad, non_blocking=True)

    # --- step ---------------------------------------------------------------------------

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, *, inv_grad_scale: float = 1.0
    ) -> float | None:
        """One step over every parameter with a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
            inv_grad_scale: multiplies every gradient on the fly (1 / loss scale, times the
                clipping coefficient); the engine passes it.
        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._nvme is not None:
            self._nvme.step(inv_grad_scale)
        else:
            self._host_step(inv_grad_scale)
        return loss

    def _steps(self) -> dict[int, list[_Slot]]:
        """Slots with a gradient, by their new step number (each parameter counts its own
        steps, like torch: one without a gradient is not stepped)."""
        by_step: dict[int, list[_Slot]] = {}
        for slot in self._slots.values():
            if slot.param.grad is None:
                continue
            state = self.state.setdefault(slot.param, {})
            step_t = state.get("step")
            if not isinstance(step_t, torch.Tensor):
                step_t = torch.zeros((), dtype=torch.float32)
                state["step"] = step_t
            step_t += 1
            by_step.setdefault(int(step_t.item()), []).append(slot)
        return by_step

    def begin_copies(self) -> None:
        """Order the side stream after everything queued so far on the current stream
        (the last reads of the parameters, FSDP's wait for its reductions)."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())

    def _host_step(self, inv_grad_scale: float) -> None:
        self._adopt_loaded_state()
        self.begin_copies()
        streamed = self._streamer.copied if self._streamer is not None else set()
        if self._streamer is not None:
            self._streamer.wait()
        for slot in self._slots.values():
            g = slot.param.grad
            if g is not None and id(slot.param) not in streamed:
                self._copy_grad(slot.param, local(g), self._stream)
        if self._stream is not None:
            self._stream.synchronize()
        if self._h2d_done is not None:
            self._h2d_done.synchronize()  # the pinned copy buffers are free again
        for step, slots in self._steps().items():
            for bucket in _buckets(slots):
                group = self.param_groups[bucket[0].group]
                beta1, beta2 = group["betas"]
                adam_step(
                    [s.master for s in bucket],  # type: ignore[misc]
                    [s.grad_host for s in bucket],  # type: ignore[misc]
                    [s.exp_avg for s in bucket],  # type: ignore[misc]
                    [s.exp_avg_sq for s in bucket],  # type: ignore[misc]
                    lr=float(group["lr"]),
                    step=step,
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    decoupled_weight_decay=group["decoupled_weight_decay"],
                    bias_correction=group.get("bias_correction", True),
                    inv_grad_scale=inv_grad_scale,
                    param_copies=[s.copy_host for s in bucket]  # type: ignore[misc]
                    if bucket[0].copy_host is not None
                    else None,
                )
                for s in bucket:
                    src = s.copy_host if s.copy_host is not None else s.master
                    assert src is not None
                    self.copy_to_device(local(s.param), src)
        self.finish_copies()

    def copy_to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host `src` into the device parameter `dst` (async on the side stream)."""
        if self._stream is None:
            dst.copy_(src.view(dst.shape))
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src.view(dst.shape), non_blocking=True)

    def finish_copies(self) -> None:
        """Order the next forward after the copies back, without blocking the host."""
        if self._stream is None:
            return
        event = torch.cuda.Event()
        event.record(self._stream)
        torch.cuda.current_stream().wait_event(event)
        self._h2d_done = event

    def _adopt_loaded_state(self) -> None:
        """Take in state that something other than checkpoint_view put in self.state: a
        load of a checkpoint saved before any step (no state: start from zero), or tensors
        a loader created instead of filling ours."""
        for slot in self._slots.values():
            assert slot.exp_avg is not None and slot.exp_avg_sq is not None
            state = self.state.get(slot.param)
            if not state or "exp_avg" not in state:
                slot.exp_avg.zero_()
                slot.exp_avg_sq.zero_()
                step = state.get("step") if state else None
                self._publish_state(
                    slot, step if isinstance(step, torch.Tensor) else torch.zeros(())
                )
                continue
            for key, host in (("exp_avg", slot.exp_avg), ("exp_avg_sq", slot.exp_avg_sq)):
                t = state[key]
                if local(t).data_ptr() != host.data_ptr():
                    host.copy_(local(t))
                    state[key] = wrap_like(slot.param, host)

    # --- checkpoints (fsdpx/checkpoint) -------------------------------------------------

    @contextlib.contextmanager
    def checkpoint_view(self) -> Iterator[dict[int, torch.Tensor]]:
        """While open: `self.state` holds every state tensor (fp32, this rank's shard,
        laid out like its parameter) and the yielded dict maps id(device parameter) to its
        fp32 master, laid out the same way. Saving reads them; loading writes into them
        (then call after_load)."""
        if self._nvme is not None:
            with self._nvme.checkpoint_view() as masters:
                yield masters
            return
        self._adopt_loaded_state()
        yield {pid: wrap_like(s.param, s.master) for pid, s in self._slots.items()}  # type: ignore[arg-type]

    @torch.no_grad()
    def after_load(self) -> None:
        """Copy the (just loaded) masters to the device parameters."""
        if self._nvme is not None:
            self._nvme.push_masters()
            return
        self.wait_copies_done()
        self.begin_copies()
        for slot in self._slots.values():
            assert slot.master is not None
            if slot.copy_host is not None:
                slot.copy_host.copy_(slot.master)
            self.copy_to_device(
                local(slot.param), slot.copy_host if slot.copy_host is not None else slot.master
            )
        self.finish_copies()

    # --- life cycle ---------------------------------------------------------------------

    def slots(self) -> list[_Slot]:
        return list(self._slots.values())

    @property
    def total_numel(self) -> int:
        """Elements of all local shards together (the flat NVMe layout's length)."""
        return self._total_numel

    @property
    def pin_memory(self) -> bool:
        return self._pin

    @property
    def copy_stream(self) -> torch.cuda.Stream | None:
        return self._stream

    def wait_copies_done(self) -> None:
        if self._h2d_done is not None:
            self._h2d_done.synchronize()

    def close(self) -> None:
        """Remove the gradient hooks and the NVMe swap file (idempotent)."""
        if self._streamer is not None:
            self._streamer.remove()
            self._streamer = None
        if self._nvme is not None:
            self._nvme.close()


def _buckets(slots: list[_Slot]) -> Iterator[list[_Slot]]:
    """Runs of slots of one param group (one set of hyperparameters) and one copy dtype,
    about _BUCKET_NUMEL elements each."""
    bucket: list[_Slot] = []
    size = 0
    for s in slots:
        if bucket and (
            size + s.numel > _BUCKET_NUMEL
            or s.group != bucket[0].group
            or (s.copy_host is None) != (bucket[0].copy_host is None)
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(s)
        size += s.numel
    if bucket:
        yield bucket


def cast_device_params_(
    params: list[torch.Tensor], dtype: torch.dtype, model: nn.Module | None
) -> None:
    """Store the device parameters in `dtype`, in place (the same Parameter objects, so
    FSDP, the optimizer and the engine keep their references). FSDP2 reads each
    parameter's dtype at its lazy init (first forward), so this must run before it."""
    ids = {id(p) for p in params if p.is_floating_point()}
    if model is None:
        raise ValueError("casting the device parameters needs the model (FSDP re-registers them)")
    model._apply(lambda t: t.to(dtype) if id(t) in ids else t)
