"""`fsdpx demo | cat`: plain progress lines at exactly every N-th step (monitor/progress.py)."""

from __future__ import annotations

import re

import pytest

from monitor.progress import ProgressLines
from monitor.synthetic import SyntheticRun


def steps_of(lines: list[str]) -> list[int]:
    return [int(re.match(r"step\s+(\d+)", line).group(1)) for line in lines]  # type: ignore[union-attr]


def test_every_4_prints_4_8_12_when_batches_skip_over_a_multiple() -> None:
    """Batches as the relay forwards them: several steps at once, the 8 never newest."""
    run = SyntheticRun(n_ranks=2)
    progress = ProgressLines(every=4, steps=12)
    printed: list[str] = []
    for batch in ([1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11], [12]):
        records = [r for step in batch for r in run.records(step)]
        printed += progress.feed(records, [], now=run.time_of(batch[-1]))
    assert steps_of(printed) == [4, 8, 12]
    # Each line carries its own step's numbers, not the newest step's.
    loss_8 = sum(run.record(r, 8)["loss"] for r in range(2)) / 2
    assert f"loss {loss_8:.4f}" in printed[1]


def test_a_line_waits_for_the_slowest_rank_and_the_last_step_always_prints() -> None:
    run = SyntheticRun(n_ranks=2)
    progress = ProgressLines(every=4, steps=10)

    def feed(rank: int, steps: range) -> list[int]:
        records = [run.record(rank, s) for s in steps]
        return steps_of(progress.feed(records, [], now=run.time_of(steps[-1])))

    assert feed(0, range(1, 4)) == [] and feed(1, range(1, 4)) == []
    assert feed(0, range(4, 10)) == []  # rank 1 is at 3: step 4 is not complete yet
    assert feed(1, range(4, 7)) == [4]
    assert feed(0, range(10, 11)) == [] and feed(1, range(7, 10)) == [8]
    assert steps_of(progress.finish(now=run.time_of(11))) == [10]  # rank 1 never got there
    assert progress.finish(now=run.time_of(12)) == []


def test_bad_numbers_are_refused() -> None:
    with pytest.raises(ValueError, match="every and steps must be >= 1"):
        ProgressLines(every=0, steps=5)
