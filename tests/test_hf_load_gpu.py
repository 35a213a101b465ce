"""fsdpx.hf.from_pretrained onto a CUDA device (one rank, NCCL): every tensor goes through
the bounded staging buffer and a host-to-device copy per chunk ([Note: staging buffer]).

Run with `pytest -m gpu tests/test_hf_load_gpu.py` on a machine with a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.hf_bodies import sample_ids, tiny_llama

pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu


def test_loads_onto_cuda_through_small_staging_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import LlamaForCausalLM

    import fsdpx
    import fsdpx.hf
    import fsdpx.hf.loading

    model = tiny_llama()
    model.save_pretrained(tmp_path / "fp32")
    with torch.no_grad():
        want = {"fp32": model(sample_ids()).logits}
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model.to(torch.float32)  # the bf16-rounded weights, back in fp32
    with torch.no_grad():
        want["bf16"] = model(sample_ids()).logits
    # 1000 bytes: every shard goes through several chunks, runs cut between them.
    monkeypatch.setattr(fsdpx.hf.loading, "STAGING_BYTES", 1000)
    cfg = fsdpx.Config.from_dict({"device": "cuda", "zero": {"stage": 3}})
    for name, dtype in (("bf16", "fp32"), ("fp32", None)):
        engine = fsdpx.hf.from_pretrained(LlamaForCausalLM, tmp_path / name, cfg, dtype=dtype)
        engine.eval()
        assert all(p.device.type == "cuda" for p in engine.module.parameters())
        assert all(p.dtype == torch.float32 for p in engine.module.parameters())
        with torch.no_grad():
            logits = engine(sample_ids().cuda()).logits
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        torch.testing.assert_close(logits.cpu(), want[name], rtol=1e-4, atol=1e-4)
