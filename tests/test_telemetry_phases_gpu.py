"""Phase times on CUDA (fsdpx/telemetry/phases.py [Note: phase spans]): forward, backward
and optimizer come from CUDA event pairs, h2d from offload's copy stream.

Run with `pytest -m gpu tests/test_telemetry_phases_gpu.py` on a machine with a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdpx.telemetry.wire.logfile import iter_log

pytestmark = pytest.mark.gpu


def test_cuda_records_carry_event_timed_phases_and_h2d(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import fsdpx
    from fsdpx.demo.gpt import GPT, GPTConfig

    log_path = tmp_path / "run.tlm"
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128))
    cfg = fsdpx.Config.from_dict(
        {
            "device": "cuda",
            "zero": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
            "optimizer": {"type": "adamw", "lr": 1e-3},
            "telemetry": {
                "enabled": True,
                "relay": str(tmp_path / "r.sock"),
                "log_path": str(log_path),
                "measure_flops": False,
            },
        }
    )
    engine = fsdpx.shard(model, cfg)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 64), generator=g) for _ in range(4)]
    for x in fsdpx.telemetry.timed_loader(batches):
        x = x.cuda()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    assert engine.telemetry is not None
    engine.telemetry.close()
    engine.close()
    records = [r for m in iter_log(log_path) if m["type"] == "records" for r in m["records"]]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        for name in ("data_wait_s", "forward_s", "backward_s", "optimizer_s", "h2d_s"):
            assert isinstance(r[name], float) and r[name] >= 0.0, (name, r[name])
        # FSDP's waits, as CUDA event pairs at its wait points (fsdpx/comm/fsdp_events.py):
        # a float even with one rank (the wait for the unshard, then its copy-out).
        comm = r["comm_wait_s"]
        assert (
            isinstance(comm, float)
            and 0.0 <= comm <= r["forward_s"] + r["backward_s"] + r["optimizer_s"]
        )
