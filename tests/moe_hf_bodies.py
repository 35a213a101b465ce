"""Tiny Hugging Face MoE models (built from transformers config classes, no downloads) and
the rank body of the automatic expert-parallel tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdpx

VOCAB, SEQ, BATCH, STEPS, LR = 64, 8, 2, 3, 1e-2


def make_model(kind: str) -> nn.Module:
    """A 2-layer model of `kind` with 4 experts, top-2, hidden 16, fp32, eager attention."""
    torch.manual_seed(0)
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_experts_per_tok=2,
        attn_implementation="eager",
    )
    if kind == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(intermediate_size=24, num_local_experts=4, **common)
        model: nn.Module = MixtralForCausalLM(cfg)
    elif kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(
            intermediate_size=24, moe_intermediate_size=12, num_experts=4, head_dim=8, **common
        )
        model = Qwen3MoeForCausalLM(cfg)
    elif kind == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        cfg = DeepseekV3Config(
            intermediate_size=24,
            moe_intermediate_size=12,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            kv_lora_rank=8,
            q_lora_rank=8,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            **common,
        )
        model = DeepseekV3ForCausalLM(cfg)
    elif kind in ("mixtral_per_expert", "qwen_per_expert"):
        # transformers' decoder with the per-expert blocks of older versions / hub code.
        from tests.moe_per_expert_bodies import per_expert_model

        return per_expert_model(
            make_model(kind.split("_")[0].replace("qwen", "qwen3_moe")), kind.startswith("qwen")
        )
    else:
        raise ValueError(kind)
    # Experts start from different values (transformers' init may leave them equal/empty).
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.float()


def batches(dp: int) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    return [
        [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(dp)]
        for _ in range(STEPS)
    ]


def reference(kind: str, dp: int) -> dict[str, Any]:
    """One process: the logits of batch 0 of every rank, then STEPS AdamW steps on the mean
    of the per-rank losses."""
    torch.set_num_threads(1)
    model = make_model(kind)
    data = batches(dp)
    model.eval()
    with torch.no_grad():
        logits = [model(input_ids=ids).logits for ids in data[0]]
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for step in data:
        loss = torch.stack([model(input_ids=ids, labels=ids).loss for ids in step]).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits, "losses": losses, "params": params}


def ep_body(rank: int, world_size: int, kind: str, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    cfg = fsdpx.Config.from_dict(
        {"optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.0}, **cfg_dict}
    )
    engine = fsdpx.shard(make_model(kind), cfg)
    dp = engine.parallel_dims.dp
    dp_rank = int(fsdpx.parallel_dims.ParallelDims.dp_mesh(engine.mesh).get_local_rank())
    data = batches(dp)
    module = engine.module
    module.eval()
    with torch.no_grad():
        logits = module(input_ids=data[0][dp_rank]).logits
    module.train()
    losses = []
    for step in data:
        loss = engine(input_ids=step[dp_rank], labels=step[dp_rank]).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(engine.all_reduce_mean(loss.detach())))
    params = {}
    for n, p in module.named_parameters():
        params[n] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    classes = sorted(
        {type(m).__name__ for m in module.modules() if "ExpertParallel" in type(m).__name__}
    )
    dist.barrier()
    return {"logits": logits, "losses": losses, "params": params, "classes": classes}


def ep_sweep_body(
    rank: int, world_size: int, kinds: list[str], cfg_dict: dict[str, Any]
) -> dict[str, Any]:
    return {kind: ep_body(rank, world_size, kind, cfg_dict) for kind in kinds}


def from_pretrained_body(
    rank: int, world_size: int, path: str, cfg_dict: dict[str, Any]
) -> dict[str, Any]:
    """fsdpx.hf.from_pretrained of a saved tiny Mixtral under cfg_dict (the model is built
    on the meta device and each rank reads only its shards, experts split over ep); the
    logits of this rank's batch 0."""
    from transformers import MixtralForCausalLM

    from fsdpx.hf import from_pretrained

    engine = from_pretrained(MixtralForCausalLM, path, fsdpx.Config.from_dict(cfg_dict))
    dp_rank = int(fsdpx.parallel_dims.ParallelDims.dp_mesh(engine.mesh).get_local_rank())
    module = engine.module
    module.eval()
    with torch.no_grad():
        logits = module(input_ids=batches(engine.parallel_dims.dp)[0][dp_rank]).logits
    classes = sorted(
        {type(m).__name__ for m in module.modules() if "ExpertParallel" in type(m).__name__}
    )
    dist.barrier()
    return {"logits": logits, "classes": classes}
