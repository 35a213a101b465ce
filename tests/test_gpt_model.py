"""The example GPT model and its data helpers (fsdpx/demo/gpt.py), single process on CPU."""

from __future__ import annotations

import math
from itertools import islice

import pytest
import torch

from fsdpx.demo.gpt import GPT, Block, GPTConfig, batches, generate, shard_batch, stdlib_corpus

SMALL = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32)


def _model(seed: int = 0, config: GPTConfig = SMALL) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def _blocks(model: GPT) -> list[Block]:
    blocks = [b for b in model.blocks if isinstance(b, Block)]
    assert len(blocks) == len(model.blocks)
    return blocks


def test_forward_shapes() -> None:
    model = _model()
    idx = torch.randint(0, SMALL.vocab_size, (3, 17))
    assert model(idx).shape == (3, 17, SMALL.vocab_size)
    loss = model(idx, idx)
    assert loss.shape == ()


def test_initial_loss_is_near_uniform() -> None:
    model = _model()
    idx = torch.randint(0, SMALL.vocab_size, (4, SMALL.block_size))
    loss = model(idx, torch.randint(0, SMALL.vocab_size, idx.shape))
    assert torch.isfinite(loss)
    assert abs(loss.item() - math.log(SMALL.vocab_size)) < 0.1


def test_attention_is_causal() -> None:
    model = _model()
    idx = torch.randint(0, SMALL.vocab_size, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % SMALL.vocab_size
    before, after = model(idx), model(changed)
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=0, atol=0)
    assert not torch.equal(before[:, 10:], after[:, 10:])


def test_sequence_longer_than_block_size_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"sequence length 33 exceeds block_size 32"):
        _model()(torch.zeros(1, 33, dtype=torch.long))


def test_meta_build_then_reset_equals_direct_build() -> None:
    direct = _model(seed=123)
    with torch.device("meta"):
        lazy = GPT(SMALL)
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(123)
    lazy.reset_parameters()
    direct_state, lazy_state = direct.state_dict(), lazy.state_dict()
    assert direct_state.keys() == lazy_state.keys()
    for name, tensor in direct_state.items():
        assert torch.equal(tensor, lazy_state[name]), name


def test_reset_parameters_covers_every_parameter() -> None:
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.reset_parameters()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name


def test_residual_projections_use_scaled_init() -> None:
    config = GPTConfig(n_layer=8)
    model = _model(config=config)
    expected = 0.02 / math.sqrt(2 * config.n_layer)
    for block in _blocks(model):
        assert block.attn.o_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
        assert block.mlp.down_proj.weight.std().item() == pytest.approx(expected, rel=0.05)
        assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_fewer_local_heads_follow_q_proj_width() -> None:
    # What tensor parallelism leaves on one rank: half the heads in q/k/v, half of o_proj's input.
    attn = _blocks(_model())[0].attn
    half = SMALL.n_embd // 2
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        proj.weight = torch.nn.Parameter(proj.weight[:half])
        assert proj.bias is not None
        proj.bias = torch.nn.Parameter(proj.bias[:half])
    attn.o_proj.weight = torch.nn.Parameter(attn.o_proj.weight[:, :half])
    assert attn(torch.randn(2, 8, SMALL.n_embd)).shape == (2, 8, SMALL.n_embd)


def test_generate_appends_tokens() -> None:
    model = _model().eval()
    prompt = torch.zeros(2, 3, dtype=torch.long)
    out = generate(model, prompt, 40, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 43)  # longer than block_size: the context is cropped
    assert torch.equal(out[:, :3], prompt)
    again = generate(model, prompt, 40, top_k=5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_stdlib_corpus_is_deterministic_and_non_empty() -> None:
    first, second = stdlib_corpus(50_000), stdlib_corpus(50_000)
    assert first.dtype == torch.uint8
    assert first.numel() == 50_000
    assert torch.equal(first, second)
    assert torch.equal(stdlib_corpus(1_000), first[:1_000])


def test_batches_are_deterministic_and_shifted() -> None:
    data = stdlib_corpus(20_000)

    def take(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        it = batches(data, 4, 16, generator=torch.Generator().manual_seed(seed))
        return list(islice(it, 3))

    first, again, other = take(0), take(0), take(1)
    for (x, y), (x2, y2) in zip(first, again, strict=True):
        assert x.shape == y.shape == (4, 16)
        assert x.dtype == y.dtype == torch.int64
        assert torch.equal(x, x2) and torch.equal(y, y2)
        assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(first[0][0], other[0][0])


def test_batches_need_more_data_than_block_size() -> None:
    with pytest.raises(ValueError, match=r"data has 16 tokens but block_size 16 needs at least 17"):
        next(batches(torch.zeros(16, dtype=torch.uint8), 2, 16, generator=torch.Generator()))


def test_shard_batch_splits_contiguously() -> None:
    x = torch.arange(12).view(6, 2)
    shards = [shard_batch(x, rank, 3) for rank in range(3)]
    assert torch.equal(torch.cat(shards), x)
    assert shards[1].tolist() == [[4, 5], [6, 7]]


def test_shard_batch_rejects_uneven_split() -> None:
    with pytest.raises(ValueError, match=r"global batch size 6 is not divisible by world_size 4"):
        shard_batch(torch.zeros(6), 0, 4)
    with pytest.raises(ValueError, match=r"rank=4 and world_size=4"):
        shard_batch(torch.zeros(8), 4, 4)
