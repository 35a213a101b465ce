"""Rank bodies and the single-process reference for the expert-parallel tests.

A tiny MoE model (input projection, blocks of residual MoE layers, output head), its
batches, the reference trainer (one process: every data-parallel rank's micro-batch run on
the unsplit model, losses averaged, AdamW, clipping) and the fsdpx trainer (one rank's part
through fsdpx.shard). Capacity-limited gates compute their capacity from the tokens each
rank sees, so the reference runs each rank's slice separately, as the ranks do.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdpx
from fsdpx.moe import MoE

HIDDEN = 8
TOKENS = 6  # per sequence
SEQS = 2  # per rank per micro-step
STEPS = 3
AUX = 0.1
LR = 1e-2


class Block(nn.Module):
    def __init__(self, moe: MoE, dense: bool) -> None:
        super().__init__()
        # A dense MLP before the experts: what tensor parallelism splits (plan TP_PLAN).
        self.up = nn.Linear(HIDDEN, 16) if dense else None
        self.down = nn.Linear(16, HIDDEN) if dense else None
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.up is not None and self.down is not None:
            x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        out, l_aux, _ = self.moe(x)
        return x + out, l_aux


TP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
_MODEL_KEYS = ("shared", "dense", "pp", "meta")
"""Model options, not MoE arguments. meta: fsdpx_run builds the model on the meta device
and initialises it with INIT; the reference builds it on CPU and applies INIT too."""


class MoEModel(nn.Module):
    def __init__(self, moe_kwargs: dict[str, Any], layers: int = 2) -> None:
        super().__init__()
        # pp: the forward returns only the output (a pipeline stage passes one tensor on,
        # so the aux loss stays out of the loss) and skips the modules other stages hold.
        self.pp = bool(moe_kwargs.get("pp"))
        self.inp: nn.Module | None = nn.Linear(HIDDEN, HIDDEN)
        blocks = []
        for _ in range(layers):
            expert = nn.Sequential(nn.Linear(HIDDEN, 12), nn.GELU(), nn.Linear(12, HIDDEN))
            shared = None
            if moe_kwargs.get("shared"):
                shared = nn.Sequential(nn.Linear(HIDDEN, 6), nn.GELU(), nn.Linear(6, HIDDEN))
            kw = {k: v for k, v in moe_kwargs.items() if k not in _MODEL_KEYS}
            moe = MoE(HIDDEN, expert, shared_expert=shared, **kw)
            blocks.append(Block(moe, dense=bool(moe_kwargs.get("dense"))))
        self.blocks = nn.ModuleList(blocks)
        self.head: nn.Module | None = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.inp(x) if self.inp is not None else x
        aux = torch.zeros((), device=x.device)
        for block in self.blocks:
            h, l_aux = block(h)
            aux = aux + l_aux
        out = self.head(h) if self.head is not None else h
        return out if self.pp else (out, aux)


def _init(name: str, t: torch.Tensor, g: torch.Generator) -> None:
    t.normal_(0.0, 0.3, generator=g)


INIT = fsdpx.per_param_init(_init, seed=3)
"""Values by parameter name: the same for a CPU model and a meta-built one at any ep."""


def make_model(moe_kwargs: dict[str, Any]) -> MoEModel:
    torch.manual_seed(0)
    model = MoEModel(moe_kwargs)
    if moe_kwargs.get("meta"):
        INIT(model)
    return model


def batches(dp: int, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """STEPS global batches, each a list of dp per-rank (x, y) micro-batches."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            (
                torch.randn(SEQS, TOKENS, HIDDEN, generator=g),
                torch.randn(SEQS, TOKENS, HIDDEN, generator=g),
            )
            for _ in range(dp)
        ]
        for _ in range(STEPS)
    ]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return loss_fn(model(x), y)


def loss_fn(outputs: Any, y: torch.Tensor) -> torch.Tensor:
    """MSE plus AUX times the MoE aux losses; MSE alone for a pp model's plain output."""
    if isinstance(outputs, tuple):
        out, aux = outputs
        return torch.nn.functional.mse_loss(out, y) + AUX * aux
    return torch.nn.functional.mse_loss(outputs, y)


