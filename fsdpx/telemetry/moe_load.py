"""Expert load per optimizer step: the telemetry record's `moe_*` fields
(`MOE_FIELDS` of fsdpx/telemetry/wire/protocol.py, monitor/PROTOCOL.md "Mixture of
experts").

What is counted, on this rank, summed over every MoE layer and micro-step of the step:

- `moe_tokens`: rows this rank's experts computed (a token routed to two local experts is
  two rows). Under expert parallelism these are the rows that arrived from the whole ep
  group, so comparing ranks shows which expert-parallel rank carries the most work.
- `moe_dropped`: assignments the capacity gates (DeepSpeed's top-1 / top-2) dropped
  because their expert was full; 0 on the dropless path.
- `moe_imbalance`: the largest, over the step's MoE layer calls, of max_e(c_e) / mean_e(c_e),
  c_e = the assignments this rank's router kept for expert e (of all experts of the layer,
  local or not): 1.0 is a perfectly balanced router, E means every token chose one expert.

[Note: one expert-load counter] Like the phase clock and the comm log, the counter is
process-wide (`moe_load()`): the dispatch that sees the counts (fsdpx/moe/dispatch.py)
knows nothing of the engine, and the publisher takes the step's totals at each optimizer
step (which resets them). The counts are Python ints the dispatch already holds (it needs
them as split sizes), so counting adds no device synchronisation. A forward run again
during backward (activation checkpointing's recompute) is not counted twice: calls made
while autograd runs a backward pass are skipped. Forwards outside training (evaluation
between steps) are counted into the next step's record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class MoELoad:
    """The current step's expert-load totals on this rank ([Note: one expert-load counter])."""

    tokens: int = 0
    dropped: int = 0
    imbalance: float | None = None
    calls: int = 0
    """MoE layer calls counted this step; 0: no MoE layer ran (the fields are then nil)."""

    def add_routing(self, counts: Sequence[int]) -> None:
        """One layer call's kept assignments per expert (this rank's router)."""
        if _recomputing():
            return
        self.calls += 1
        total = sum(counts)
        if total == 0 or not counts:
            return
        ratio = max(counts) * len(counts) / total
        self.imbalance = ratio if self.imbalance is None else max(self.imbalance, ratio)

    def add_computed(self, rows: int) -> None:
        """Rows this rank's experts computed in one layer call."""
        if not _recomputing():
            self.tokens += rows

    def add_dropped(self, assignments: int) -> None:
        """Assignments a capacity gate dropped in one layer call."""
        if not _recomputing():
            self.dropped += assignments

    def take(self) -> dict[str, int | float | None]:
        """The step's record fields (all None when no MoE layer ran), then reset."""
        if self.calls == 0:
            fields: dict[str, int | float | None] = dict.fromkeys(
                ("moe_tokens", "moe_dropped", "moe_imbalance")
            )
        else:
            fields = {
                "moe_tokens": self.tokens,
                "moe_dropped": self.dropped,
                "moe_imbalance": self.imbalance,
            }
        self.tokens, self.dropped, self.imbalance, self.calls = 0, 0, None, 0
        return fields


def _recomputing() -> bool:
    """Inside a backward pass (a checkpointed forward being recomputed)."""
    return bool(torch._C._current_graph_task_id() != -1)


_LOAD = MoELoad()


def moe_load() -> MoELoad:
    """This process's counter ([Note: one expert-load counter])."""
    return _LOAD
