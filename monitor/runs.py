"""The runs a monitor has seen: one `MonitorModel` per run, so runs never mix.

A relay can outlive a job, and a log holds every launch appended to it (a resume is a
new launch: fsdpx/telemetry/wire/runs.py [Note: run identity]). Records and events are routed
by their `run_id` to that run's own model, so a new run starts with fresh per-rank state:
no error flag carried over from the previous run, its own loss curve, its own elapsed
time. Items without a run id (older publishers and logs) form one unnamed run.

Pure Python, no Textual; the app picks which run to show (default: the newest).

Example::

    book = RunBook(MonitorSettings())
    book.add_records([{"rank": 0, "step": 1, "run_id": "a"}], now=1.0)
    book.add_records([{"rank": 0, "step": 1, "run_id": "b"}], now=2.0)
    assert book.run_ids == ["a", "b"] and book.newest == "b"
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from fsdpx.telemetry.wire.columns import RecordColumns
from fsdpx.telemetry.wire.runs import run_of
from monitor.model import MonitorModel
from monitor.state import MonitorSettings

MAX_RUNS = 16
"""Runs kept; a new run beyond it forgets the oldest (a relay serving job after job)."""


@dataclass
class RunInfo:
    """What the run selector says about one run."""

    run_id: str | None
    job: str | None = None
    first_step: int | None = None
    """Step of the run's first record: above 1, the run resumed from a checkpoint."""


class RunBook:
    """Per-run models, in order of first arrival.

    Args:
        settings: thresholds handed to every run's model.
        max_runs: runs kept (oldest forgotten first).
    """

    def __init__(self, settings: MonitorSettings, *, max_runs: int = MAX_RUNS) -> None:
        self.settings = settings
        self.max_runs = max_runs
        self._models: dict[str | None, MonitorModel] = {}
        self._info: dict[str | None, RunInfo] = {}
        self._empty = MonitorModel(settings)  # shown before any run arrived

    @property
    def run_ids(self) -> list[str | None]:
        """Known runs, oldest first."""
        return list(self._models)

    @property
    def newest(self) -> str | None:
        """The run that arrived last (None also when there is none yet)."""
        return next(reversed(self._models), None)

    def __len__(self) -> int:
        return len(self._models)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._models

    def model(self, run_id: str | None) -> MonitorModel:
        """The run's model (an empty one for an unknown run)."""
        return self._models.get(run_id, self._empty)

    def info(self, run_id: str | None) -> RunInfo:
        return self._info.get(run_id) or RunInfo(run_id)

    def clear(self) -> None:
        """Forget every run (the replay player rebuilds the state when seeking back)."""
        self._models.clear()
        self._info.clear()

    def _run(self, run_id: str | None) -> MonitorModel:
        model = self._models.get(run_id)
        if model is None:
            model = self._models[run_id] = MonitorModel(self.settings)
            self._info[run_id] = RunInfo(run_id)
            while len(self._models) > self.max_runs:
                oldest = next(iter(self._models))
                del self._models[oldest], self._info[oldest]
        return model

    def _group(self, items: Iterable[Any]) -> dict[str | None, list[Any]]:
        # Not a dict (bad input): the newest run's model counts it as bad.
        groups: dict[str | None, list[Any]] = {}
        fallback = self.newest
        for item in items:
            key = run_of(item) if type(item) is dict else fallback
            group = groups.get(key)
            if group is None:
                group = groups[key] = []
            group.append(item)
        return groups

    def add_records(
        self, records: Iterable[Any], now: float | None, source: str | None = None
    ) -> None:
        """Route records to their runs' models (see MonitorModel.add_records)."""
        for run_id, group in self._group(records).items():
            self._run(run_id).add_records(group, now, source)
            info = self._info[run_id]
            if info.first_step is None or info.job is None:
                self._note(info, group)

    def add_columns(
        self, block: RecordColumns, now: float | None, source: str | None = None
    ) -> None:
        """Route a columnar block (protocol 1.1) to its runs' models (see
        MonitorModel.add_columns); one run per block is the usual case, else it is split."""
        run_ids = block.get("run_id") or [None] * block.n
        kinds = set(map(type, run_ids))
        if kinds <= {str, type(None)} and len(set(run_ids)) == 1:
            groups = {run_ids[0]: block}
        else:
            indexes: dict[str | None, list[int]] = {}
            for i, value in enumerate(run_ids):
                indexes.setdefault(value if type(value) is str else None, []).append(i)
            groups = {run: block.take(ix) for run, ix in indexes.items()}
        for run_id, part in groups.items():
            self._run(run_id).add_columns(part, now, source)
            info = self._info[run_id]
            # As _note does for rows: the lowest int step, the first record's job.
            if info.first_step is None:
                ints = [s for s in part.get("step") or [] if type(s) is int]
                info.first_step = min(ints) if ints else None
            if info.job is None:
                job = (part.get("job") or [None])[0]
                info.job = job if type(job) is str else None

    def set_reachable(self, source: str, reachable: bool, now: float) -> None:
        """A relay connection went down or came back: every run's ranks behind it show so
        (see MonitorModel.set_reachable)."""
        for model in self._models.values():
            model.set_reachable(source, reachable, now)

    def add_dumps(self, dumps: Iterable[Any]) -> None:
        """Route hang dumps to their runs' models (see MonitorModel.add_dumps)."""
        for run_id, group in self._group(dumps).items():
            self._run(run_id).add_dumps(group)

    def add_events(
        self, events: Iterable[Any], now: float | None = None
    ) -> dict[str | None, list[Any]]:
        """Route events to their runs' models (see MonitorModel.add_events); returns them
        grouped by run."""
        groups = self._group(events)
        for run_id, group in groups.items():
            self._run(run_id).add_events(group, now)
            info = self._info[run_id]
            for event in group:
                detail = event.get("detail") if type(event) is dict else None
                job = detail.get("job") if type(detail) is dict else None
                if info.job is None and type(job) is str:
                    info.job = job
        return groups

    @staticmethod
    def _note(info: RunInfo, records: list[Any]) -> None:
        steps = [r.get("step") for r in records if type(r) is dict]
        ints = [s for s in steps if type(s) is int]
        if info.first_step is None and ints:
            info.first_step = min(ints)
        if info.job is None:
            job = next((r.get("job") for r in records if type(r) is dict), None)
            info.job = job if type(job) is str else None

    def label(self, run_id: str | None) -> str:
        """One line for the summary bar: which run is shown, of how many, and whether it
        is a later run (a resume) of a job seen before.

        Example: `run 2/2 20261125-180212-3fa2c1 job gpt (resume, from step 5)`.
        """
        ids = self.run_ids
        index = ids.index(run_id) + 1 if run_id in self._models else 0
        info = self.info(run_id)
        text = f"run {index}/{len(ids)} {run_id or '(no run id)'}"
        if info.job is not None:
            # torchrun --standalone's rendezvous id is a 36-character uuid: keep the bar
            # readable (export has the whole name).
            job = info.job if len(info.job) <= 24 else info.job[:8] + "…"
            text += f" job {job}"
        # A resume: a later run of a job seen before, or a run that did not start at step
        # 1 (it loaded a checkpoint; without a job name that is all there is to go on).
        earlier = ids[: max(0, index - 1)]
        same_job = info.job is not None and any(self.info(r).job == info.job for r in earlier)
        later_step = info.first_step is not None and info.first_step > 1
        notes = ["resume"] if same_job or later_step else []
        if later_step:
            notes.append(f"from step {info.first_step}")
        return text + (f" ({', '.join(notes)})" if notes else "")
