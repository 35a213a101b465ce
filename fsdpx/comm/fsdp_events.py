"""FSDP2's all-gather / reduce-scatter waits on CUDA, timed with CUDA events as exposed
communication (`comm_wait_s`, monitor/PROTOCOL.md "Phase times").

[Note: CUDA waits]
On CUDA, FSDP2 runs its collectives on its own streams and the host never blocks in them
(fsdpx/comm/fsdp_slot.py [Note: timing FSDP's waits]): what is exposed is the time the
compute stream stalls on FSDP's events before it may use the result. FSDP makes the
compute stream wait in a few methods of its parameter group; fsdpx wraps them on each
group it shards (instance attributes: FSDP calls `self.<method>()`, so the wrapper is
found first; the class and every other model are untouched) and records a CUDA event on
the current (compute) stream before and after each call:

- `wait_for_unshard` (before forward, and before backward re-gathers): the wait for the
  all-gather, then FSDP's copy-out of the gathered parameters, a device-local copy the
  pair cannot separate from the stall (documented as part of the span);
- `_wait_for_post_backward` (a module's next reduce waiting for its previous one) and
  `finalize_backward` (the end of the last backward: the stream waits for every
  reduce-scatter / all-reduce still in flight, and for gradient offload copies).

The pair's elapsed time is the compute stream's time between the two points, which is
the stall plus the copy-out: zero when the collective had finished in time (overlapped),
its remaining duration when it had not. The pairs go to the phase clock like the other
CUDA spans (fsdpx/telemetry/phases.py [Note: phase spans]) and are read a step later on
the sender thread; nothing synchronizes the host. Installed only where
`torch.cuda.is_available()` and only on groups whose slots are fsdpx's plain counted
collectives: with qwZ / qgZ the comm layer already times the blocking collective
(fsdpx/comm/counted.py), and timing the stall too would count that wait twice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from fsdpx.comm.fsdp_groups import param_groups
from fsdpx.telemetry.phases import COMM_WAIT, phase_clock

_CLOCK = phase_clock()
WAIT_METHODS = ("wait_for_unshard", "_wait_for_post_backward", "finalize_backward")
"""The parameter-group methods in which FSDP2 (torch 2.13) makes the compute stream wait
for its collectives."""


def _timed(call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not (_CLOCK.enabled and _CLOCK.cuda):
            return call(*args, **kwargs)
        start = torch.cuda.Event(enable_timing=True)
        start.record()  # the current stream: FSDP's compute stream at its wait point
        try:
            return call(*args, **kwargs)
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            _CLOCK.add_events(COMM_WAIT, start, end)

    wrapper.fsdpx_cuda_timed = True  # type: ignore[attr-defined]
    return wrapper


def attach(module: FSDPModule) -> int:
    """Wrap the wait methods of `module`'s FSDP parameter groups (see [Note: CUDA
    waits]); returns how many groups were wrapped (0 without CUDA). Idempotent."""
    if not torch.cuda.is_available():
        return 0
    groups = param_groups(module._get_fsdp_state())
    for group in groups:
        for name in WAIT_METHODS:
            method = getattr(group, name)
            if not getattr(method, "fsdpx_cuda_timed", False):
                setattr(group, name, _timed(method))
    return len(groups)
