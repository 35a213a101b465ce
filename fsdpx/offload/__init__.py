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

from typing import TYPE_CHECKING

from fsdpx.lazy_exports import lazy_getattr
from fsdpx.offload.plan import OffloadPlan, check_offload, resolve_offload

# [Note: offload imports on first use] The offloaded optimizer (host and NVMe state
# stores, swap files, and through them the checkpoint package) is imported when a name
# of it is first asked for (PEP 562) or when build_offload builds one: fsdpx.shard reads
# the plan for every model, and a model that offloads nothing does not pay those modules'
# resident memory (~1.5 MiB per rank, which benchmarks/hf.py --part load counts).
_LAZY = {
    "OffloadBuild": "fsdpx.offload.build",
    "build_offload": "fsdpx.offload.build",
    "fsdp_offload_policy": "fsdpx.offload.build",
    "offload_policy": "fsdpx.offload.build",
    "OffloadedAdamW": "fsdpx.offload.optimizer",
}

if TYPE_CHECKING:
    from fsdpx.offload.build import (
        OffloadBuild,
        build_offload,
        fsdp_offload_policy,
        offload_policy,
    )
    from fsdpx.offload.optimizer import OffloadedAdamW


__getattr__ = lazy_getattr(__name__, _LAZY)


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
