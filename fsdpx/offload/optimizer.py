"""ZeRO-Offload / ZeRO-Infinity's optimizer: fp32 master parameters and Adam states off
the device (host memory or NVMe files), stepped by the fused CPU `adam_step`, while the
sharded parameters stay on the device.

OffloadedAdamW is what does not depend on where the state lives (param groups, slots,
step counters, the copy stream, the checkpoint protocol); the state itself is in its
store: HostState (host_state.py, device "cpu") or NvmeState (nvme_state.py, device "nvme"),
see [Note: state stores] in state_store.py.

Offload is pure data movement: with fp32 device parameters the results are bitwise those of
fsdpx.optim.AdamW on the same parameters without offload (the same kernel, same order).

Checkpoints (fsdpx/checkpoint): OffloadedAdamW is an fsdpx.checkpoint.external.ExternalState:
`checkpoint_view()` exposes the fp32 masters in place of the device parameters
("model/<fqn>") and every state tensor in `self.state` ("optim/<fqn>/..."), so the files
are those of a run without offload; `after_load()` pushes loaded masters to the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from fsdpx.checkpoint.external import register_external_state
from fsdpx.config import OffloadConfig
from fsdpx.dtensor import to_local as local
from fsdpx.offload.copies import DeviceCopies
from fsdpx.offload.host_state import HostState
from fsdpx.offload.nvme_state import NvmeState
from fsdpx.offload.pin import host_pin
from fsdpx.offload.slots import Slot, make_slots
from fsdpx.offload.state_store import StateStore, StoreContext
from fsdpx.optim import adamw_defaults

_STORES: dict[str, Callable[[StoreContext, dict[int, torch.Tensor]], StateStore]] = {
    "cpu": HostState,
    "nvme": NvmeState,
}
"""zero.offload_optimizer.device -> the store that keeps the state there."""


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW (Adam with `decoupled_weight_decay=False`) whose fp32 master weights and
    moments live off the device (module docstring). Built by fsdpx.shard when
    zero.offload_optimizer.device is "cpu" or "nvme" (fsdpx/offload/plan.py).

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
        make_store = _STORES.get(offload.device)
        if make_store is None:
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
        self._slots = make_slots(self.param_groups)
        params_list = [s.param for s in self._slots]
        on_accel = any(local(p).device.type != "cpu" for p in params_list)
        pin = host_pin(offload.pin_memory, section="offload_optimizer", default=on_accel)
        self.pin_memory = pin
        """Whether the host state is pinned (resolved once: pin.py's note)."""
        masters = {id(p): local(p).detach().float() for p in params_list}
        if device_dtype is not None:
            cast_device_params_(params_list, device_dtype, model)
        copy_dtype = device_dtype if device_dtype in (torch.bfloat16, torch.float16) else None
        ctx = StoreContext(
            slots=self._slots,
            param_groups=self.param_groups,
            state=self.state,  # type: ignore[arg-type]
            copies=DeviceCopies(on_accel),
            offload=offload,
            pin_memory=pin,
            copy_dtype=copy_dtype,
            model=model,
            rank=rank,
        )
        self._store: StateStore = make_store(ctx, masters)
        del masters
        if model is not None:
            # A model-only fsdpx.checkpoint.save/load finds the masters through this.
            register_external_state(model, self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Called by torch.optim.Optimizer.__init__ before any offload state exists; a group
        # added later would get no host or swap-file state and never be stepped.
        if hasattr(self, "_slots"):
            raise NotImplementedError(
                "OffloadedAdamW cannot take parameter groups after construction (their "
                "offloaded state is laid out once); pass every group to fsdpx.shard's model"
            )
        super().add_param_group(param_group)

    @property
    def host_buffer_bytes(self) -> int:
        """Host bytes of the NVMe streaming buffers (0 with device "cpu")."""
        return self._store.host_bytes

    @property
    def swap_file_bytes(self) -> int:
        """Bytes of the NVMe swap file (0 with device "cpu")."""
        return self._store.file_bytes

    def slots(self) -> list[Slot]:
        return list(self._slots)

    @property
    def total_numel(self) -> int:
        """Elements of all local shards together (the flat layout's length)."""
        return self._slots[-1].offset + self._slots[-1].numel if self._slots else 0

    def host_tensors(self) -> list[torch.Tensor]:
        """The per-parameter host tensors of its store (see StateStore.host_tensors)."""
        return self._store.host_tensors()

    def prepare_backward(self, is_boundary: bool) -> None:
        """Called by the engine before each backward: stream gradients to the host only in
        the backward that ends an accumulation window."""
        self._store.prepare_backward(is_boundary)

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
        self._store.step(inv_grad_scale)
        return loss

    # --- checkpoints (fsdpx.checkpoint.external.ExternalState) -----------------------------

    @contextlib.contextmanager
    def checkpoint_view(self) -> Iterator[dict[int, torch.Tensor]]:
        """While open: `self.state` holds every state tensor (fp32, this rank's shard,
        laid out like its parameter) and the yielded dict maps id(device parameter) to its
        fp32 master, laid out the same way. Saving reads them; loading writes into them
        (then call after_load)."""
        with self._store.checkpoint_view() as masters:
            yield masters

    @torch.no_grad()
    def after_load(self) -> None:
        """Copy the (just loaded) masters to the device parameters."""
        self._store.push_masters()

    def save_synchronously(self) -> bool:
        """Whether checkpoints must be written inside the view, never snapshotted: true for
        NVMe, where a snapshot would copy the whole swap file into host memory."""
        return self._store.saves_synchronously

    def close(self) -> None:
        """Remove the gradient hooks and the NVMe swap file (idempotent)."""
        self._store.close()


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
