"""Shared pieces of the tensor / pipeline / 3D parity tests, importable by spawned ranks:
a 4-block GPT, the single-process reference (gradients, grad norms, parameters after
AdamW steps, with clipping), the per-rank fsdpx run through engine.train_batch, and small
GPT-2-style and Llama-style models with Hugging Face module names and layouts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import fsdpx
from fsdpx.demo.gpt import GPT, GPTConfig, shard_batch
from fsdpx.parallel_dims import ParallelDims

# bias=False: see tests/parity.py (a k-projection bias has an exactly-zero true gradient).
MODEL = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32, bias=False)
GLOBAL_BATCH = 4
STEPS = 3
LR = 1e-2
# Adam's eps: TP and PP add partial sums in another order than one process, so gradient
# entries of ~1e-9 differ by ~1e-12; with eps 1e-8 Adam divides by their own tiny size and
# turns that into ~1e-5 parameter differences within 3 steps (the k-bias trap of
# tests/parity.py, spread over many entries). eps 1e-5 keeps such entries in Adam's
# linear range; gradients themselves are compared at fp32 tolerance anyway.
EPS = 1e-5
CLIP = 0.5  # small enough that every step clips: the combined norm must be right


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(MODEL)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def global_batches(steps: int, gas: int, seed: int = 1) -> list[list[tuple[torch.Tensor, ...]]]:
    g = torch.Generator().manual_seed(seed)
    shape = (GLOBAL_BATCH, MODEL.block_size)
    return [
        [
            (torch.randint(0, 64, shape, generator=g), torch.randint(0, 64, shape, generator=g))
            for _ in range(gas)
        ]
        for _ in range(steps)
    ]


def base_cfg(gas: int, lr: float = LR, eps: float = EPS, **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "adamw", "lr": lr, "eps": eps, "weight_decay": 0.1},
    }
    cfg.update(sections)
    return cfg


Result = dict[str, Any]


def reference(cfg_dict: dict[str, Any], dp: int, steps: int = STEPS) -> Result:
    """One process, one thread: the same global batches, loss / (gas * dp) per chunk."""
    cfg = fsdpx.Config.from_dict(cfg_dict)
    gas, o = cfg.gradient_accumulation_steps, cfg.optimizer
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=o.lr, eps=o.eps, weight_decay=o.weight_decay)
        out: Result = {"losses": [], "norms": [], "grads": {}}
        for step, micro in enumerate(global_batches(steps, gas)):
            losses = []
            for x, y in micro:
                for r in range(dp):
                    loss = lm_loss(model(shard_batch(x, r, dp)), shard_batch(y, r, dp))
                    (loss / (gas * dp)).backward()
                    losses.append(float(loss.detach()))
            if step == 0:
                out["raw_grads"] = _grads(model)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            if step == 0:
                out["grads"] = _grads(model)
            out["losses"].append(sum(losses) / len(losses))
            out["norms"].append(float(norm))
            opt.step()
            opt.zero_grad()
        out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        return out
    finally:
        torch.set_num_threads(threads)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """torch.testing.assert_close at fp32 defaults, with `what` in front of the message."""
    try:
        torch.testing.assert_close(actual, expected)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def fsdpx_run(
    cfg_dict: dict[str, Any], steps: int = STEPS, make: Callable[[], nn.Module] = make_model
) -> Result:
    """This rank's part of the training through fsdpx.shard + engine.train_batch. Grads are
    captured (after clipping) right before the first optimizer step; parameters at the end
    (under pp: only this rank's stages)."""
    cfg = fsdpx.Config.from_dict(cfg_dict)
    engine = fsdpx.shard(make(), cfg, loss_fn=lm_loss)
    dp_mesh = ParallelDims.dp_mesh(engine.mesh)
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    out: Result = {"losses": [], "norms": [], "grads": {}}

    def capture(opt: Any, args: Any, kwargs: Any) -> None:
        if not out["grads"]:
            out["grads"] = {
                n: _full(p.grad) for n, p in engine.module.named_parameters() if p.grad is not None
            }

    engine.optimizer.register_step_pre_hook(capture)
    for micro in global_batches(steps, cfg.gradient_accumulation_steps):
        data = iter([(shard_batch(x, dp_rank, dp), shard_batch(y, dp_rank, dp)) for x, y in micro])
        out["losses"].append(float(engine.train_batch(data)))
        out["norms"].append(engine.get_global_grad_norm())
    out["params"] = {n: _full(p) for n, p in engine.module.named_parameters()}
    return out


def sweep_body(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Result]:
    return {name: fsdpx_run(cfg) for name, cfg in cases.items()}


def check_against_reference(results: list[dict[str, Result]], ref: Result, name: str) -> None:
    """Every rank's losses and norms, and every parameter (from whichever ranks hold it),
    equal the reference within fp32 tolerance."""
    seen: set[str] = set()
    for rank, per_rank in enumerate(results):
        got = per_rank[name]
        msg = f"{name} rank {rank}"
        close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), f"{msg} losses")
        close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), f"{msg} grad norms")
        assert got["grads"].keys() == got["params"].keys(), msg
        for pname, value in got["params"].items():
            seen.add(pname)
            close(got["grads"][pname], ref["grads"][pname], f"{msg} grad {pname}")
            close(value, ref["params"][pname], f"{msg} param {pname}")
    assert seen == set(ref["params"]), (
        f"{name}: parameters held by no rank: {set(ref['params']) - seen}"
    )


