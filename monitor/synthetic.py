"""Deterministic synthetic telemetry: records and events of a made-up run.

Used by the tests (fixed logs, model and app checks) and by benchmarks/monitor_cpu.py
(thousands of simulated ranks) so both exercise the monitor with the same shapes the
publisher sends (the field names of `fsdpx.telemetry.wire.protocol.RECORD_FIELDS`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3
PHASE_SHARES = {"data_wait_s": 0.02, "forward_s": 0.3, "backward_s": 0.6, "optimizer_s": 0.08}
"""Each phase's share of a nominal step (they add up to the step: the comm waits below lie
inside forward and backward, as in a real FSDP run)."""
WAIT_SHARES = {"forward_s": 0.04, "backward_s": 0.06, "optimizer_s": 0.0}
"""The share of a nominal step each phase spends waiting in collectives (inside its time)."""
WAITED_IN = {"data_wait_s": "forward_s", "forward_s": "forward_s", "backward_s": "backward_s"}
"""Where the other ranks wait for a rank slow in a phase, by default: for a late loader or
a slow start of forward, in their forward's all-gathers; for a slow backward, in its
reduce-scatters; otherwise in the optimizer step's collectives."""


@dataclass(frozen=True)
class SlowPhase:
    """An injected straggler: `rank` spends `extra_s` more in `phase` (a record field,
    e.g. "data_wait_s") at `steps` (None: every step). The other ranks wait for it in a
    collective inside their `waited_in` phase (None: `WAITED_IN[phase]`): their time in
    that phase grows by the wait, and so does its comm wait, as in synchronous FSDP
    training (a slow start of forward: the others wait in forward; a slow end of forward,
    after its last all-gather: `waited_in="backward_s"`)."""

    rank: int
    phase: str
    extra_s: float
    steps: range | None = None
    waited_in: str | None = None

    @property
    def sync_phase(self) -> str:
        """The phase whose collectives the other ranks wait for this one in."""
        return self.waited_in or WAITED_IN.get(self.phase, "optimizer_s")


