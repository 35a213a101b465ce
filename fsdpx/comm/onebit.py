"""The error-compensated 1-bit all-reduce of 1-bit Adam (Tang et al., 2021, "1-bit Adam:
Communication Efficient Large-Scale Training with Adam's Convergence Speed"), on
fsdpx.comm's counted collectives.

One call averages a tensor over the group in two compressed rounds:

1. worker: ``x = tensor + worker_error`` (padded to ``N``, a multiple of 8 * W);
   ``worker_scale = ||x|| / sqrt(N)``; it sends ``sign(x)`` as bits and keeps
   ``worker_error = x - worker_scale * sign(x)``. An all-to-all hands rank j every
   rank's j-th chunk of signs; an all-gather shares the W worker scales.
2. server (rank j for chunk j): ``m = mean_r(scale_r * sign_r) + server_error``;
   ``server_scale = ||m|| / sqrt(N / W)``; it keeps
   ``server_error = m - server_scale * sign(m)`` and all-gathers the bits of ``sign(m)``
   and the scales, so every rank rebuilds the same ``server_scale_j * sign_j`` chunks.

sign(0) is +1 (a bit has two values). Bytes this rank sends per call (fsdpx.comm.counted's
formulas): ``(W-1)/W * N/8`` (all-to-all) + ``(W-1) * 4`` (worker scales) +
``(W-1) * N/(8W)`` (server signs) + ``(W-1) * 4`` (server scales), against
``2 (W-1)/W * 4n`` for an fp32 all-reduce: about 1/32 of it for large tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdpx.comm import counted

_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def padded_numel(numel: int, world_size: int) -> int:
    """`numel` rounded up to a multiple of 8 * world_size (whole bytes per rank's chunk)."""
    unit = 8 * world_size
    return -(-numel // unit) * unit


@dataclass
class OneBitState:
    """The two error-feedback buffers of one compressed tensor (fp32, flat)."""

    worker_error: torch.Tensor
    """Shape (N,): what this rank's sign compression lost last time."""
    server_error: torch.Tensor
    """Shape (N / W,): what this rank's server-side compression of its chunk lost."""

    @staticmethod
    def zeros(numel: int, world_size: int, device: torch.device) -> OneBitState:
        n = padded_numel(numel, world_size)
        return OneBitState(
            torch.zeros(n, dtype=torch.float32, device=device),
            torch.zeros(n // world_size, dtype=torch.float32, device=device),
        )

    def as_dict(self, prefix: str = "") -> dict[str, torch.Tensor]:
        """The two buffers by name, for a checkpoint ([Note: per-rank optimizer state] in
        fsdpx/checkpoint/state.py)."""
        return {
            prefix + "worker_error": self.worker_error,
            prefix + "server_error": self.server_error,
        }

    @staticmethod
    def from_dict(
        found: dict[str, torch.Tensor], prefix: str, device: torch.device
    ) -> OneBitState | None:
        """The buffers `as_dict(prefix)` named, moved to `device`; None when `found` lacks
        them. `compressed_all_reduce` checks their sizes when it uses them."""
        worker, server = found.get(prefix + "worker_error"), found.get(prefix + "server_error")
        if worker is None or server is None:
            return None
        return OneBitState(
            worker.to(device, torch.float32).reshape(-1).clone(),
            server.to(device, torch.float32).reshape(-1).clone(),
        )


def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """uint8 bytes holding ``x >= 0`` (bit i of byte k is element 8k + i); x.numel() % 8 == 0."""
    bits = (x >= 0).to(torch.uint8).view(-1, 8)
    return (bits * _BIT_WEIGHTS.to(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """The +1 / -1 fp32 values `pack_signs` encoded."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.view(-1).to(torch.float32) * 2 - 1


def compress_(x: torch.Tensor, error: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sign-compress ``x + error``: returns (scale, packed signs) and sets `error` to what
    the compression lost. `x` and `error` are flat fp32 tensors of one size."""
    y = x + error
    scale = torch.linalg.vector_norm(y) / math.sqrt(y.numel())
    packed = pack_signs(y)
    error.copy_(y - scale * unpack_signs(packed))
    return scale.reshape(1), packed


def compressed_all_reduce(
    tensor: torch.Tensor, state: OneBitState, group: dist.ProcessGroup | None = None
) -> None:
    """Replace `tensor` (fp32) by the 1-bit compressed average of it over `group`, in place,
    updating `state`'s error feedback (module docstring). A one-rank group leaves it as is.

    Example::

        state = OneBitState.zeros(m.numel(), dist.get_world_size(), m.device)
        compressed_all_reduce(m, state)      # m is now every rank's same estimate of mean(m)
    """
    w = dist.get_world_size(group)
    if w == 1:
        return
    if tensor.dtype != torch.float32:
        raise TypeError(f"compressed_all_reduce takes fp32 tensors; got {tensor.dtype}")
    n = tensor.numel()
    big_n = state.worker_error.numel()
    if big_n != padded_numel(n, w) or state.server_error.numel() != big_n // w:
        raise ValueError(
            f"OneBitState sized for {big_n} elements does not fit a tensor of {n} elements "
            f"on {w} ranks (expected {padded_numel(n, w)}); make it with OneBitState.zeros"
        )
    x = torch.zeros(big_n, dtype=torch.float32, device=tensor.device)
    x[:n] = tensor.reshape(-1)
    # 1. worker side: every rank sends its signs for chunk j to rank j.
    scale, packed = compress_(x, state.worker_error)
    received = torch.empty_like(packed)
    counted.all_to_all_single(received, packed, group)
    scales = torch.empty(w, dtype=torch.float32, device=tensor.device)
    counted.all_gather_single(scales, scale, group)
    # 2. server side: average this rank's chunk, compress it again with its own error.
    chunk = unpack_signs(received).view(w, -1)
    mean = (chunk * scales.unsqueeze(1)).sum(0) / w
    server_scale, server_packed = compress_(mean, state.server_error)
    all_packed = torch.empty(big_n // 8, dtype=torch.uint8, device=tensor.device)
    counted.all_gather_single(all_packed, server_packed, group)
    server_scales = torch.empty(w, dtype=torch.float32, device=tensor.device)
    counted.all_gather_single(server_scales, server_scale, group)
    result = unpack_signs(all_packed).view(w, -1) * server_scales.unsqueeze(1)
    tensor.copy_(result.view(-1)[:n].view_as(tensor))


def take_over_gradient_exchange(
    model: torch.nn.Module,
    hook: Callable[[torch.Tensor], None],
    *,
    owner: str,
    optimizer_type: str,
) -> None:
    """Install `hook` as the all-reduce hook of every FSDP module of `model` (ZeRO stage 0):
    the 1-bit family's optimizers own the gradient exchange, so FSDP itself must issue
    none ([Note: who owns the gradient exchange] in fsdpx/onebit_adam.py).

    Raises:
        ValueError: a parameter lives on an FSDP mesh of more than one rank (FSDP would
            all-reduce its gradient too).
    """
    for p in model.parameters():
        if isinstance(p, DTensor) and p.device_mesh.size() > 1:
            raise ValueError(
                f"{owner} exchanges gradients itself, but this model's parameters live "
                f"on a {p.device_mesh.size()}-rank FSDP mesh, so FSDP all-reduces them too. "
                f"Build it with fsdpx.shard and optimizer.type = '{optimizer_type}' at "
                "zero.stage 0 in the config (not optimizer=callable)"
            )
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_all_reduce_hook(hook)
