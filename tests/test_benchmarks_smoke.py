"""The benchmarks run end to end with their smallest settings, so they cannot rot unseen.

Smoke tests only: each checks that a script exits 0 and prints its ratio line(s).
Timings are never asserted (DESIGN.md section 7: benchmarks are scripts, not timed
tests). benchmarks/telemetry.py and benchmarks/monitor_cpu.py have theirs in
test_telemetry_benchmark.py and test_monitor_bench.py. parallel3d.py needs 4 ranks
(~30 s on 2 cores): marked slow.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmark_run import NUM, ROOT
from tests.benchmark_run import line as _line
from tests.benchmark_run import run_benchmark as _run


def test_step_overhead_script_runs() -> None:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "benchmarks" / "step_overhead.py"),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--tiny",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    ratio = re.search(r"^ratio fsdpx/raw .*$", out, re.MULTILINE)
    assert ratio, out
    for stage in (0, 1, 2, 3):
        assert re.search(rf"stage{stage}=\d+\.\d+", ratio.group(0)), ratio.group(0)
    memory = re.search(r"^model-state error vs ZeRO formula .*$", out, re.MULTILINE)
    assert memory, out
    for stage in (0, 1, 2, 3):
        assert re.search(rf"stage{stage}=[+-]\d+\.\d+%", memory.group(0)), memory.group(0)
    # Both sides ran the same model on the same data: identical losses (printed, not timed).
    assert re.search(r"max\|dloss\|", out), out


@pytest.mark.slow
def test_step_overhead_compile_rows() -> None:
    """--compile adds the cfg.compile table (inductor compiles on CPU: minutes, so slow)."""
    out = _run(
        [
            "step_overhead.py",
            "--stages",
            "3",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--tiny",
            "--compile",
        ],
        2,
    )
    _line(
        rf"ratio compiled/eager \(median step time; below 1: compile pays off\): stage3={NUM}", out
    )
    assert re.search(r"^cfg\.compile step time in ms", out, re.MULTILINE), out


def test_checkpoint_script_runs(tmp_path: Path) -> None:
    out = _run(["checkpoint.py", "--params-m", "1", "--layers", "2", "--dir", str(tmp_path)], 2)
    _line(rf"ratio fsdpx/DCP: bytes={NUM} .*save_time={NUM} .*load_time={NUM} .*", out)
    _line(rf"ratio fsdpx/torch\.save: bytes={NUM} save_time={NUM}", out)
    _line(rf"ratio async blocking/sync save: first={NUM} next={NUM} .*", out)


def test_checkpoint_consolidate_script_runs(tmp_path: Path) -> None:
    out = _run(["checkpoint_consolidate.py", "--params", "2e5", "--workdir", str(tmp_path)])
    # The script compares all three outputs with the source tensors before printing this.
    _line("outputs: all three equal the source tensors bitwise", out)
    for side in ("safetensors", "torch\\.save"):
        _line(
            rf"fsdpx -> {side} / DCP: time {NUM}x, CPU {NUM}x, peak RSS {NUM}x, "
            rf"added RSS {NUM}x",
            out,
        )


def test_ops_script_runs() -> None:
    out = _run(["ops.py", "--sizes", "1e5", "--threads", "1", "--iters", "1", "--skip-build"])
    _line(
        rf"ratio step: anchor/fsdpx = {NUM}x \(goal >= 1\.0\); "
        rf"step\+bf16: fsdpx/\(anchor step, then copy\) = {NUM}x \(goal <= 0\.85\)",
        out,
    )


def test_ops_aio_script_runs(tmp_path: Path) -> None:
    args = ["--dir", str(tmp_path), "--size-mb", "8", "--chunk-mb", "1", "--repeats", "1"]
    out = _run(["ops_aio.py", *args, "--quant-mb", "1"])
    for label in (
        "write \\+ fdatasync \\(O_DIRECT\\)",
        "read, O_DIRECT both",
        "read, page cache both",
    ):
        _line(rf"{label}\s+{NUM}\s+{NUM}\s+{NUM}", out)  # aio, dd, aio/dd
    for op in (
        "quantize_int8",
        "dequantize_int8",
        "quantize_fp8",
        "dequantize_fp8",
        "quantize_int4",
        "dequantize_int4",
        "accumulate_int8",
        "accumulate_int4",
    ):
        _line(rf"{op}\s+{NUM}\s+{NUM}\s+{NUM}", out)  # native, reference, ratio


def test_offload_script_runs(tmp_path: Path) -> None:
    import json

    out = _run(["offload.py", "--quick", "--device", "cpu", "--nvme-path", str(tmp_path)])
    _line(rf"ratio fsdpx/torch-default opt-step \(goal <= 0\.7\): 1M={NUM}", out)
    _line(rf"ratio nvme-step/dd \(.*goal >= 0\.7\): {NUM}; vs dd write alone: {NUM}", out)
    summary = json.loads(out.strip().splitlines()[-1])  # the machine-readable last line
    assert summary["failed"] is False
    # --quick sets buffer_mb=1: the swapper's host buffers stay within that bound.
    assert 0 < summary["nvme"]["host_buffer_bytes"] <= 2**20, summary["nvme"]
    assert not list(tmp_path.iterdir()), "swap file or dd test file left behind"


@pytest.mark.slow
def test_parallel3d_script_runs() -> None:
    out = _run(["parallel3d.py", "--steps", "1", "--warmup", "1", "--tiny"], 4)
    layouts = ("fsdp_dp4", "dp2_tp2", "dp2_tp2_sp", "dp2_pp2_1f1b", "dp2_pp2_zbv")
    losses = []
    for name in (*layouts, "tp2_pp2_1f1b", "pp4_1f1b"):
        # name, step s, x fsdp, params/grads/optim MiB, states x fsdp, peak RSS, loss
        row = _line(rf"{name}\s+{NUM}\s+{NUM}(\s+{NUM}){{4}}\s+\d+\s+{NUM}", out)
        losses.append(float(row.split()[-1]))
    # Same GPT, seed and batches in every layout: the same loss (printed to 4 places).
    assert max(losses) - min(losses) <= 2e-3, losses


@pytest.mark.slow
def test_long_context_script_runs() -> None:
    # 4 ranks (sp 1, 2, 4): slow. Its parts run in the default tier: Ulysses and ring
    # parity (test_sequence_parallel.py, test_sequence_ring.py), the activation formula
    # (test_estimate_long_context.py).
    args = ["--seq", "128", "--budget-mib", "1", "--sweep", "128", "--steps", "1", "--dim", "32"]
    out = _run(["long_context.py", *args, "--mlp-tile", "32", "--mode", "ring"], 4)
    _line(rf"  4    32 +\d+ +{NUM} +{NUM} +\d+", out)


@pytest.mark.slow  # 4 ranks; default-tier twins: tests/test_estimate_moe.py (the formulas
# the table compares with) and the 2-rank expert-parallel tests.
def test_moe_script_runs() -> None:
    out = _run(["moe.py", "--steps", "1", "--warmup", "1", "--tiny", "--repeat", "1"], 4)
    losses = []
    layouts = ("replicated", "replicated_padded", "replicated_grouped_mm", "replicated_fused")
    for name in (*layouts, "ep2", "ep4"):
        # name, step s, x repl, state / experts / estimate MiB, gather / estimate MiB,
        # a2a / formula MiB, a2a/f (or -), loss
        row = _line(rf"{name}\s+{NUM}\s+{NUM}(\s+{NUM}){{7}}\s+({NUM}|-)\s+{NUM}", out)
        cells = row.split()
        assert cells[3] == cells[5], row  # model-state bytes: measured = estimated
        assert cells[6] == cells[7], row  # expert all-gather bytes: measured = estimated
        losses.append(float(cells[-1]))
    assert max(losses) - min(losses) <= 2e-3, losses  # same model and batches
    _line(r"(  torch\._grouped_mm .*|torch\._grouped_mm: not usable.*)", out)


HF_LOAD = (
    rf"ratio load: rss/model={NUM} \(goal <= 0\.6\) rss/fsdp2={NUM} \(goal <= 0\.5\) "
    rf"time/fsdp2={NUM} \(goal <= 1\.0\) logits max diff \S+"
)


def test_hf_benchmark_loading_runs() -> None:
    pytest.importorskip("transformers")
    out = _run(["hf.py", "--tiny", "--part", "load"])
    _line(HF_LOAD, out)


@pytest.mark.slow
def test_hf_benchmark_trainer_step_runs() -> None:
    """The Trainer part: two more 2-rank launches of transformers (the loading part above
    is its default-tier twin, the same launcher and result collection)."""
    pytest.importorskip("transformers")
    out = _run(["hf.py", "--tiny", "--part", "trainer"])
    _line(rf"ratio trainer step fsdpx/fsdp2={NUM} \(goal <= 1\.05\) last loss diff \S+", out)
