"""Whether offloaded host buffers are pinned (page-locked): zero.offload_*.pin_memory.

[Note: pin_memory without an accelerator] Pinning host memory is a request to the
accelerator's driver: torch's pinned allocator (FSDP2's CPUOffloadPolicy, OffloadedAdamW's
host buffers) raises "Cannot access accelerator device when none is available", and the
NVMe store's page_lock_ needs CUDA. Pinning only speeds up copies to and from a device, so
on a machine without one it has nothing to speed up. DeepSpeed runs the same config file on
CPU, so fsdpx does too: an explicit `pin_memory: true` is honoured where CUDA exists and
otherwise ignored, said once per process and section at INFO on the "fsdpx" logger (the
buffers are then ordinary pageable memory, which is what training on CPU uses anyway).
`pin_memory` left unset pins exactly when the data moves to or from a device.

Both sections resolve their setting here: offload_param in offload_policy (build.py),
offload_optimizer in OffloadedAdamW (cpu.py; the NVMe store takes its decision). With
offload_param "cpu" the optimizer steps the host parameters in place and allocates no
buffers of its own, so offload_optimizer.pin_memory has nothing to pin there.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("fsdpx")

_said: set[str] = set()
"""Sections whose ignored request was logged in this process (the log line is said once)."""


def host_pin(requested: bool | None, *, section: str, default: bool) -> bool:
    """Whether to pin the host buffers of zero.`section`.

    Args:
        requested: the section's pin_memory (None: not set).
        section: "offload_param" or "offload_optimizer" (names the key in the log line).
        default: the decision when `requested` is None (true only where a device exists).
    Returns:
        `requested`, except False for a request to pin on a machine without CUDA (logged
        once per process and section at INFO).

    Example::

        pin = host_pin(cfg.zero.offload_param.pin_memory, section="offload_param",
                       default=torch.cuda.is_available())
    """
    if requested is None:
        return default
    if requested and not torch.cuda.is_available():
        if section not in _said:
            _said.add(section)
            logger.info(
                "zero.%s.pin_memory=true is ignored: pinning host memory needs a CUDA "
                "device and this machine has none (torch.cuda.is_available() is False); "
                "the offloaded buffers stay in ordinary pageable host memory, as DeepSpeed "
                "does on CPU",
                section,
            )
        return False
    return requested
