"""A model whose MoE blocks fsdpx does not recognise (a router Linear, a ModuleList of expert
MLPs with its own per-expert loop, a shared expert), its plan, and the rank body that
trains it under moe.plan at mesh.ep = 2 against the unconverted model in one process."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import fsdpx
from fsdpx.comm import comm_log
from fsdpx.comm.counted import all_to_all_uneven
from fsdpx.telemetry.moe_load import moe_load

D, EXPERTS, K, LAYERS = 8, 4, 2, 2
TOKENS, SEQS, STEPS, LR = 6, 2, 3, 1e-2
PLAN = {
    "layers.*.moe": {"router": "gate", "experts": "experts", "shared_experts": "shared", "top_k": K}
}


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, 12), nn.Linear(12, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class LoopMoE(nn.Module):
    """Softmax top-k, renormalised, experts run one by one (the model's own rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(D, EXPERTS, bias=False)
        self.experts = nn.ModuleList([MLP() for _ in range(EXPERTS)])
        self.shared = MLP()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, D)
        scores = F.softmax(self.gate(x).float(), dim=-1)
        w, idx = torch.topk(scores, K, dim=-1)
        w = w / w.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out = out.index_add(0, tok, expert(x[tok]) * w[tok, slot, None])
        return (out + self.shared(x)).reshape(h.shape)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = LoopMoE()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(h)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.head = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_model() -> Model:
    torch.manual_seed(0)
    return Model()


def batches(dp: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(1)
    return [
        [
            (torch.randn(SEQS, TOKENS, D, generator=g), torch.randn(SEQS, TOKENS, D, generator=g))
            for _ in range(dp)
        ]
        for _ in range(STEPS)
    ]


def stacked_names(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The unconverted model's parameters under the planned names: experts stacked."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, list[torch.Tensor]] = {}
    for name, p in params.items():
        head, sep, tail = name.partition(".experts.")
        if not sep:
            out[name] = p
            continue
        index, _, leaf = tail.partition(".")
        experts.setdefault(f"{head}.experts.expert.{leaf}", []).append(p)
        assert len(experts[f"{head}.experts.expert.{leaf}"]) == int(index) + 1
    out.update({n: torch.stack(ps) for n, ps in experts.items()})
    return out


def reference_run(dp: int) -> tuple[list[torch.Tensor], list[float], dict[str, torch.Tensor]]:
    """The unconverted model in one process: outputs of the first batch (per rank), losses
    of each step (mean over the dp micro-batches), parameters after STEPS AdamW steps."""
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data = batches(dp)
    with torch.no_grad():
        outputs = [model(x) for x, _ in data[0]]
    losses = []
    for step in data:
        total = torch.stack([F.mse_loss(model(x), y) for x, y in step]).mean()
        total.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(total.detach()))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return outputs, losses, stacked_names(params)


def plan_ep_body(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """This rank's outputs, losses and gathered parameters under moe.plan, the expert rows
    it computed in the first forward (telemetry's moe_tokens) and a check of the uneven
    all_to_all's byte count."""
    cfg = fsdpx.Config.from_dict(
        {
            "optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.01},
            "moe": {"plan": PLAN},
            **cfg_dict,
        }
    )
    engine = fsdpx.shard(make_model(), cfg)
    dp_rank = int(fsdpx.parallel_dims.ParallelDims.dp_mesh(engine.mesh).get_local_rank())
    data = batches(engine.parallel_dims.dp)
    moe_load().take()
    with torch.no_grad():
        output = engine(data[0][dp_rank][0])
    rows = moe_load().take()["moe_tokens"]
    losses = []
    for step in data:
        x, y = step[dp_rank]
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(engine.all_reduce_mean(loss.detach())))
    params = {}
    for n, p in engine.module.named_parameters():
        params[n] = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
    # Uneven all_to_all: rank r sends r + 1 rows to every rank; counted are those not kept.
    splits = [rank + 1] * world_size
    recv = [r + 1 for r in range(world_size)]
    before = comm_log().totals()["all_to_all_single"]
    out = torch.empty(sum(recv), D)
    all_to_all_uneven(out, torch.ones(sum(splits), D), recv, splits, dist.group.WORLD)
    sent = comm_log().totals()["all_to_all_single"] - before
    dist.barrier()
    return {"output": output, "losses": losses, "params": params, "rows": rows, "sent": sent}
