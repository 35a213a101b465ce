"""A small byte-level GPT (nanoGPT-like) and a download-free corpus, shared by the demo and tests.

The model is plain PyTorch: the demo (fsdpx/demo/train.py) and the tests shard it with
FSDP2 / tensor parallelism, and tests compare those runs with this module trained in one
process. Data is the Python standard library's own source code read as bytes, so nothing
is downloaded.

Single-process baseline on CPU (200 training steps, then prints a sample):

    python -m fsdpx.demo.gpt
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    """Number of token ids; 256 means one token per byte."""
    block_size: int = 128
    """Longest sequence the position embedding covers."""
    n_layer: int = 4
    """Number of transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""
    n_embd: int = 128
    """Width of the residual stream."""
    dropout: float = 0.0
    """Dropout on embeddings, attention weights and residual branches (training only)."""
    bias: bool = True
    """Whether Linear and LayerNorm layers carry a bias."""


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(
                f"n_embd must be divisible by n_head, got {config.n_embd=} and {config.n_head=}"
            )
        # Tensor parallelism shards q/k/v by output features (whole heads per rank), so the
        # number of heads is read from the projection's output at runtime, not from n_head.
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.q_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.o_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)
        self.residual_std = 0.02 / math.sqrt(2 * config.n_layer)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        local_heads = q.shape[-1] // self.head_dim
        # (batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim)
        q, k, v = (
            t.view(batch, seq, local_heads, self.head_dim).transpose(1, 2) for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(batch, seq, local_heads * self.head_dim)
        return self.resid_dropout(self.o_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.down_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)
        self.residual_std = 0.02 / math.sqrt(2 * config.n_layer)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down_proj(self.gelu(self.up_proj(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def init_weights(module: nn.Module) -> None:
    """GPT-2 initialisation of one module's own parameters, for ``model.apply(init_weights)``.

    ``apply`` visits children first, so o_proj/down_proj get the plain Linear init and are then
    re-drawn at GPT-2's residual scale ``0.02 / sqrt(2 * n_layer)`` when their parent is visited.
    """
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, CausalSelfAttention):
        nn.init.normal_(module.o_proj.weight, mean=0.0, std=module.residual_std)
    elif isinstance(module, MLP):
        nn.init.normal_(module.down_proj.weight, mean=0.0, std=module.residual_std)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        # [Note: one RNG consumer] Submodules are created on meta so their default inits draw
        # nothing; reset_parameters() is the only use of the RNG. Hence GPT(config) under a seed
        # equals building on meta, to_empty() and reset_parameters() under the same seed.
        device = torch.get_default_device()
        with torch.device("meta"):
            self.wte = nn.Embedding(config.vocab_size, config.n_embd)
            self.wpe = nn.Embedding(config.block_size, config.n_embd)
            self.drop = nn.Dropout(config.dropout)
            self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
            self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
            # Not tied to wte: a shared parameter would need the same sharding in two places.
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if device.type != "meta":
            self.to_empty(device=device)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw every parameter from torch's RNG in a fixed module order (no-op on meta)."""
        self.apply(init_weights)

    def forward(
        self, idx: Tensor, targets: Tensor | None = None, *, position_ids: Tensor | None = None
    ) -> Tensor:
        """Logits ``(batch, seq, vocab)`` for ``idx``, or the mean cross-entropy vs ``targets``.

        ``position_ids`` (batch, seq): the tokens' positions in the whole sequence, when
        ``idx`` is one shard of it (sequence parallelism, fsdpx.sequence); default 0..seq-1.
        """
        seq = idx.shape[1]
        if position_ids is None and seq > self.config.block_size:
            raise ValueError(
                f"sequence length {seq} exceeds block_size {self.config.block_size}; "
                "crop the input or build the model with a larger GPTConfig.block_size"
            )
        # A pipeline stage holds only some modules, the others are None (fsdpx's
        # pipeline_split): later stages take hidden states instead of token ids.
        x = idx
        if self.wte is not None:
            pos = torch.arange(seq, device=idx.device) if position_ids is None else position_ids
            x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is None:
            return x
        logits = self.lm_head(x)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def generate(
    model: GPT,
    idx: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    *,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Sample ``max_new_tokens`` tokens after ``idx`` (batch, seq); returns (batch, seq + new).

    Call ``model.eval()`` first if the model uses dropout. Example:
    ``generate(model, torch.tensor([list(b"def ")]), 100, top_k=20)`` has shape (1, 104).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature=}; use top_k=1 for greedy")
    for _ in range(max_new_tokens):
        logits = model(idx[:, -model.config.block_size :])[:, -1, :] / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return idx


def stdlib_corpus(max_bytes: int = 2_000_000) -> Tensor:
    """The standard library's ``.py`` sources as one uint8 tensor of at most ``max_bytes``.

    Files are read in sorted path order (site-packages skipped), so the result is the same on
    every run with the same Python version.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes=}")
    root = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place fixes os.walk's descent order; installed packages are not stdlib.
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages"))
        for name in sorted(f for f in filenames if f.endswith(".py")):
            with open(os.path.join(dirpath, name), "rb") as f:
                chunk = f.read(max_bytes - total)
            chunks.append(chunk)
            total += len(chunk)
            if total >= max_bytes:
                return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)
    if total == 0:
        raise FileNotFoundError(f"no .py files under the stdlib path {root!r}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def batches(
    data: Tensor, batch_size: int, block_size: int, *, generator: torch.Generator
) -> Iterator[tuple[Tensor, Tensor]]:
    """Endless random ``(x, y)`` int64 batches of shape (batch_size, block_size); y = x shifted by 1.

    Example: ``x, y = next(batches(data, 8, 64, generator=torch.Generator().manual_seed(0)))``
    """
    if data.numel() <= block_size:
        raise ValueError(
            f"data has {data.numel()} tokens but block_size {block_size} needs at least "
            f"{block_size + 1}; pass more data or a smaller block_size"
        )
    window = torch.arange(block_size + 1)
    while True:
        starts = torch.randint(data.numel() - block_size, (batch_size, 1), generator=generator)
        chunk = data[starts + window].long()
        yield chunk[:, :-1], chunk[:, 1:]


def shard_batch(x: Tensor, rank: int, world_size: int) -> Tensor:
    """Rank ``rank``'s contiguous slice of dim 0 of a global batch split over ``world_size``.

    Example:
        >>> shard_batch(torch.arange(8), rank=1, world_size=4).tolist()
        [2, 3]
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size), got {rank=} and {world_size=}")
    if x.shape[0] % world_size != 0:
        raise ValueError(
            f"global batch size {x.shape[0]} is not divisible by world_size {world_size}; "
            "pick a batch size that is a multiple of the number of ranks"
        )
    per_rank = x.shape[0] // world_size
    return x.narrow(0, rank * per_rank, per_rank)


def main(steps: int = 200, batch_size: int = 16) -> None:
    """Train on one process for ``steps`` steps, printing the loss, then print a sample."""
    torch.manual_seed(0)
    config = GPTConfig()
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    data = batches(stdlib_corpus(), batch_size, config.block_size, generator=generator)
    for step in range(steps):
        x, y = next(data)
        loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}")
    sample = generate(model.eval(), torch.tensor([list(b"def ")]), 200, top_k=20)
    print(bytes(sample[0].tolist()).decode("utf-8", errors="replace"))


if __name__ == "__main__":
    main()