def reference_run(
    moe_kwargs: dict[str, Any], dp: int, clip: float
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the same initial weights and the same per-rank micro-batches."""
    torch.set_num_threads(1)
    model = make_model(moe_kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for step in batches(dp):
        per_rank = [loss_of(model, x, y) for x, y in step]
        total = torch.stack(per_rank).mean()
        total.backward()
        if not grads:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(total.detach()))
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def fsdpx_run(
    rank: int, world_size: int, moe_kwargs: dict[str, Any], cfg_dict: dict[str, Any]
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's part of the same training through fsdpx.shard."""
    cfg = fsdpx.Config.from_dict(
        {"optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.01}, **cfg_dict}
    )
    if moe_kwargs.get("meta"):
        with torch.device("meta"):
            model = MoEModel(moe_kwargs)
        engine = fsdpx.shard(model, cfg, init_fn=INIT)
    else:
        engine = fsdpx.shard(make_model(moe_kwargs), cfg)
    dp = engine.parallel_dims.dp
    dp_rank = ParallelRank.of(engine)
    losses = []
    grads: dict[str, torch.Tensor] = {}
    for step in batches(dp):
        x, y = step[dp_rank]
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        if not grads:
            grads = {n: _full(p.grad) for n, p in engine.module.named_parameters()}
        engine.step()
        losses.append(float(engine.all_reduce_mean(loss.detach())))
    params = {n: _full(p) for n, p in engine.module.named_parameters()}
    return losses, grads, params


def _full(t: torch.Tensor) -> torch.Tensor:
    full = t.full_tensor() if isinstance(t, DTensor) else t
    return full.detach().clone()


class ParallelRank:
    @staticmethod
    def of(engine: Any) -> int:
        """This rank's index among the data-parallel ranks (which micro-batch it takes)."""
        mesh = fsdpx.parallel_dims.ParallelDims.dp_mesh(engine.mesh)
        return int(mesh.get_local_rank())


def parity_body(
    rank: int, world_size: int, cases: dict[str, tuple[dict[str, Any], dict[str, Any]]]
) -> dict[str, Any]:
    out = {name: fsdpx_run(rank, world_size, mk, cfg) for name, (mk, cfg) in cases.items()}
    dist.barrier()
    return out


def bad_input_body(
    rank: int, world_size: int, cases: dict[str, tuple[dict[str, Any], dict[str, Any]]]
) -> list[str | None]:
    """fsdpx.shard on each bad case; the error message each raised (None: it did not)."""
    errors: list[str | None] = []
    for moe_kwargs, cfg_dict in cases.values():
        if moe_kwargs.get("meta"):
            with torch.device("meta"):
                model: nn.Module = MoEModel(moe_kwargs)
        else:
            model = make_model(moe_kwargs) if moe_kwargs else nn.Linear(HIDDEN, HIDDEN)
        try:
            fsdpx.shard(model, fsdpx.Config.from_dict(cfg_dict))
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    dist.barrier()
    return errors


def reference_composed(
    moe_kwargs: dict[str, Any], dp: int, gas: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference of composed_body: dp * gas micro-batches per step, each run alone."""
    losses, _, params = reference_run(moe_kwargs, dp * gas, clip=0.0)
    return losses, params


def composed_body(
    rank: int, world_size: int, moe_kwargs: dict[str, Any], cfg_dict: dict[str, Any]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """engine.train_batch (the pipeline schedule under pp) on this rank's gas micro-batches
    per step; the losses and this rank's parameters (its stages' only under pp), gathered."""
    cfg = fsdpx.Config.from_dict(
        {"optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.01}, **cfg_dict}
    )
    engine = fsdpx.shard(make_model(moe_kwargs), cfg, loss_fn=loss_fn)
    dp, gas = engine.parallel_dims.dp, cfg.gradient_accumulation_steps
    dp_rank = ParallelRank.of(engine)
    losses = []
    for step in batches(dp * gas):
        mine = step[dp_rank * gas : (dp_rank + 1) * gas]
        losses.append(float(engine.train_batch(iter(mine))))
    params = {n: _full(p) for n, p in engine.module.named_parameters()}
    dist.barrier()
    return losses, params


def _state(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter and its Adam moments, gathered to full tensors, by parameter name."""
    out: dict[str, torch.Tensor] = {}
    opt_state = engine.optimizer.state
    for n, p in engine.module.named_parameters():
        out[n] = _full(p)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{n}.{key}"] = _full(opt_state[p][key])
    return out


def ckpt_body(
    rank: int,
    world_size: int,
    moe_kwargs: dict[str, Any],
    save_cfg: dict[str, Any],
    load_cfg: dict[str, Any],
    root: str,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Train 1 step under save_cfg and save; load into a fresh engine under load_cfg.
    Returns both engines' gathered parameters and optimizer moments."""
    base = {"optimizer": {"type": "adamw", "lr": LR}}
    saver = fsdpx.shard(make_model(moe_kwargs), fsdpx.Config.from_dict({**base, **save_cfg}))
    x, y = batches(saver.parallel_dims.dp)[0][ParallelRank.of(saver)]
    saver.backward(loss_of(saver, x, y))
    saver.step()
    saver.save_checkpoint(root)
    saved = _state(saver)
    ep_kwargs = {**moe_kwargs, "ep_size": load_cfg.get("mesh", {}).get("ep", 1)}
    loader = fsdpx.shard(make_model(ep_kwargs), fsdpx.Config.from_dict({**base, **load_cfg}))
    x, y = batches(loader.parallel_dims.dp)[0][ParallelRank.of(loader)]
    loader.backward(loss_of(loader, x, y))  # optimizer state exists before the load
    loader.step()
    loader.load_checkpoint(root)
    loaded = _state(loader)
    dist.barrier()
    return saved, loaded


def load_only_body(
    rank: int, world_size: int, moe_kwargs: dict[str, Any], load_cfg: dict[str, Any], root: str
) -> dict[str, torch.Tensor]:
    """A fresh engine under load_cfg that loads `root`; its gathered state."""
    base = {"optimizer": {"type": "adamw", "lr": LR}}
    loader = fsdpx.shard(make_model(moe_kwargs), fsdpx.Config.from_dict({**base, **load_cfg}))
    x, y = batches(loader.parallel_dims.dp)[0][ParallelRank.of(loader)]
    loader.backward(loss_of(loader, x, y))
    loader.step()
    loader.load_checkpoint(root)
    state = _state(loader)
    dist.barrier()
    return state


def ds_initialize_body(
    rank: int, world_size: int, moe_kwargs: dict[str, Any], clip: float
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training as fsdpx_run, written as a DeepSpeed script: `deepspeed.initialize`
    with a ds_config that says nothing about experts (mesh.ep comes from MoE(ep_size=...))."""
    import fsdpx.deepspeed as deepspeed

    ds_config = {
        "train_micro_batch_size_per_gpu": SEQS,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
    }
    model = make_model(moe_kwargs)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=ds_config
    )
    losses = []
    for step in batches(world_size):
        x, y = step[rank]
        loss = loss_of(engine, x, y)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world_size)
    params = {n: _full(p) for n, p in engine.module.named_parameters()}
    dist.barrier()
    return losses, params
