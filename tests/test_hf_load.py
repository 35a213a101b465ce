"""fsdpx.hf.from_pretrained / save_pretrained on 2 gloo ranks: each rank reads only its
byte ranges, logits equal the unsharded model's, and the saved directory loads in plain
transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist import run_ranks
from tests.hf_bodies import data_bytes, header_bytes, load_and_save, sample_ids, tiny_llama

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny tied Llama saved by plain save_pretrained as one file and as a sharded index."""
    root = tmp_path_factory.mktemp("hf_src")
    model = tiny_llama()
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    with torch.no_grad():
        logits = model(sample_ids()).logits
    # The same weights stored in bf16: loaded into fp32 they equal the bf16 values exactly.
    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    model.to(torch.float32)
    with torch.no_grad():
        logits_bf16 = model(sample_ids()).logits
    model = tiny_llama()
    return {"root": root, "logits": logits, "logits_bf16": logits_bf16, "model": model}


def test_zero3_two_ranks_read_only_their_bytes_and_save_loads_in_transformers(
    saved: dict[str, Any], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    root = saved["root"]
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((root / "sharded").glob("*.safetensors"))) > 1
    out = tmp_path / "out"
    zero3 = {"zero": {"stage": 3}}
    # Third: bf16 file into fp32 parameters, cast through a staging buffer of 1000 bytes
    # (500 elements: each shard goes through in several chunks, runs cut between them).
    cast = {"dtype": "fp32", "staging_bytes": 1000}
    jobs = [
        (str(root / "single"), str(out), zero3),
        (str(root / "sharded"), None, zero3),
        (str(root / "bf16"), None, zero3, cast),
    ]
    per_rank = run_ranks(load_and_save, 2, (jobs,))
    for r in per_rank:
        assert r[2]["dtypes"] == ["torch.float32"]
        torch.testing.assert_close(r[2]["logits"], saved["logits_bf16"])
    for j, layout in enumerate(["single", "sharded"]):
        src = root / layout
        data, headers = data_bytes(src), header_bytes(src)
        results = [r[j] for r in per_rank]
        for r in results:
            torch.testing.assert_close(r["logits"], saved["logits"])
            assert r["tied"]
            assert r["info"]["missing_keys"] == [] and r["info"]["unexpected_keys"] == []
            # Headers are read by every rank; tensor bytes by the rank whose shard holds them.
            assert r["info"]["bytes_read"] - headers < 0.6 * data
        # Under ZeRO-3 every tensor is split on dim 0: together the ranks read each data
        # byte exactly once (the tied embedding is stored once), nothing twice.
        assert sum(r["info"]["bytes_read"] - headers for r in results) == data
    # The first load in each fresh rank process imported none of the modules fsdpx defers
    # to first use (checkpoint format, export, offload, 1-bit); the save after it then
    # imported what it needs.
    assert all(r[0]["deferred"] == [] for r in per_rank), [r[0]["deferred"] for r in per_rank]

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(reloaded(sample_ids()).logits, saved["logits"], rtol=0, atol=0)
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    assert not list(out.glob("*.bin"))


@pytest.mark.slow
def test_tp2_and_zero3_four_ranks_load_the_same_logits(saved: dict[str, Any]) -> None:
    """Slow twin of the ZeRO-3 test above: TP 2 (dim-1 shards: one run per row) and ZeRO-3
    at 4 ranks, from the sharded index."""
    sharded = str(saved["root"] / "sharded")
    for world, cfg in ((2, {"mesh": {"tp": 2}}), (4, {"zero": {"stage": 3}})):
        for r in run_ranks(load_and_save, world, ([(sharded, None, cfg)],)):
            torch.testing.assert_close(r[0]["logits"], saved["logits"])


@pytest.mark.slow
def test_each_rank_peak_rss_while_loading_stays_near_its_shard(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A ~335 MB model loads under ZeRO-3 on 2 ranks: each rank's peak RSS grows by its
    shard (about half) plus working memory, far below the full model; and the load path
    imports none of the modules fsdpx defers to first use (checkpoints, offload, 1-bit)."""
    from transformers import LlamaForCausalLM

    from tests.hf_bodies import big_llama_config, load_peak_rss

    src = tmp_path_factory.mktemp("big") / "model"
    model = LlamaForCausalLM(big_llama_config())
    model.save_pretrained(src)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    assert full >= 300e6
    for r in run_ranks(load_peak_rss, 2, (str(src),)):
        assert r["shard"] < 0.51 * full
        # Its shard, plus 64 MiB of interpreter / allocator working memory.
        assert r["growth"] < r["shard"] + 64 * 2**20, (r, full)
        assert r["growth"] < 0.6 * full
        assert r["deferred_imported"] == [], r["deferred_imported"]
