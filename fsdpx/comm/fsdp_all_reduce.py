"""FSDP2's gradient all-reduce across replicas (HSDP, and ZeRO stage 0's replicate mesh),
counted in fsdpx's comm log and, on a CPU device, timed as exposed communication.

[Note: timing FSDP's all-reduce]
FSDP2 issues that all-reduce itself (`dist.all_reduce` over the replicate group, inside
its `foreach_reduce`), not through the comm slot fsdpx owns (fsdpx/comm/fsdp_slot.py), so
neither the slot's counting nor its timing saw it. The slot's reduce-scatter object still
sees where it begins, and the module's all-reduce hook (`set_all_reduce_hook`, which FSDP
calls right after its all-reduce, before the post-divide) sees where it ends:

- begin: FSDP allocates the reduce output through the slot object (`allocate`), then
  reduce-scatters into it through the slot (shard group of two or more ranks) or copies
  the input into it (one-rank shard group, stage 0), then all-reduces it. The slot marks
  the time at each allocation and again when its reduce-scatter returns, so the last mark
  before the all-reduce is the end of the reduce-scatter, or the output allocation when
  there is none (the span then also holds that one gradient copy: memory traffic, small
  beside a collective over the network, and documented);
- end: the hook. On a CPU device (gloo) `dist.all_reduce` is synchronous, so the wall
  time from the mark to the hook is the time the training thread waited for it; it is
  added to `comm_wait_s`. On CUDA the all-reduce runs on FSDP's all-reduce stream and the
  host does not wait: nothing is timed here (the compute stream's stall on it, at the end
  of the backward, is timed with CUDA events: fsdpx/comm/fsdp_events.py).

Counted on every device, in the hook, as one `all_reduce` of the reduce output (formula
of fsdpx/comm/counted.py: 2 (W - 1) / W x its bytes, W = the replicate group size), so
`sent_all_reduce` carries it. It is logged once it returned: a rank blocked inside it
shows in a hang dump's stacks, not as "inside collective seq" (entered = completed).

A user's own `set_all_reduce_hook` on an fsdpx-sharded module replaces this one: that
module's all-reduce is then neither counted nor timed.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from fsdpx.comm import counted
from fsdpx.comm.fsdp_groups import param_groups
from fsdpx.telemetry.phases import COMM_WAIT, phase_clock

_CLOCK = phase_clock()


class AllReduceTimer:
    """One FSDP module's all-reduce: `mark()` from its reduce-scatter slot, called as the
    module's all-reduce hook (see [Note: timing FSDP's all-reduce]).

    Example::

        timer = AllReduceTimer(group)      # the replicate process group
        module.set_all_reduce_hook(timer)  # FSDP calls it after each all-reduce
        timer.mark()                       # the slot, just before FSDP all-reduces
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.marked: float | None = None

    def mark(self) -> None:
        """The slot's last step before FSDP's all-reduce may follow."""
        self.marked = time.perf_counter()

    def __call__(self, reduce_output: torch.Tensor) -> None:
        ended = time.perf_counter()
        w = self.group.size()
        nbytes = reduce_output.numel() * reduce_output.element_size()
        log = counted.comm_log()
        log.add("all_reduce", 2 * (w - 1) * nbytes // w, w)
        log.done()
        if self.marked is not None and reduce_output.device.type == "cpu":
            _CLOCK.add(COMM_WAIT, ended - self.marked)  # no-op while the clock is off
        self.marked = None


def attach(module: FSDPModule) -> AllReduceTimer | None:
    """Install an AllReduceTimer as `module`'s all-reduce hook when FSDP all-reduces its
    gradients across replicas (an HSDP or replicate mesh); None otherwise (nothing to
    time, or several parameter groups, where FSDP takes no all-reduce hook)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    groups = param_groups(module._get_fsdp_state())
    if len(groups) != 1 or not isinstance(groups[0].mesh_info, DDPMeshInfo):
        return None
    timer = AllReduceTimer(groups[0].mesh_info.replicate_process_group)
    module.set_all_reduce_hook(timer)
    return timer
