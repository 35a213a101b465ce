"""examples/hf/trainer_causal_lm.py run as a user runs it (torchrun, 2 ranks). Slow: it
launches torchrun; tests/test_hf_trainer.py is its default-tier twin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_trainer_example_trains_saves_and_reloads(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [
        str(torchrun),
        "--standalone",
        "--nproc_per_node=2",
        str(ROOT / "examples" / "hf" / "trainer_causal_lm.py"),
        "--steps",
        "10",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "reloaded logits match: True" in out
    assert (tmp_path / "checkpoint-10" / "fsdpx" / "latest").is_file()
    assert (tmp_path / "final" / "config.json").is_file()
