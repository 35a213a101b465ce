"""The import streams: peak memory is bounded by one DeepSpeed partition file plus the
output's chunk buffers, never the model (checkpoint_tools/DEEPSPEED.md)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "deepspeed_synthetic", ROOT / "benchmarks" / "deepspeed_synthetic.py"
)
assert _spec is not None and _spec.loader is not None
synthetic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(synthetic)

# Runs the import in a fresh interpreter; prints its resident set before the import and
# the peak (high-water mark) after it.
_MEASURE = """
import json, sys
def status(key):
    with open('/proc/self/status') as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ':'))
def rss_now():
    # Reset the high-water mark to the current resident set (Linux clear_refs 5): the
    # imports before may have peaked higher than what stays resident.
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')
    return status('VmRSS')
import torch
from checkpoint_tools.deepspeed import import_deepspeed
from checkpoint_tools.format import CheckpointReader
torch.set_num_threads(1)
before = rss_now()
import_deepspeed(sys.argv[1], sys.argv[2], threads=THREADS)
after = status('VmHWM')
print(json.dumps({"before": before, "after": after}))
"""

THREADS = 1
"""The writer's encode threads in the measured import (the default is one per core)."""
CHUNK_BUFFERS = 2 * THREADS * (12 << 20) + (4 << 20)
"""The writer's in-flight window ([Note: deferred pieces]): 2 x threads chunks, each
holding up to 4 MiB of source pages, its 4 MiB shuffled copy and its zstd frame, plus
one more scratch buffer and the zstd context."""


def _peak_growth(tmp_path: Path, numel: int, world: int) -> tuple[int, int, int]:
    ds = tmp_path / "ds"
    tag = synthetic.make_zero2_checkpoint(ds, numel=numel, world=world)
    sizes = [p.stat().st_size for p in tag.glob("*_optim_states.pt")]
    proc = subprocess.run(
        [sys.executable, "-c", f"THREADS = {THREADS}\n" + _MEASURE, str(ds), str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        check=True,
    )
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    return rss["after"] - rss["before"], max(sizes), sum(sizes)


def test_peak_memory_is_one_partition_file_not_the_model(tmp_path: Path) -> None:
    # 8 files of ~12.6 MB: holding the model would take 100 MB.
    growth, largest, total = _peak_growth(tmp_path, numel=8 * 1024 * 1024, world=8)
    assert growth < 1.2 * largest + CHUNK_BUFFERS, (growth, largest)
    assert growth < total / 2, (growth, total)


@pytest.mark.slow
def test_peak_memory_of_a_500mb_zero2_import(tmp_path: Path) -> None:
    # 2 ranks x 3 fp32 vectors of ~22M elements: two ~260 MB files.
    growth, largest, total = _peak_growth(tmp_path, numel=44 * 1024 * 1024, world=2)
    assert total >= 500 * 10**6
    assert growth < 1.2 * largest, (growth, largest)
    print(f"peak RSS growth {growth / 2**20:.0f} MiB, largest file {largest / 2**20:.0f} MiB")


@pytest.mark.slow
def test_benchmark_script_runs() -> None:
    # benchmarks/deepspeed_import.py at its smallest (no DeepSpeed here: column skipped).
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "deepspeed_import.py"), "--numel", "1000000"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    assert "fsdpx-ckpt import-deepspeed (zstd):" in proc.stdout
    assert "zero_to_fp32: skipped" in proc.stdout
