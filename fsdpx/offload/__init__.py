"""Offload (DeepSpeed's ZeRO-Offload and ZeRO-Infinity) on FSDP2.

- optimizer offload to CPU or NVMe: `OffloadedAdamW` (cpu.py; NVMe streaming in
  nvme_step.py over the swap-file store in nvme.py; gradient streaming in grad_stream.py);
- parameter offload: FSDP2's CPUOffloadPolicy with the fused CPU Adam (build.py).

fsdpx.shard builds these from zero.offload_optimizer / zero.offload_param.
"""

from fsdpx.offload.build import build_offload_optimizer, check_offload, offload_policy
from fsdpx.offload.cpu import OffloadedAdamW

__all__ = ["OffloadedAdamW", "build_offload_optimizer", "check_offload", "offload_policy"]