# --- Hugging Face-style blocks (same module names and layouts, randomly initialised) ---


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a Linear with its weight stored (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.randn(nf) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.split_size = heads, d // heads, d
        self.c_attn = Conv1D(3 * d, d)
        self.c_proj = Conv1D(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.c_attn(x).split(self.split_size, dim=2)
        q, k, v = (t.view(b, s, self.num_heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class GPT2MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * d, d)
        self.c_proj = Conv1D(d, 4 * d)
        self.act = nn.GELU(approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(d), GPT2Attention(d, heads)
        self.ln_2, self.mlp = nn.LayerNorm(d), GPT2MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(16, d)
        self.h = nn.ModuleList(GPT2Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, **kw: int) -> None:
        super().__init__()
        self.transformer = GPT2Model(**kw)
        self.lm_head = nn.Linear(32, 64, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer(idx))


class LlamaRMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.variance_epsilon))


class LlamaAttention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, d // heads
        self.q_proj = nn.Linear(d, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        rep = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, hidden, bias=False)
        self.up_proj = nn.Linear(d, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(d)
        self.self_attn = LlamaAttention(d, heads, kv_heads)
        self.post_attention_layernorm = LlamaRMSNorm(d)
        self.mlp = LlamaMLP(d, 3 * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, kv_heads: int, layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(LlamaDecoderLayer(d, heads, kv_heads) for _ in range(layers))
        self.norm = LlamaRMSNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, heads: int = 4, kv_heads: int = 2, d: int = 32, layers: int = 2) -> None:
        super().__init__()
        self.model = LlamaModel(64, d, heads, kv_heads, layers)
        self.lm_head = nn.Linear(d, 64, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model(idx))


def hf_style_forward_body(rank: int, world_size: int) -> dict[str, float]:
    """Auto TP plan (tp = world) on GPT-2-style and Llama-style models (Llama also with
    sequence parallel): the logits equal the unparallelised model's. Returns max diffs."""
    torch.manual_seed(3)
    idx = torch.randint(0, 64, (2, 16))
    diffs: dict[str, float] = {}
    cases: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
        "gpt2": (GPT2LMHeadModel, {}),
        "llama": (LlamaForCausalLM, {}),
        "llama_sp": (LlamaForCausalLM, {"sequence_parallel": True}),
    }
    for name, (cls, tp_cfg) in cases.items():
        torch.manual_seed(0)
        model = cls()
        with torch.no_grad():
            expected = model(idx)
        cfg = fsdpx.Config.from_dict({"mesh": {"tp": world_size}, "tensor_parallel": tp_cfg})
        engine = fsdpx.shard(model, cfg)
        with torch.no_grad():
            got = engine(idx)
        close(got, expected, name)
        module = engine.module
        if cls is LlamaForCausalLM:
            attn: Any = module.get_submodule("model.layers.0.self_attn")
            assert (attn.num_heads, attn.num_key_value_heads) == (4 // world_size, 2 // world_size)
            assert isinstance(attn.q_proj.weight, DTensor)
        else:
            mlp: Any = module.get_submodule("transformer.h.0.mlp")
            attn = module.get_submodule("transformer.h.0.attn")
            # MLP split (Conv1D, weight (in, out): dim 1), attention replicated behind c_attn.
            assert mlp.c_fc.weight.placements[-1].is_shard(1), mlp.c_fc.weight.placements
            assert attn.num_heads == 4
        diffs[name] = float((got - expected).abs().max())
    return diffs
