"""scripts/check_cuda_build.sh compiles every CUDA source against the CUDA build of torch.

Slow (creates a multi-GB side venv once, then several minutes of nvcc on 2 cores) and needs
the CUDA toolkit and the torch==2.14.1 CUDA wheel on local disk, so it is marked slow and
skips where there is no nvcc. It needs no GPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_cuda_sources_compile() -> None:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    if not (Path(cuda_home) / "bin" / "nvcc").exists() and shutil.which("nvcc") is None:
        pytest.skip(f"no nvcc under {cuda_home} or on PATH")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_cuda_build.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert re.search(r"check_cuda_build: OK, compiled \d+ sources in [\d.]+ s", out), out[-3000:]
    with_kernel = re.search(r"ops with a CUDA kernel: (.*)", out)
    assert with_kernel, out[-3000:]
    for op in (
        "quantize_int8",
        "dequantize_int8",
        "quantize_fp8",
        "dequantize_fp8",
        "quantize_int4",
        "dequantize_int4",
        "dequantize_accumulate_int8",
        "dequantize_accumulate_int4",
    ):
        assert f"fsdpx::{op}" in with_kernel.group(1).split()
