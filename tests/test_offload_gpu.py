"""Optimizer offload on a real accelerator (one CUDA device, NCCL, one rank): pinned host
buffers, the side copy stream, gradient streaming during backward, 16-bit device params.

Run with `pytest -m gpu tests/test_offload_gpu.py` on a machine with a GPU.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.cuda_host import page_locked

pytestmark = pytest.mark.gpu


def _engine(offload: dict[str, Any], dtype: str = "fp32", optimizer: Any = None) -> Any:
    import fsdpx
    from fsdpx.demo.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=256))
    cfg = fsdpx.Config.from_dict(
        {
            "device": "cuda",
            "zero": {"stage": 3, "offload_optimizer": offload},
            "optimizer": {"type": "adamw", "lr": 1e-3},
            "precision": {"param_dtype": dtype, "reduce_dtype": "fp32"},
            "gradient_clipping": 1.0,
        }
    )
    return fsdpx.shard(model, cfg, optimizer=optimizer)


def _train(engine: Any, steps: int, seed: int = 1) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, 256, (8, 64), generator=g).cuda()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _params(engine: Any) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().float().cpu() for n, p in engine.module.named_parameters()}


@pytest.fixture(autouse=True)
def _cuda() -> Iterator[None]:
    """Deterministic kernels: flash / memory-efficient attention backward accumulate with
    atomics, and early Adam steps amplify such noise, so runs would differ without offload."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    flash, mem = (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
    )
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cuda.enable_flash_sdp(flash)
    torch.backends.cuda.enable_mem_efficient_sdp(mem)


def test_cpu_and_nvme_offload_agree_bitwise_and_track_device_adam(tmp_path: Path) -> None:
    ref = _engine({"device": "none"})
    ref_losses = _train(ref, 5)
    ref_params = _params(ref)
    ref_device_bytes = torch.cuda.memory_allocated()
    del ref
    gc.collect()
    cpu = _engine({"device": "cpu"})
    cpu_losses = _train(cpu, 5)
    streamed = len(cpu.optimizer._store._streamer.copied)
    # Masters, moments, gradient copies: every host tensor of the store is pinned.
    assert all(t.is_pinned() for t in cpu.optimizer.host_tensors())
    cpu_device_bytes = torch.cuda.memory_allocated()
    assert all(
        (t.to_local() if isinstance(t, DTensor) else t).device.type == "cpu"
        for st in cpu.optimizer.state.values()
        for t in st.values()
    ), "optimizer state must live in host memory"
    cpu_params = _params(cpu)
    cpu.close()
    nvme = _engine({"device": "nvme", "nvme_path": str(tmp_path), "buffer_mb": 4})
    nvme_losses = _train(nvme, 5)
    nvme_params = _params(nvme)
    assert nvme.optimizer.host_buffer_bytes <= 4 << 20
    nvme.close()
    assert cpu_losses == nvme_losses
    assert abs(cpu_losses[-1] - ref_losses[-1]) < 1e-3
    for name, t in cpu_params.items():
        assert torch.equal(t, nvme_params[name]), name
        # torch's fused CUDA AdamW on the device: same math up to fp32 rounding.
        torch.testing.assert_close(t, ref_params[name], rtol=1e-4, atol=1e-5, msg=name)
    assert streamed > 0, "no gradient was copied to the host during backward"
    assert cpu_device_bytes < ref_device_bytes, (cpu_device_bytes, ref_device_bytes)
    assert list(tmp_path.iterdir()) == [], "close() must remove the swap file"


def test_bf16_device_params_halve_device_memory_and_checkpoint_fp32_masters(
    tmp_path: Path,
) -> None:
    torch.cuda.reset_peak_memory_stats()
    engine = _engine({"device": "cpu"}, dtype="bf16")
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}
    losses = _train(engine, 4)
    assert losses[-1] < losses[0]
    with engine.optimizer.checkpoint_view() as view:
        masters = {
            n: (m.to_local() if isinstance(m, DTensor) else m)
            for n, p in engine.module.named_parameters()
            for m in [view[id(p)]]
        }
    engine.save_checkpoint(tmp_path, tag="t")
    engine.close()
    import fsdpx

    plain = _engine({"device": "none"}, optimizer=lambda ps: fsdpx.optim.AdamW(ps, lr=1e-3))
    plain.load_checkpoint(tmp_path, tag="t")
    for n, p in plain.module.named_parameters():
        local = p.to_local().cpu()
        assert local.dtype == torch.float32
        assert torch.equal(local, masters[n].view(local.shape)), n


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_pinned_offload_buffers_take_exactly_their_size(tmp_path: Path) -> None:
    """torch's pinned allocator rounds every allocation up to a power of two; the NVMe
    buffer sets (96 MiB in 3 sets of 32 MiB + 4 KiB: 64 MiB each if rounded) must stay
    within their bound, and still be page-locked."""
    from fsdpx.offload.nvme import NvmeStore

    before = _rss()
    store = NvmeStore(
        str(tmp_path),
        rank=0,
        numel=64 << 20,
        regions=3,
        buffer_bytes=96 << 20,
        extra_dtypes={},
        pin_memory=True,
    )
    try:
        grown = _rss() - before
        assert store.host_bytes <= 96 << 20
        assert grown <= store.host_bytes + (8 << 20), (grown, store.host_bytes)
        assert page_locked(store._sets[0].regions[0])
    finally:
        store.close()
