"""Offload (DeepSpeed's ZeRO-Offload and ZeRO-Infinity) on FSDP2.

The config is resolved once into an `OffloadPlan` (plan.py: where params, masters, moments
and gradients live); build.py turns the plan into FSDP2's CPUOffloadPolicy for host
parameters and the optimizer: `OffloadedAdamW` (optimizer.py) over a state store, host
memory (host_state.py, gradient streaming in grad_stream.py) or an NVMe swap file
(nvme_state.py over nvme.py), with the engine's step strategy (step.py); or fsdpx.optim.AdamW
stepping host parameters in place.

fsdpx.shard and fsdpx.estimate read zero.offload_optimizer / zero.offload_param only
through the plan.
"""

from fsdpx.offload.build import OffloadBuild, build_offload, fsdp_offload_policy, offload_policy
from fsdpx.offload.optimizer import OffloadedAdamW
from fsdpx.offload.plan import OffloadPlan, check_offload, resolve_offload

__all__ = [
    "OffloadBuild",
    "OffloadPlan",
    "OffloadedAdamW",
    "build_offload",
    "check_offload",
    "fsdp_offload_policy",
    "offload_policy",
    "resolve_offload",
]
