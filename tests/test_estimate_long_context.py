"""The long-context activation estimate ([Note: activation formula] in
fsdpx/estimate_activations.py): the formula against the bytes autograd really saves for a
Llama-style model, the longest sequence at a memory budget, and `fsdpx estimate
--seq-len`."""

from __future__ import annotations

import pytest
import torch

import fsdpx.sequence as fs
from fsdpx.cli import main
from fsdpx.estimate_activations import (
    TransformerShape,
    estimate_activations,
    largest_sequence,
)
from tests.sp_models import TinyLlama

LLAMA_8B = "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256"


def _saved_bytes(model: torch.nn.Module, run: object) -> int:
    """Bytes of the tensors autograd saves while run() builds the graph (one per storage,
    parameters excluded): what the formula's blocks + loss count."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()  # type: ignore[operator]
    return sum(seen.values())


@pytest.mark.parametrize(("dim", "heads", "kv_heads", "tile"), [(64, 4, 2, 0), (96, 4, 4, 32)])
def test_formula_matches_the_bytes_autograd_saves(
    dim: int, heads: int, kv_heads: int, tile: int
) -> None:
    torch.manual_seed(0)
    vocab, seq = 256, 512
    model = TinyLlama(vocab=vocab, dim=dim, heads=heads, kv_heads=kv_heads)
    if tile:
        for block in model.blocks:
            fs.tile_mlp_(block.mlp, tile_tokens=tile)
    x, y = torch.randint(0, vocab, (1, seq)), torch.randint(0, vocab, (1, seq))

    def run() -> torch.Tensor:
        if tile:
            return fs.tiled_loss_fn(model.hidden(x), model.lm_head.weight, y, tile_tokens=tile)
        return fs.loss_fn(model(x), y)

    measured = _saved_bytes(model, run)
    shape = TransformerShape(2, dim, heads, kv_heads, 2 * dim, vocab)
    est = estimate_activations(shape, seq_len=seq, mlp_tile=tile, loss_tile=tile, dtype_bytes=4)
    # An estimate: it counts the tensors of [Note: activation formula], not small ones
    # (RMSNorm's scales, RoPE tables) or SDPA's internal GQA expansion. Seen: within 7%.
    assert abs(est.blocks + est.loss - measured) <= 0.10 * measured


def test_activations_fall_as_one_over_sp_and_the_longest_sequence_fits() -> None:
    shape = TransformerShape.parse(LLAMA_8B)
    one = estimate_activations(shape, seq_len=65536)
    four = estimate_activations(shape, seq_len=65536, sp=4)
    assert four.tokens_per_rank * 4 == one.tokens_per_rank
    assert four.total * 4 == one.total
    budget, states = 80 * 2**30, 15 * 2**30
    for kw in ({"sp": 1}, {"sp": 4, "mlp_tile": 4096, "loss_tile": 4096, "checkpointing": True}):
        longest = largest_sequence(shape, budget=budget, model_states=states, **kw)  # type: ignore[arg-type]
        step = kw["sp"]
        assert states + estimate_activations(shape, seq_len=longest, **kw).total <= budget  # type: ignore[arg-type]
        beyond = estimate_activations(shape, seq_len=longest + step, **kw)  # type: ignore[arg-type]
        assert states + beyond.total > budget
    plain = largest_sequence(shape, budget=budget, model_states=states)
    tiled = largest_sequence(
        shape, budget=budget, model_states=states, sp=4, mlp_tile=4096, loss_tile=4096
    )
    assert tiled >= 4 * plain  # the goal, by the formula
    assert largest_sequence(shape, budget=states, model_states=states) == 0


def test_estimate_cli_seq_len(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--params", "8B", "--seq-len", "262144", "--sp", "8", "--shape", LLAMA_8B]
    assert main([*argv, "--mlp-tile", "4096", "--loss-tile", "4096"]) == 0
    out = capsys.readouterr().out
    assert "ulysses over sp 8; MLP tiles 4096, loss tiles 4096" in out
    assert "seq 262144: 32768 tokens per rank, activations " in out
    assert "largest sequence in 80.0 GiB per rank (these settings): " in out
    assert "largest sequence in 80.0 GiB per rank (untiled): " in out
    assert main([*argv, "--cp-mode", "ring", "--device-memory", "40"]) == 0
    assert "ring over sp 8" in capsys.readouterr().out
    assert main(argv[:7]) == 2
    assert "--seq-len needs the decoder's shape for its activations: add --shape" in (
        capsys.readouterr().err
    )
    assert main(["estimate", "--params", "8B", "--sp", "8"]) == 2
    assert "describe a long-context estimate; add --seq-len N" in capsys.readouterr().err
    assert main([*argv[:8], "layers=32,hidden=4096"]) == 2
    assert "--shape is missing heads, kv_heads, ffn, vocab" in capsys.readouterr().err
    assert main([*argv[:8], "layers=x"]) == 2
    assert "got 'layers=x'" in capsys.readouterr().err


def test_shape_errors() -> None:
    with pytest.raises(ValueError, match=r"heads dividing hidden and kv_heads dividing heads"):
        TransformerShape.parse("layers=1,hidden=10,heads=4,kv_heads=4,ffn=8,vocab=8")
