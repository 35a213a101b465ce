"""Bodies of the sequence-parallel parity tests: the same training through fsdpx with
mesh.sp > 1 and in one process on the whole sequences. Importable by spawned ranks."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fsdpx
import fsdpx.sequence
from fsdpx.demo.gpt import GPT, GPTConfig, shard_batch
from fsdpx.parallel_dims import ParallelDims
from tests.sp_models import TinyLlama

STEPS = 3
# SGD, not Adam: a parameter then moves by lr x its gradient, so comparing parameters
# after 3 steps compares the gradients. Adam divides by sqrt(v) and turns the last-bit
# differences of near-zero gradients (tiled MLP sums its weight gradients tile by tile)
# into full-size steps.
LR = 0.5
BATCH = 4  # sequences per step, split over the data-parallel ranks
VOCAB = 64
GPT_CFG = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)


def make_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPT_CFG)
    if kind == "gpt4":  # 4 blocks: one per stage of a 2 x 2-stage V pipeline schedule
        return GPT(dataclasses.replace(GPT_CFG, n_layer=4))
    kv = {"llama_kv2": 2, "llama_kv1": 1}[kind]
    return TinyLlama(vocab=VOCAB, dim=32, heads=4, kv_heads=kv)


def batches(kind: str, seq: int, *, pairs: bool = False) -> list[Any]:
    """STEPS global batches. gpt (or `pairs`): (x, y) with aligned targets; llama: Hugging
    Face-style {"input_ids", "labels"} (labels = inputs, shifted by shard_batch). Both carry
    -100 labels spread unevenly over the sequence shards."""
    g = torch.Generator().manual_seed(1)
    out: list[Any] = []
    for step in range(STEPS):
        x = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
        if kind.startswith("gpt") or pairs:
            y = torch.randint(0, VOCAB, (BATCH, seq), generator=g)
            y[0, : seq * 2 // 3] = -100  # all of the first shard, part of the next
            y[1, -3:] = -100  # right padding
            y[2, step::5] = -100
            out.append((x, y))
        else:
            labels = x.clone()
            labels[0, : seq * 2 // 3] = -100
            labels[3, -4:] = -100
            out.append({"input_ids": x, "labels": labels})
    return out


def _reference_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    if isinstance(batch, tuple):
        x, y = batch
        logits = model(x)
    else:
        logits = model(batch["input_ids"])[:, :-1]
        y = batch["labels"][:, 1:]
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100)


def _rows(batch: Any, r: int, dp: int) -> Any:
    if isinstance(batch, tuple):
        return tuple(shard_batch(t, r, dp) for t in batch)
    return {k: shard_batch(v, r, dp) for k, v in batch.items()}


def reference(case: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, whole sequences: the loss of each data-parallel group's rows (each
    micro-batch's, with `gas` micro-batches per rank) is its mean over valid tokens,
    gradients are the mean over the groups (what DDP with accumulation computes).
    Returns the STEPS losses (then, with case "eval", the first batch's loss after
    training) and the parameters."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model(case["model"])
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        dp = case.get("dp", 1) * case.get("gas", 1)
        losses = []
        for batch in batches(case["model"], case["seq"], pairs=case.get("pairs", False)):
            step_losses = []
            for r in range(dp):
                loss = _reference_loss(model, _rows(batch, r, dp))
                (loss / dp).backward()
                step_losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            losses.append(float(torch.stack(step_losses).mean()))
        if case.get("eval"):  # the first batch's loss after training, without gradients
            first = batches(case["model"], case["seq"], pairs=case.get("pairs", False))[0]
            with torch.no_grad():
                groups = [_reference_loss(model, _rows(first, r, dp)) for r in range(dp)]
            losses.append(float(torch.stack(groups).mean()))
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def _config(case: dict[str, Any]) -> fsdpx.Config:
    return fsdpx.Config.from_dict(
        {
            "mesh": case["mesh"],
            "gradient_accumulation_steps": case.get("gas", 1),
            **({"pipeline": case["pipeline"]} if "pipeline" in case else {}),
            "optimizer": {"type": "sgd", "lr": LR},
            "activation_checkpointing": {"mode": case.get("ac", "none")},
            "context_parallel": {
                "mode": case.get("mode", "ulysses"),
                "mlp_tile_tokens": case.get("mlp_tile", 0),
            },
        }
    )


def fsdpx_run(case: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of the training through engine.train_batch."""
    engine = fsdpx.shard(make_model(case["model"]), _config(case), loss_fn=fsdpx.sequence.loss_fn)
    dp_mesh = ParallelDims.dp_mesh(engine.mesh)
    dp, r = dp_mesh.size(), dp_mesh.get_local_rank()
    gas = case.get("gas", 1)
    losses = []
    data = batches(case["model"], case["seq"], pairs=case.get("pairs", False))

    def micro(batch: Any) -> list[Any]:
        # This rank's rows, as `gas` micro-batches (reference(): groups r*gas ... r*gas+gas-1).
        return [_rows(batch, r * gas + j, dp * gas) for j in range(gas)]

    for batch in data:
        losses.append(float(engine.train_batch(iter(micro(batch)))))
    if case.get("eval"):
        losses.append(float(engine.eval_batch(iter(micro(data[0])))))
    # Under pipeline parallelism a rank holds only its stages' parameters.
    params = {n: p.full_tensor().detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "params": params}


def sweep_body(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    del rank, world_size
    out: dict[str, Any] = {name: fsdpx_run(case) for name, case in cases.items()}
    out["user_kernel"] = user_kernel_check()
    return out


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """A user's own attention kernel (plain softmax attention), SDPA's layout."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        s = q.shape[-2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def user_kernel_check() -> dict[str, torch.Tensor]:
    """ulysses_attention around a user kernel: this rank's output rows and input gradients
    on its shard of a sequence, and the whole-sequence ones (for the test to compare)."""
    import torch.distributed as dist

    from fsdpx.sequence import ulysses_attention

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    world, rank = dist.get_world_size(), dist.get_rank()
    local = [t.chunk(world, dim=2)[rank].clone().requires_grad_() for t in (q, k, v)]
    attn = ulysses_attention(_kernel, dist.group.WORLD)
    out = attn(*local, causal=True)
    out.backward(torch.ones_like(out))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _kernel(*full, causal=True)
    ref.backward(torch.ones_like(ref))
    return {
        "out": out.detach(),
        "ref": ref.detach().chunk(world, dim=2)[rank],
        "grads": torch.stack([t.grad for t in local]),
        "ref_grads": torch.stack([t.grad.chunk(world, dim=2)[rank] for t in full]),
    }


def copy_case(case: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = copy.deepcopy(case)
    out.update(changes)
    return out
