"""Which run a record belongs to: the run id every rank of one launch shares, and the job.

[Note: run identity]
A relay can outlive a job and a replay log is appended to by every launch that names it,
so one stream can carry several runs. Every record and event therefore carries `run_id`:
one id per *launch* of the job, the same on all its ranks, never reused (a resume into
the same log is a new launch, so a new run id). Records also carry `job`: a name shared
by every launch of one job, so a reader can show a resume as a later run of the same job.

- `run_id`: `telemetry.run_id` when set (then the user promises one value per launch,
  e.g. from the scheduler); otherwise global rank 0 makes one from the UTC start time and
  random bits (`20261125-175500-3fa2c1`: sorts by start, unique) and broadcasts it, so
  all ranks agree without any shared environment (fsdpx/telemetry/start.py).
- `job`: `telemetry.job` when set; else torchrun's rendezvous id (TORCHELASTIC_RUN_ID: the
  same for every restart of an elastic job and for every node; torchrun writes "none"
  when no --rdzv-id was given, which names nothing); else None (the run is its own job).

Readers treat a record or event without `run_id` (written before run ids existed) as one
unnamed run (run id None), so old logs read as before.

Example::

    run = RunIdentity.for_launch(cfg.telemetry, env=os.environ)
    record["run_id"], record["job"] = run.run_id, run.job
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

_TORCHRUN_RUN_ID = "TORCHELASTIC_RUN_ID"


def new_run_id(now: float | None = None) -> str:
    """A fresh run id: UTC start time (so ids sort by start) and 24 random bits.

    Example::

        new_run_id(0.0)  # '19700101-000000-' + 6 hex digits
    """
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(time.time() if now is None else now))
    return f"{stamp}-{os.urandom(3).hex()}"


def default_job(env: Mapping[str, str]) -> str | None:
    """The job name a launcher gives: torchrun's rendezvous id, or None."""
    value = env.get(_TORCHRUN_RUN_ID)
    return value if value and value != "none" else None


@dataclass(frozen=True)
class RunIdentity:
    """The run id (one per launch) and job name (shared by launches) of this process.

    Args:
        run_id: the launch's id, equal on every rank of the launch.
        job: the job's name, or None.
    """

    run_id: str
    job: str | None = None

    @classmethod
    def for_launch(
        cls, run_id: str | None, job: str | None, *, env: Mapping[str, str]
    ) -> RunIdentity:
        """The identity from the config, filling what is unset (see [Note: run identity]).

        A run id made here is this process's own: a multi-rank job must make it on one
        rank and share it (start.py does), or every rank would get another.
        """
        return cls(run_id or new_run_id(), job or default_job(env))


def run_of(item: Mapping[str, object]) -> str | None:
    """The run id of a record or event as readers key on it: None when it has none (an
    older publisher: all such items form one unnamed run) or a non-str one (bad input)."""
    value = item.get("run_id")
    return value if type(value) is str else None
