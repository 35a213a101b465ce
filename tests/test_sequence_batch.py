"""fsdpx.sequence without a process group: batch sharding ([Note: pre-shifted labels]), the
head checks of Ulysses, and the settings mesh.sp refuses before any collective."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdpx.config import Config
from fsdpx.parallel_dims import ParallelDims
from fsdpx.sequence import loss_fn, shard_sequence
from fsdpx.sequence.plan import check_sequence_config
from fsdpx.sequence.ulysses import check_heads


def test_dict_batch_labels_are_shifted_before_the_split() -> None:
    ids = torch.arange(8).view(1, 8)
    shards = [shard_sequence({"input_ids": ids, "labels": ids}, rank=r, size=2) for r in (0, 1)]
    assert shards[0]["input_ids"].tolist() == [[0, 1, 2, 3]]
    assert shards[1]["input_ids"].tolist() == [[4, 5, 6, 7]]
    # Token 3's target (4) lives on rank 1's side of the split: it is kept on rank 0.
    assert shards[0]["shift_labels"].tolist() == [[1, 2, 3, 4]]
    assert shards[1]["shift_labels"].tolist() == [[5, 6, 7, -100]]
    assert shards[1]["labels"] is shards[1]["shift_labels"]
    assert shards[1]["position_ids"].tolist() == [[4, 5, 6, 7]]
    assert all(int(s["num_items_in_batch"]) == 7 for s in shards)


def test_tuple_batch_pads_with_a_warning_and_counts_only_real_targets() -> None:
    x = torch.arange(10).view(2, 5)
    y = x + 100
    y[0, 0] = -100
    with pytest.warns(
        UserWarning,
        match=r"^sequence length 5 is not divisible by mesh\.sp = 2: padded to 6 \(inputs with "
        r"the pad token, labels with -100\)$",
    ):
        last = shard_sequence((x, y), rank=1, size=2)
    assert last["input"].tolist() == [[3, 4, 0], [8, 9, 0]]
    assert last["target"].tolist() == [[103, 104, -100], [108, 109, -100]]
    assert last["position_ids"].tolist() == [[3, 4, 5], [3, 4, 5]]
    assert int(last["num_items_in_batch"]) == 9


def test_shares_of_the_loss_add_up_to_the_whole_sequence_mean() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 8, 11)
    y = torch.randint(0, 11, (2, 8))
    y[0, :5] = -100  # uneven: rank 0 has 3 + 4 valid targets, rank 1 has 8
    whole = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
    shares = []
    for r in (0, 1):
        s = shard_sequence((torch.zeros_like(y), y), rank=r, size=2)
        shares.append(
            loss_fn(logits.chunk(2, 1)[r], s["target"], num_items_in_batch=s["num_items_in_batch"])
        )
    torch.testing.assert_close(shares[0] + shares[1], whole)


def test_bad_batches_are_refused() -> None:
    ids = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(
        ValueError,
        match=r"^sequence length 5 is not divisible by mesh\.sp = 2; pad the batch to a "
        r"multiple of 2 \(e\.g\. 6\), or set context_parallel\.pad true$",
    ):
        shard_sequence({"input_ids": ids}, rank=0, size=2, pad=False)
    mask = torch.ones(1, 6)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match=r"attention_mask with zeros; under sequence parallel"):
        shard_sequence({"input_ids": torch.zeros(1, 6), "attention_mask": mask}, rank=0, size=2)
    with pytest.raises(ValueError, match=r"needs 'input_ids' or 'inputs_embeds'"):
        shard_sequence({"x": ids}, rank=0, size=2)


def test_ring_layout_takes_head_and_tail_chunks() -> None:
    # [Note: load-balanced ring]: 2 x sp chunks, rank r holds chunks r and 2sp - 1 - r.
    ids = torch.arange(8).view(1, 8)
    shards = [
        shard_sequence({"input_ids": ids, "labels": ids}, rank=r, size=2, balanced=True)
        for r in (0, 1)
    ]
    assert shards[0]["input_ids"].tolist() == [[0, 1, 6, 7]]
    assert shards[1]["input_ids"].tolist() == [[2, 3, 4, 5]]
    assert shards[0]["position_ids"].tolist() == [[0, 1, 6, 7]]
    assert shards[0]["shift_labels"].tolist() == [[1, 2, 7, -100]]
    assert shards[1]["shift_labels"].tolist() == [[3, 4, 5, 6]]
    with pytest.warns(UserWarning, match=r"padded to 8"):
        padded = shard_sequence((ids[:, :6], ids[:, :6]), rank=0, size=2, balanced=True)
    assert padded["input"].tolist() == [[0, 1, 0, 0]]
    assert padded["target"].tolist() == [[0, 1, -100, -100]]
    assert padded["position_ids"].tolist() == [[0, 1, 6, 7]]
    with pytest.raises(
        ValueError,
        match=r"^sequence length 6 is not divisible by 2 x mesh\.sp = 4 \(ring attention's "
        r"load-balanced layout\); pad the batch to a multiple of 4 \(e\.g\. 8\)",
    ):
        shard_sequence({"input_ids": ids[:, :6]}, rank=0, size=2, pad=False, balanced=True)


def test_ring_sdpa_refuses_what_it_cannot_compute() -> None:
    import torch.nn.functional as F

    from fsdpx.sequence.ring import RingSDPA, ring_attention

    q = torch.zeros(1, 2, 4, 8)
    # The refusals come before any communication, so no process group is needed.
    group: Any = None
    with (
        RingSDPA(group),
        pytest.raises(ValueError, match=r"got an explicit attn_mask under ring attention"),
    ):
        F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    with (
        RingSDPA(group),
        pytest.raises(
            ValueError,
            match=r"got dropout_p=0\.1 under ring attention .* set the model's attention",
        ),
    ):
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with (
        RingSDPA(group),
        pytest.raises(
            ValueError, match=r"2 query heads and 1 key/value heads without enable_gqa=True"
        ),
    ):
        F.scaled_dot_product_attention(q, q[:, :1], q[:, :1])
    with pytest.raises(ValueError, match=r"with k/v heads dividing q heads; got q\.shape="):
        ring_attention(q, q[:, :, :2], q, group)


def test_heads_sp_cannot_split() -> None:
    check_heads(8, 2, 4)  # kv heads repeated to 4
    check_heads(8, 8, 4)
    with pytest.raises(
        ValueError, match=r"mesh\.sp = 4 ranks whole attention heads, but the model has 6 query"
    ):
        check_heads(6, 6, 4)
    with pytest.raises(ValueError, match=r"the model has 3 key/value heads"):
        check_heads(12, 3, 4)


def _dims(cfg: Config, world: int) -> ParallelDims:
    return ParallelDims.from_config(cfg.mesh, world)


def test_settings_sp_refuses() -> None:
    # Ring mode runs on CPU (tests/test_sequence_ring.py); its settings pass the checks.
    ring = Config.from_dict({"mesh": {"sp": 2}, "context_parallel": {"mode": "ring"}})
    check_sequence_config(ring, _dims(ring, 2), loss_fn=None)
    stage0 = Config.from_dict({"mesh": {"sp": 2}, "zero": {"stage": 0}})
    with pytest.raises(ValueError, match=r"so it needs zero\.stage 1, 2 or 3; got stage 0"):
        check_sequence_config(stage0, _dims(stage0, 2), loss_fn=None)
    # sp with pipeline parallelism runs (tests/test_sequence_pipeline.py).
    pp = Config.from_dict({"mesh": {"sp": 2, "pp": 2}})
    check_sequence_config(pp, _dims(pp, 4), loss_fn=loss_fn)

    def plain(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return out.sum()

    sp = Config.from_dict({"mesh": {"sp": 2}})
    with pytest.raises(ValueError, match=r"plain takes no num_items_in_batch\. Pass fsdpx\.shard"):
        check_sequence_config(sp, _dims(sp, 2), loss_fn=plain)
    check_sequence_config(sp, _dims(sp, 2), loss_fn=loss_fn)


def test_context_parallel_config_is_strict() -> None:
    with pytest.raises(
        ValueError, match=r"'context_parallel\.mlp_tile_tokens' must be an integer >= 0"
    ):
        Config.from_dict({"context_parallel": {"mlp_tile_tokens": -1}})
    with pytest.raises(ValueError, match=r"mesh\.sp"):
        Config.from_dict({"mesh": {"sp": 0}})
    with pytest.raises(ValueError, match=r"context_parallel\.mode"):
        Config.from_dict({"context_parallel": {"mode": "zigzag"}})


def test_sequence_is_reachable_from_a_bare_import() -> None:
    import subprocess
    import sys

    code = "import fsdpx; print(fsdpx.sequence.loss_fn.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "loss_fn"


def test_hf_ring_attention_refuses_what_only_the_models_kernel_can_do() -> None:
    from fsdpx.hf.ring import ring_hf_attention

    q = torch.zeros(1, 2, 4, 8)
    attention = ring_hf_attention(None)  # type: ignore[arg-type]  # refused before any comm
    module = torch.nn.Module()
    with pytest.raises(ValueError, match=r"got an attention mask under ring attention"):
        attention(module, q, q, q, torch.ones(1, 1, 4, 4))
    with pytest.raises(
        ValueError,
        match=r"this model's attention asks for \{'sliding_window': 16, 'dropout': 0\.1\}\. "
        r"Use context_parallel\.mode 'ulysses'",
    ):
        attention(module, q, q, q, None, dropout=0.1, sliding_window=16)
