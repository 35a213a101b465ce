"""fsdpx.blocks.find_blocks and fsdpx.activation_checkpoint on the example GPT, single
process: which modules are blocks, and that checkpointing changes memory, not math."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from fsdpx.activation_checkpoint import _save_matmuls, apply_activation_checkpointing
from fsdpx.blocks import find_blocks
from fsdpx.config import ActivationCheckpointConfig
from fsdpx.demo.gpt import GPT, GPTConfig

TINY = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, n_embd=32)


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    # The model is tiny: intra-op threads only add contention when test processes share cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- find_blocks ------------------------------------------------------------------------


def _gpt(config: GPTConfig = TINY, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def _same(got: Sequence[Any], want: Sequence[Any]) -> bool:
    """Same modules (identity), same order."""
    return len(got) == len(want) and all(g is w for g, w in zip(got, want, strict=True))


def test_gpt_blocks_in_order() -> None:
    gpt = _gpt()
    assert _same(find_blocks(gpt), list(gpt.blocks))


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.stages = nn.ModuleList(Inner() for _ in range(2))
        self.heads = nn.ModuleList([nn.Linear(4, 4), nn.ReLU()])  # mixed classes: no blocks


def test_nested_module_lists_outermost_only() -> None:
    model = Nested()
    assert _same(find_blocks(model), list(model.stages))


def test_model_that_is_a_sequential_of_blocks() -> None:
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    assert _same(find_blocks(model), list(model))


@pytest.mark.parametrize(
    "model",
    [
        nn.Linear(4, 4),
        nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)),  # mixed classes
        nn.ModuleList([nn.Linear(4, 4)]),  # one child is not a repetition
        GPT(GPTConfig(vocab_size=8, block_size=4, n_layer=1, n_head=1, n_embd=4)),
    ],
    ids=["linear", "mixed", "single", "gpt_one_layer"],
)
def test_no_repeated_blocks(model: nn.Module) -> None:
    assert find_blocks(model) == []


def test_class_names() -> None:
    gpt = _gpt()
    assert _same(find_blocks(gpt, ("MLP",)), [b.mlp for b in gpt.blocks])
    # Module order, not the order of class_names.
    both = [m for b in gpt.blocks for m in (b.attn, b.mlp)]
    assert _same(find_blocks(gpt, ("MLP", "CausalSelfAttention")), both)
    # Outermost only: MLPs inside the chosen Blocks are sharded with them.
    assert _same(find_blocks(gpt, ("Block", "MLP")), list(gpt.blocks))


GPT_CLASSES = (
    "Block, CausalSelfAttention, Dropout, Embedding, GELU, LayerNorm, Linear, MLP, ModuleList"
)


@pytest.mark.parametrize(
    ("names", "missing"),
    [
        (("Blok",), "['Blok']"),
        (("Block", "Typo"), "['Typo']"),  # one good name does not hide a typo
        (("GPT",), "['GPT']"),  # the model itself is never one of its blocks
    ],
)
def test_class_names_matching_nothing(names: tuple[str, ...], missing: str) -> None:
    with pytest.raises(ValueError) as info:
        find_blocks(_gpt(), names)
    assert str(info.value) == (
        f"zero.block_classes {missing} matched no submodule of GPT; classes present: " + GPT_CLASSES
    )


def test_class_names_as_a_bare_string() -> None:
    with pytest.raises(
        ValueError,
        match=r"^class_names must be a tuple of class names; got the string 'Block'\. "
        r"Pass \('Block',\)\.$",
    ):
        find_blocks(_gpt(), "Block")  # type: ignore[arg-type]


# --- activation checkpointing -----------------------------------------------------------


def _ac(mode: str, every_n: int = 2) -> ActivationCheckpointConfig:
    return ActivationCheckpointConfig(mode, every_n=every_n if mode == "every_n" else 2)  # type: ignore[arg-type]


class OpCounter(TorchDispatchMode):
    """Counts the aten ops that actually run (ops served from a selective-checkpoint cache
    never reach this mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _count(calls: list[int], i: int, *_: Any) -> None:
    calls[i] += 1


def _step(
    mode: str, every_n: int = 2, config: GPTConfig = TINY
) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[int], Counter[str]]:
    """One forward/backward; returns the loss, the gradients, how often each block's forward
    ran, and the ops that ran during backward."""
    gpt = _gpt(config)
    chosen = apply_activation_checkpointing(list(gpt.blocks), _ac(mode, every_n))
    assert all(any(b is c for b in gpt.blocks) for c in chosen)
    calls = [0] * len(gpt.blocks)
    for i, block in enumerate(gpt.blocks):
        block.register_forward_pre_hook(partial(_count, calls, i))
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, config.vocab_size, (2, config.block_size), generator=g) for _ in "xy")
    torch.manual_seed(2)  # dropout masks: recomputation must replay the same ones
    loss = gpt(x, y)
    with OpCounter() as bw:
        loss.backward()
    grads = {n: p.grad for n, p in gpt.named_parameters() if p.grad is not None}
    assert len(grads) == len(list(gpt.parameters()))
    return loss.detach(), grads, calls, bw.ops


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize(("mode", "every_n"), [("full", 2), ("every_n", 2), ("every_n", 3), ("selective", 2)])  # fmt: skip
def test_checkpointing_keeps_loss_and_grads_bitwise(
    mode: str, every_n: int, dropout: float
) -> None:
    config = dataclasses.replace(TINY, dropout=dropout)
    ref_loss, ref_grads, ref_calls, _ = _step("none", config=config)
    loss, grads, calls, _ = _step(mode, every_n, config=config)
    assert ref_calls == [1, 1, 1, 1]
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        assert torch.equal(grads[name], ref), name
    # A checkpointed block's forward runs again in backward.
    want = [2, 2, 2, 2] if mode != "every_n" else [2 if i % every_n == 0 else 1 for i in range(4)]
    assert calls == want


