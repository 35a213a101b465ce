"""Rank bodies and shared builders for the fsdpx.hf tests (tiny models from configs,
nothing downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 128


def tiny_llama_config(tie: bool = True) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


def tiny_llama(seed: int = 0, tie: bool = True) -> Any:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(tie)).eval()


def sample_ids(seed: int = 3, batch: int = 2, seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


# Modules the load path must not import ([Note: engine imports on first use] in
# fsdpx/engine.py, [Note: offload imports on first use], [Note: onebit on first use],
# [Note: MoE and sequence on first use] in fsdpx/parallelize.py).
DEFERRED_MODULES = (
    "checkpoint_tools",
    "fsdpx.moe",
    "fsdpx.sequence",
    "fsdpx.pipeline_parallel",
    "torch.distributed.pipelining",
    "msgpack",  # (not zstandard: transformers' own imports load it)
    "fsdpx.checkpoint",
    "fsdpx.export",
    "fsdpx.comm.onebit",
    "fsdpx.onebit_adam",
    "fsdpx.onebit_lamb",
    "fsdpx.zero_one_adam",
    "fsdpx.offload.optimizer",
    "fsdpx.offload.nvme",
)


def deferred_imported() -> list[str]:
    """The DEFERRED_MODULES this process has imported."""
    import sys

    return sorted(
        m for m in sys.modules if any(m == d or m.startswith(d + ".") for d in DEFERRED_MODULES)
    )


def load_and_save(rank: int, world_size: int, jobs: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """For each (src, out, cfg[, kwargs]): from_pretrained under cfg (with kwargs; a
    `staging_bytes` entry sets fsdpx.hf.loading.STAGING_BYTES for that load), logits of
    sample_ids, the DEFERRED_MODULES imported by then, and save_pretrained to out when
    given. One spawn for several loads (transformers imports are slow)."""
    return [_load_one(*job) for job in jobs]


def _load_one(
    src: str, out: str | None, cfg_dict: dict[str, Any], kwargs: dict[str, Any] | None = None
) -> dict[str, Any]:
    from transformers import LlamaForCausalLM

    import fsdpx
    import fsdpx.hf
    import fsdpx.hf.loading

    kwargs = dict(kwargs or {})
    staging = fsdpx.hf.loading.STAGING_BYTES
    fsdpx.hf.loading.STAGING_BYTES = kwargs.pop("staging_bytes", staging)
    try:
        engine, info = fsdpx.hf.from_pretrained(
            LlamaForCausalLM,
            src,
            fsdpx.Config.from_dict(cfg_dict),
            output_loading_info=True,
            **kwargs,
        )
    finally:
        fsdpx.hf.loading.STAGING_BYTES = staging
    engine.eval()
    with torch.no_grad():
        logits = engine(sample_ids()).logits
    if not isinstance(logits, torch.Tensor) or hasattr(logits, "full_tensor"):
        logits = logits.full_tensor()  # type: ignore[union-attr]
    deferred = deferred_imported()  # before save_pretrained, which needs fsdpx.export
    if out is not None:
        engine.save_pretrained(out)
    tied = engine.module.lm_head.weight is engine.module.model.embed_tokens.weight
    dtypes = sorted({str(p.dtype) for p in engine.module.parameters()})
    return {
        "logits": logits.detach().clone(),
        "info": info,
        "tied": tied,
        "deferred": deferred,
        "dtypes": dtypes,
    }


def data_bytes(path: Path) -> int:
    """Bytes of tensor data in a directory's safetensors files (no headers)."""
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
        total += f.stat().st_size - 8 - n
    return total


def header_bytes(path: Path) -> int:
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            total += 8 + int.from_bytes(fh.read(8), "little")
    return total


def big_llama_config() -> Any:
    """~84M parameters, ~335 MB in fp32 (tied embeddings)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def load_peak_rss(rank: int, world_size: int, src: str) -> dict[str, Any]:
    """Peak RSS growth of this rank while from_pretrained loads `src` under ZeRO-3, and
    the DEFERRED_MODULES it imported (this is a fresh spawned process)."""
    import gc

    from transformers import LlamaForCausalLM

    import fsdpx
    import fsdpx.hf

    gc.collect()
    _reset_peak()
    before = _rss_bytes()
    engine, info = fsdpx.hf.from_pretrained(
        LlamaForCausalLM,
        src,
        fsdpx.Config.from_dict({"zero": {"stage": 3}}),
        output_loading_info=True,
    )
    peak = _peak_bytes()
    shard = sum(p.to_local().numel() * p.element_size() for p in engine.module.parameters())
    imported = deferred_imported()
    return {
        "growth": peak - before,
        "shard": shard,
        "bytes_read": info["bytes_read"],
        "deferred_imported": imported,
    }
