"""fsdpx's one comm layer (DESIGN, Round 2 clarification 4): every collective fsdpx issues
itself goes through `fsdpx.comm.counted`, which records its kind, a sequence number and the
bytes this rank sends; `fsdpx.comm.onebit` is the error-compensated 1-bit all-reduce built
on it (used by fsdpx.onebit_adam.OneBitAdam).

FSDP2's own collectives go through `fsdpx.comm.fsdp_slot`, which fsdpx.zero installs into
every FSDP module's all-gather / reduce-scatter slot: counted plain collectives, or ZeRO++'s
quantized ones (qwZ, qgZ). FSDP's HSDP cross-replica all-reduce is issued by FSDP outside
the slot: `fsdpx.comm.fsdp_all_reduce` counts it (and times its wait on CPU) from the slot's
edges and FSDP's all-reduce hook; `fsdpx.comm.fsdp_events` times FSDP's waits on CUDA.
"""

from typing import TYPE_CHECKING

from fsdpx.comm.counted import (
    CommLog,
    CommRecord,
    all_gather_single,
    all_reduce,
    all_to_all_single,
    comm_log,
)
from fsdpx.lazy_exports import lazy_getattr

# [Note: onebit on first use] The 1-bit all-reduce is imported when one of its names is
# first asked for (PEP 562), not with the package: fsdpx.zero imports this package for
# every sharded model, and only the 1-bit optimizers use `onebit` (its import is ~1 MiB of
# a rank's resident memory, which benchmarks/hf.py --part load counts).
_ONEBIT = ("OneBitState", "compressed_all_reduce", "padded_numel", "take_over_gradient_exchange")

if TYPE_CHECKING:
    from fsdpx.comm.onebit import (
        OneBitState,
        compressed_all_reduce,
        padded_numel,
        take_over_gradient_exchange,
    )


__getattr__ = lazy_getattr(__name__, dict.fromkeys(_ONEBIT, "fsdpx.comm.onebit"))


__all__ = [
    "CommLog",
    "CommRecord",
    "OneBitState",
    "all_gather_single",
    "all_reduce",
    "all_to_all_single",
    "comm_log",
    "compressed_all_reduce",
    "padded_numel",
    "take_over_gradient_exchange",
]
