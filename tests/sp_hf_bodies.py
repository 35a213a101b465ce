"""Bodies of the Hugging Face sequence-parallel tests (transformers models built from a
config): fsdpx with mesh.sp > 1 against the unparallelised model. Importable by ranks."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import fsdpx
import fsdpx.sequence

SEQ = 12
VOCAB = 64
LR = 0.5  # SGD: parameters after the steps compare gradients (see tests/sp_bodies.py)


def make_model(kind: str) -> Any:
    import transformers

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "use_cache": False,
    }
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    config = transformers.Qwen2Config(**{**common, "num_key_value_heads": 1})
    return transformers.Qwen2ForCausalLM._from_config(config, attn_implementation="sdpa")


def batch(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = ids.clone()
    labels[0, : SEQ * 2 // 3] = -100  # the whole first shard and part of the second
    labels[1, -2:] = -100
    return {"input_ids": ids, "labels": labels}


def reference(kind: str, steps: int) -> dict[str, Any]:
    """The unparallelised model: logits and loss of batch(0), then SGD steps."""
    model = make_model(kind)
    out = model(**batch(0))
    result: dict[str, Any] = {"logits": out.logits.detach(), "loss": out.loss.detach()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = model(**batch(step)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    result["losses"] = losses
    result["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return result


def sweep_body(rank: int, world_size: int, kinds: list[str], steps: int) -> dict[str, Any]:
    """kinds: "llama" / "qwen2" under Ulysses, "llama+ring" under ring attention."""
    del rank
    return {kind: _sp_run(world_size, kind, steps) for kind in kinds}


def _sp_run(world_size: int, kind: str, steps: int) -> dict[str, Any]:
    model_kind, _, mode = kind.partition("+")
    cfg = fsdpx.Config.from_dict(
        {
            "mesh": {"sp": world_size},
            "optimizer": {"type": "sgd", "lr": LR},
            "context_parallel": {"mode": mode or "ulysses"},
        }
    )
    engine = fsdpx.shard(make_model(model_kind), cfg)
    implementation = engine.module.config._attn_implementation
    # Your own loop: shard_batch, then the model's own .loss is this rank's share.
    with torch.no_grad():
        out = engine(**fsdpx.sequence.shard_batch(batch(0), engine))
    shards = [torch.empty_like(out.logits) for _ in range(world_size)]
    dist.all_gather(shards, out.logits.contiguous())
    share = out.loss.detach().clone()
    dist.all_reduce(share)
    if mode == "ring":  # rank r holds chunks r and 2sp - 1 - r of 2sp: put them back in order
        halves = [shard.chunk(2, dim=1) for shard in shards]
        shards = [h[0] for h in halves] + [h[1] for h in reversed(halves)]
    result: dict[str, Any] = {
        "implementation": implementation,
        "logits": torch.cat(shards, dim=1),
        "loss": share,
    }
    # train_batch shards whole batches itself.
    result["losses"] = [float(engine.train_batch(iter([batch(s)]))) for s in range(steps)]
    result["params"] = {
        n: p.full_tensor().detach().clone() for n, p in engine.module.named_parameters()
    }
    return result
