"""The demo's training (`python -m fsdpx.demo.train`, fsdpx/demo/train.py) runs end to end
(one process, a few steps, a --config file) and leaves an export that loads into the plain
model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpx.demo.gpt import GPT, GPTConfig
from fsdpx.telemetry.wire.logfile import iter_log


def test_train_gpt_smoke(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    cfg = tmp_path / "cfg.json"
    cfg.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 1.0,
                "zero": {"stage": 2},
            }
        )
    )
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, "-m", "fsdpx.demo.train", "--steps", "2", "--config", str(cfg)]
        + ["--out", str(out), "--log-every", "1", "--eval-every", "1", "--sample-tokens", "8"]
        + ["--telemetry", str(tmp_path / "run.tlm")],
        cwd=tmp_path,  # the module comes from the installed package, not this tree
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ZeRO stage 2" in result.stdout
    assert "step    2 | loss" in result.stdout
    assert "val loss" in result.stdout
    assert len((out / "sample.txt").read_bytes()) >= len("def ")
    # The publisher is closed before the demo's os._exit: its log ends with the rank's
    # "exit" event, so a monitor shows the rank finished, not gone quiet.
    events = [e for m in iter_log(tmp_path / "run.tlm") for e in m.get("events", [])]
    assert [(e["kind"], e["detail"]["reason"]) for e in events if e["kind"] == "exit"] == [
        ("exit", "closed")
    ]
    model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128))
    model.load_state_dict(safetensors_torch.load_file(out / "model.safetensors"), strict=True)