@dataclass
class SyntheticRun:
    """A run of `n_ranks` ranks on hosts of `ranks_per_host`, with injected anomalies.

    Args:
        n_ranks: number of ranks.
        seed: random seed; the same arguments give the same records.
        ranks_per_host: ranks per simulated host (host names `node000`, ...).
        step_time_s: nominal step time.
        start_time: wall time of step 0.
        straggler: a rank whose step time is 2.5x the others (None: none).
        memory_hog: a rank near its device memory capacity (None: none).
        nan_rank: a rank whose loss is NaN from step `nan_from_step` (None: none).
        stop_rank: a rank that stops publishing after step `stop_after_step` (None: none).

    Example::

        run = SyntheticRun(n_ranks=4, seed=0)
        records = run.records(step=1)
        assert [r["rank"] for r in records] == [0, 1, 2, 3]
    """

    n_ranks: int
    seed: int = 0
    ranks_per_host: int = 8
    step_time_s: float = 0.2
    start_time: float = 1_700_000_000.0
    straggler: int | None = None
    memory_hog: int | None = None
    nan_rank: int | None = None
    nan_from_step: int = 0
    stop_rank: int | None = None
    stop_after_step: int = 0
    phases: bool = False
    """Add the phase-time fields (data_wait_s, forward_s, ...) to every record."""
    slow_phases: tuple[SlowPhase, ...] = ()
    """Injected phase stragglers (implies `phases`)."""
    comm_split: bool = True
    """With phases: the records carry the comm wait inside each phase
    (COMM_SPLIT_FIELDS, comm_wait_forward_s ...); False: as an older publisher sent them,
    the same times without those fields."""
    tokens_per_step: int = 8192
    capacity: int = 80 * GIB
    _jitter: list[float] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self._jitter = [rng.uniform(0.97, 1.03) for _ in range(self.n_ranks)]

    def time_of(self, step: int) -> float:
        """Wall time at which `step` ends (on a nominal rank)."""
        return self.start_time + step * self.step_time_s

    def record(self, rank: int, step: int) -> dict[str, Any]:
        """The record rank `rank` publishes after optimizer step `step`."""
        st = self.step_time_s * self._jitter[rank]
        if rank == self.straggler:
            st *= 2.5
        if self.slow_phases:  # synchronous: every rank's step takes the slowest's extras
            st += sum(max(late.values(), default=0.0) for late in self._lateness(step).values())
        loss = 4.0 * math.exp(-step / 200.0) + 1.5 + 0.02 * math.sin(step + rank)
        if rank == self.nan_rank and step >= self.nan_from_step:
            loss = float("nan")
        allocated = (20 + (rank % 7)) * GIB
        reserved = allocated + 4 * GIB
        if rank == self.memory_hog:
            reserved = int(0.96 * self.capacity)
        return {
            "rank": rank,
            "local_rank": rank % self.ranks_per_host,
            "host": f"node{rank // self.ranks_per_host:03d}",
            "pid": 1000 + rank,
            "step": step,
            "time": self.time_of(step),
            "loss": loss,
            "lr": 3e-4 * min(1.0, step / 100.0),
            "grad_norm": 1.0 + 0.1 * math.cos(step),
            "loss_scale": None,
            "skipped": False,
            "step_time_s": st,
            "tokens_per_s": self.tokens_per_step / st,
            "mem_allocated": allocated,
            "mem_reserved": reserved,
            "mem_peak": reserved - GIB,
            "alloc_retries": 0,
            "ooms": 0,
            "device_mem_used": reserved + GIB // 2,
            "device_mem_total": self.capacity,
            "device_util": 90.0 + (rank % 10),
            "device_power_w": 600.0,
            "device_temp_c": 60.0 + (rank % 5),
            "host_rss": 8 * GIB,
            "tflops": 400.0 * self.step_time_s / st,
            "mfu": 0.4 * self.step_time_s / st,
            "comm_bytes": 2 * GIB,
            "dropped": 0,
            **(self._phases(rank, step) if self.phases or self.slow_phases else {}),
        }

    def _lateness(self, step: int) -> dict[str, dict[int, float]]:
        """Per phase holding a sync point: how late each slow rank arrives at it."""
        out: dict[str, dict[int, float]] = {}
        for s in self.slow_phases:
            if s.steps is None or step in s.steps:
                late = out.setdefault(s.sync_phase, {})
                late[s.rank] = late.get(s.rank, 0.0) + s.extra_s
        return out

    def _phases(self, rank: int, step: int) -> dict[str, float | None]:
        """Phase times of one record: nominal shares with jitter, a slow rank's extra time
        in its phase, and every rank waiting at each sync point for the latest rank there
        (the wait inside the phase that holds it, and in its comm wait)."""
        base = self.step_time_s * self._jitter[rank]
        times = {name: share * base for name, share in PHASE_SHARES.items()}
        waits = {name: share * base for name, share in WAIT_SHARES.items()}
        for s in self.slow_phases:
            if s.rank == rank and (s.steps is None or step in s.steps):
                times[s.phase] += s.extra_s
        for phase, late in self._lateness(step).items():
            wait = max(late.values()) - late.get(rank, 0.0)
            times[phase] += wait
            waits[phase] += wait
        out: dict[str, float | None] = {**times, "comm_wait_s": sum(waits.values())}
        out["h2d_s"] = None  # a run without offload
        if self.comm_split:
            for name, wait in waits.items():
                out[f"comm_wait_{name}"] = wait
        return out

    def publishing(self, rank: int, step: int) -> bool:
        """Whether `rank` still publishes at `step` (False after the injected stop)."""
        return not (rank == self.stop_rank and step > self.stop_after_step)

    def records(self, step: int) -> list[dict[str, Any]]:
        """All ranks' records of one step (minus a stopped rank's)."""
        return [self.record(r, step) for r in range(self.n_ranks) if self.publishing(r, step)]

    def start_events(self, total_steps: int | None = None) -> list[dict[str, Any]]:
        """The `start` event of every rank."""
        detail: dict[str, Any] = {"world_size": self.n_ranks}
        if total_steps is not None:
            detail["total_steps"] = total_steps
        return [
            {
                "rank": r,
                "host": f"node{r // self.ranks_per_host:03d}",
                "time": self.start_time,
                "kind": "start",
                "step": 0,
                "detail": detail,
            }
            for r in range(self.n_ranks)
        ]

    def messages(self, steps: int, total_steps: int | None = None) -> list[dict[str, Any]]:
        """A whole run as protocol messages: start events, one `records` message per step,
        a checkpoint event at the middle, exit events at the end."""
        out: list[dict[str, Any]] = [{"type": "events", "events": self.start_events(total_steps)}]
        for step in range(1, steps + 1):
            out.append({"type": "records", "records": self.records(step)})
            if step == steps // 2:
                out.append(
                    {
                        "type": "events",
                        "events": [
                            {
                                "rank": 0,
                                "host": "node000",
                                "time": self.time_of(step),
                                "kind": "checkpoint_saved",
                                "step": step,
                                "detail": {
                                    "path": "ckpt/step",
                                    "bytes": 3 * GIB,
                                    "duration_s": 1.5,
                                },
                            }
                        ],
                    }
                )
        out.append(
            {
                "type": "events",
                "events": [
                    {
                        "rank": r,
                        "host": f"node{r // self.ranks_per_host:03d}",
                        "time": self.time_of(steps),
                        "kind": "exit",
                        "step": steps,
                        "detail": {"reason": "finished", "dropped": 0},
                    }
                    for r in range(self.n_ranks)
                    if self.publishing(r, steps)
                ],
            }
        )
        return out
