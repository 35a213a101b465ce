"""Rank bodies for tests/test_deepspeed_pipe.py: a DeepSpeed pipeline script (a
PipelineModule through initialize + train_batch / eval_batch) and its single-process
reference, the same nn.Sequential on the same data with the same optimizer."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import fsdpx.deepspeed as deepspeed
from fsdpx.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from fsdpx.parallel_dims import ParallelDims

LR = 1e-2
STEPS = 3


def layers() -> list[Any]:
    """A small convnet in DeepSpeed's layer-list style: modules, a LayerSpec, a function,
    parameter-free layers and in-place ReLUs."""
    return [
        nn.Conv2d(1, 4, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        LayerSpec(nn.Conv2d, 4, 8, 3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
        lambda x: torch.flatten(x, 1),
        nn.Dropout(0.0),
        nn.Linear(8 * 2 * 2, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, 3),
    ]


def ds_config(micro: int, gas: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "Adam", "params": {"lr": LR}},
        "steps_per_print": 100,
    }


def data(dp_rank: int, dp: int, micro: int, gas: int, steps: int) -> list[Any]:
    """This data-parallel rank's micro-batches: every rank draws the global stream and
    keeps its slice of each micro-step's global micro-batch, as a DistributedSampler."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps * gas):
        x = torch.randn(micro * dp, 1, 8, 8, generator=g)
        y = torch.randint(0, 3, (micro * dp,), generator=g)
        out.append(
            (x[dp_rank * micro : (dp_rank + 1) * micro], y[dp_rank * micro : (dp_rank + 1) * micro])
        )
    return out


class _Flatten(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.flatten(x, 1)


def reference(dp: int, micro: int, gas: int, steps: int) -> dict[str, Any]:
    """The same layers as one nn.Sequential in one process: each step averages the loss
    over gas global micro-batches of micro * dp samples."""
    torch.manual_seed(0)
    specs = layers()
    mods = [
        s.build() if isinstance(s, LayerSpec) else s if isinstance(s, nn.Module) else _Flatten()
        for s in specs
    ]
    model = nn.Sequential(*mods)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    stream = data(0, 1, micro * dp, gas, steps + 1)
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for x, y in stream[step * gas : (step + 1) * gas]:
            loss = nn.functional.cross_entropy(model(x), y) / gas
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    with torch.no_grad():
        evals = stream[steps * gas : (steps + 1) * gas]
        eval_loss = sum(float(nn.functional.cross_entropy(model(x), y)) for x, y in evals) / gas
    return {"losses": losses, "eval": eval_loss, "state": model.state_dict()}


def pipe_body(rank: int, world_size: int, cases: list[tuple[int, int, str]]) -> list[Any]:
    """run_case for each (num_stages, gas, partition_method) in one spawn."""
    return [run_case(*case) for case in cases]


def run_case(num_stages: int, gas: int, method: str) -> dict[str, Any]:
    """The DeepSpeed script: PipelineModule -> initialize -> train_batch, eval_batch."""
    micro = 2
    torch.manual_seed(0)
    net = PipelineModule(
        layers=layers(),
        loss_fn=nn.CrossEntropyLoss(),
        num_stages=num_stages,
        partition_method=method,
    )
    parts = list(net.parts)
    engine, _, _, _ = deepspeed.initialize(
        model=net,
        model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=ds_config(micro, gas),
    )
    dp_mesh = ParallelDims.dp_mesh(engine.native.mesh)
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    stream = iter(data(dp_rank, dp, micro, gas, STEPS + 1))
    losses = [float(engine.train_batch(stream)) for _ in range(STEPS)]
    eval_loss = float(engine.eval_batch(stream))
    state = {}
    for name, p in engine.module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        state[name] = full.detach().clone()
    return {"losses": losses, "eval": eval_loss, "state": state, "parts": parts}


# --- tied layers across stages --------------------------------------------------------

VOCAB, DIM, SEQ = 11, 6, 5


def _unembed(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = module.get_parameter("weight")
    return x @ weight.T


def tied_layers() -> list[Any]:
    """A tiny LM in DeepSpeed's style: the embedding tied to the output projection, which
    the uniform split puts on the first and the last stage."""
    return [
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM),
        LayerSpec(nn.Linear, DIM, DIM),
        nn.Tanh(),
        TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=_unembed),
    ]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def tied_data(micro: int, gas: int, steps: int) -> list[Any]:
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randint(0, VOCAB, (micro, SEQ), generator=g),
            torch.randint(0, VOCAB, (micro, SEQ), generator=g),
        )
        for _ in range(steps * gas)
    ]


def tied_config(gas: int, clip: float) -> dict[str, Any]:
    return {**ds_config(2, gas), "gradient_clipping": clip}


def tied_reference(gas: int, clip: float) -> dict[str, Any]:
    """The same PipelineModule in one process (one tied module), torch Adam, the loss
    averaged over the micro-batches, torch's clipping."""
    torch.manual_seed(0)
    net = PipelineModule(tied_layers(), num_stages=1, loss_fn=lm_loss)
    opt = torch.optim.Adam(net.parameters(), lr=LR)
    stream = tied_data(2, gas, STEPS)
    losses = []
    for step in range(STEPS):
        total = torch.zeros(())
        for x, y in stream[step * gas : (step + 1) * gas]:
            loss = lm_loss(net(x), y) / gas
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return {"losses": losses, "state": {n: p.detach().clone() for n, p in net.named_parameters()}}


def _tied_engine(seed: int, gas: int, clip: float) -> Any:
    torch.manual_seed(seed)
    net = PipelineModule(tied_layers(), num_stages=2, loss_fn=lm_loss, partition_method="uniform")
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=net.parameters(), config=tied_config(gas, clip)
    )
    return engine, list(net.parts)


def _full_params(engine: Any) -> dict[str, torch.Tensor]:
    state = {}
    for name, p in engine.module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        state[name] = full.detach().clone()
    return state


def _layout_error(rank: int) -> str:
    """The check TiedGradients makes, given copies whose local shapes differ."""
    import torch.distributed as dist

    from fsdpx.pipeline_tied import Tie, _check_same_layout

    try:
        _check_same_layout(Tie((0, 1), ("a", "b")), torch.zeros(rank + 1), dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    return ""


def tied_body(rank: int, world_size: int, gas: int, clip: float, root: str) -> dict[str, Any]:
    """The DeepSpeed script on 2 stages: the tied embedding on stage 0 and stage 1, saved
    before the last step and resumed by an engine built from another seed."""
    engine, parts = _tied_engine(0, gas, clip)
    stream = iter(tied_data(2, gas, STEPS))
    losses = [float(engine.train_batch(stream)) for _ in range(STEPS - 1)]
    engine.save_checkpoint(root)
    losses.append(float(engine.train_batch(stream)))
    resumed, _ = _tied_engine(1, gas, clip)
    resumed.load_checkpoint(root)
    stream = iter(tied_data(2, gas, STEPS)[(STEPS - 1) * gas :])
    resumed_loss = float(resumed.train_batch(stream))
    return {
        "layout_error": _layout_error(rank),
        "losses": losses,
        "state": _full_params(engine),
        "parts": parts,
        "resumed_loss": resumed_loss,
        "resumed_state": _full_params(resumed),
    }