@pytest.mark.parametrize(
    ("mode", "every_n", "indices"),
    [("none", 2, []), ("full", 2, [0, 1, 2, 3, 4]), ("selective", 2, [0, 1, 2, 3, 4]),
     ("every_n", 1, [0, 1, 2, 3, 4]), ("every_n", 2, [0, 2, 4]), ("every_n", 3, [0, 3]),
     ("every_n", 9, [0])],
)  # fmt: skip
def test_which_blocks_are_checkpointed(mode: str, every_n: int, indices: list[int]) -> None:
    blocks = [nn.Linear(2, 2) for _ in range(5)]
    chosen = apply_activation_checkpointing(blocks, _ac(mode, every_n))
    assert _same(chosen, [blocks[i] for i in indices])


def test_selective_saves_matmuls_and_attention_recomputes_the_rest() -> None:
    # Counts of forward ops run during backward, i.e. recomputed. dropout 0 so that CPU
    # SDPA runs its fused kernel (_scaled_dot_product_flash_attention_for_cpu).
    fwd = ("aten.addmm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default")
    cheap = ("aten.gelu.default", "aten.native_layer_norm.default")
    none, full, sel = (_step(mode)[3] for mode in ("none", "full", "selective"))
    n = TINY.n_layer
    assert [none[op] for op in fwd + cheap] == [0, 0, 0, 0]
    assert full[fwd[0]] > 0 and full[fwd[1]] == n and full[cheap[0]] == n
    assert [sel[op] for op in fwd] == [0, 0]  # served from the selective cache
    assert sel[cheap[0]] == n and sel[cheap[1]] == 2 * n  # recomputed


@pytest.mark.parametrize(
    "op",
    [
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
    ],
)
def test_selective_policy_saves(op: Any) -> None:
    assert _save_matmuls(None, op) is CheckpointPolicy.MUST_SAVE


@pytest.mark.parametrize(
    "op", [torch.ops.aten.gelu.default, torch.ops.aten.native_layer_norm.default]
)
def test_selective_policy_recomputes(op: Any) -> None:
    assert _save_matmuls(None, op) is CheckpointPolicy.PREFER_RECOMPUTE


@pytest.mark.parametrize("mode", ["full", "every_n", "selective"])
def test_checkpointing_without_blocks_is_an_error(mode: str) -> None:
    with pytest.raises(
        ValueError,
        match=rf"^activation_checkpointing\.mode is '{mode}' but the model has no blocks to "
        r"checkpoint .*; name the block classes in zero\.block_classes, or set the mode to 'none'$",
    ):
        apply_activation_checkpointing([], _ac(mode))
    assert apply_activation_checkpointing([], _ac("none")) == []
