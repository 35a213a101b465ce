"""Rank bodies for tests/test_deepspeed_gathered.py: `zero.GatheredParameters` as a
DeepSpeed script uses it, on a model sharded by `fsdpx.deepspeed.initialize`."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import fsdpx.deepspeed as deepspeed
from fsdpx.demo.gpt import shard_batch
from tests.parity import global_batches, make_model

LR = 1e-2
# Names of parameters the tests gather: a 2-D weight in a block (sharded by its own FSDP
# unit), a 1-D norm weight and the root's embedding.
MLP_W = "blocks.0.mlp.up_proj.weight"
LN_W = "blocks.1.ln_2.weight"
WTE = "wte.weight"


def _config(case: str) -> dict[str, Any]:
    """`case`: a ZeRO stage, "+offload" for ZeRO-Offload of the optimizer."""
    zero: dict[str, Any] = {"stage": int(case[0])}
    if case.endswith("+offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 2,  # parity.GLOBAL_BATCH over 2 ranks
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.1}},
    }


def _attr(model: nn.Module, name: str) -> torch.Tensor:
    """What the script reads through the module attribute (`model.blocks[0].mlp...`)."""
    owner, _, leaf = name.rpartition(".")
    value = getattr(model.get_submodule(owner), leaf)
    assert isinstance(value, torch.Tensor)
    return value


def _full(engine: Any) -> dict[str, torch.Tensor]:
    return {
        n.removeprefix("module."): p.full_tensor().detach().clone()
        for n, p in engine.named_parameters()
    }


def _modify(get: Any, rank: int) -> None:
    """The writes under test: `.data.fill_`, `.data.copy_`, an in-place index assignment."""
    with torch.no_grad():
        get(MLP_W).data.fill_(0.5 + rank)
        get(LN_W).data.copy_(torch.arange(get(LN_W).numel(), dtype=torch.float32) + rank)
        get(WTE)[3, :] = torch.linspace(-1.0, 1.0, get(WTE).shape[1]) * (1 + rank)


def _train_step(engine: Any, rank: int, world_size: int, seed: int) -> None:
    (micro,) = global_batches(1, 1, seed=seed)
    x, y = micro[0]
    loss = engine(shard_batch(x, rank, world_size), shard_batch(y, rank, world_size))
    engine.backward(loss)
    engine.step()


def stages_body(rank: int, world_size: int, cases: list[str]) -> dict[str, Any]:
    """Per stage: reads inside the context, modifier_rank None and 0, enabled=False,
    nesting and duplicates, then a training step after a modification."""
    out: dict[str, Any] = {}
    for case in cases:
        engine, *_ = deepspeed.initialize(model=make_model(), config=_config(case))
        model = engine.module
        _train_step(engine, rank, world_size, seed=1)
        before = _full(engine)
        res: dict[str, Any] = {"before": before}

        # Reads: every parameter, through the module attributes, is the full tensor.
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            res["read"] = {n: _attr(model, n).detach().clone() for n in before}
            res["read_types"] = {type(_attr(model, n)).__name__ for n in before}
        res["after_read_types"] = {type(_attr(model, n)).__name__ for n in before}

        # modifier_rank=None: every rank writes, nothing is kept.
        with deepspeed.zero.GatheredParameters([_attr(model, n) for n in (MLP_W, LN_W, WTE)]):
            _modify(functools.partial(_attr, model), rank)
        res["after_none"] = _full(engine)

        # enabled=False: the attributes stay the sharded parameters.
        with deepspeed.zero.GatheredParameters(_attr(model, MLP_W), enabled=False):
            res["disabled_type"] = type(_attr(model, MLP_W)).__name__

        # Nested (disjoint) and duplicate parameters.
        w, ln = _attr(model, MLP_W), _attr(model, LN_W)
        with deepspeed.zero.GatheredParameters([w, w, w]):
            with deepspeed.zero.GatheredParameters(ln):
                res["nested"] = [tuple(_attr(model, n).shape) for n in (MLP_W, LN_W)]
            with (
                pytest.raises(RuntimeError, match="nested contexts cannot overlap"),
                deepspeed.zero.GatheredParameters([ln, w]),
            ):
                pass
            with (
                pytest.raises(RuntimeError, match="nested contexts cannot overlap"),
                deepspeed.zero.GatheredParameters(_attr(model, MLP_W)),
            ):  # the full one
                pass
        res["after_nested_types"] = {type(_attr(model, n)).__name__ for n in before}

        # modifier_rank=0: rank 0's writes land on every rank's shard, rank 1's are dropped.
        params = [_attr(model, n) for n in (MLP_W, LN_W, WTE)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            _modify(functools.partial(_attr, model), rank)
        res["after_modify"] = _full(engine)

        # Training continues from the modified weights.
        _train_step(engine, rank, world_size, seed=2)
        res["trained"] = _full(engine)
        out[case] = res
        engine.destroy()
    return out


def reference() -> dict[str, dict[str, torch.Tensor]]:
    """One process: a step, rank 0's modification, a second step (AdamW, global batches)."""
    torch.set_num_threads(1)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out = {}
    for seed in (1, 2):
        if seed == 2:
            _modify(lambda n: _attr(model, n), 0)
            out["modified"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        (micro,) = global_batches(1, 1, seed=seed)
        x, y = micro[0]
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        out[f"step{seed}"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def refusals_body(rank: int, world_size: int) -> dict[str, Any]:
    """The refused cases, and the no-ops on tensors that are not sharded."""
    engine, *_ = deepspeed.initialize(model=make_model(), config=_config("3"))
    model = engine.module
    w = _attr(model, MLP_W)
    with (
        pytest.raises(
            ValueError, match=r"modifier_rank=2 is not a rank of the parameter's mesh of 2"
        ),
        deepspeed.zero.GatheredParameters(w, modifier_rank=2),
    ):
        pass
    with pytest.raises(TypeError, match="modifier_rank must be an int or None"):
        deepspeed.zero.GatheredParameters(w, modifier_rank="0")
    with pytest.raises(ValueError, match=r"fwd_module=\.\.\.\) registers a ZeRO-3 parameter"):
        deepspeed.zero.GatheredParameters(w, fwd_module=model)
    with (
        pytest.raises(RuntimeError, match="a gradient was computed for a gathered parameter"),
        deepspeed.zero.GatheredParameters(w),
    ):
        (_attr(model, MLP_W) ** 2).sum().backward()
    assert isinstance(_attr(model, MLP_W), DTensor)  # restored despite the error

    # A DTensor no fully_shard manages: its module cannot be found.
    mesh = w.device_mesh
    foreign = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Replicate()] * mesh.ndim))
    with (
        pytest.raises(ValueError, match="is not managed by FSDP2's fully_shard"),
        deepspeed.zero.GatheredParameters([foreign]),
    ):
        pass

    # Plain and meta parameters (a model not sharded, or built under zero.Init before
    # initialize) make the context a no-op, writes included.
    plain = nn.Linear(3, 3)
    with deepspeed.zero.Init():
        meta = nn.Linear(3, 3)
    with deepspeed.zero.GatheredParameters(
        list(plain.parameters()) + [meta.weight], modifier_rank=0
    ):
        assert plain.weight is plain.weight and meta.weight.is_meta
        with torch.no_grad():
            plain.weight.fill_(float(rank))
    plain_value = float(plain.weight[0, 0])

    # A body that raises: parameters are restored, nothing is written (no collective).
    before = w.to_local().clone()
    with pytest.raises(KeyError), deepspeed.zero.GatheredParameters(w, modifier_rank=0):
        _attr(model, MLP_W).data.fill_(9.0)
        raise KeyError("boom")
    restored = isinstance(_attr(model, MLP_W), DTensor) and torch.equal(w.to_local(), before)

    dist.barrier()
    engine.destroy()
    return {"plain": plain_value, "restored": restored}


def small_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8))


def _edit(model: nn.Module, rank: int) -> None:
    with torch.no_grad():
        model[0].weight[1:3, :] = 10.0 + rank
        model[2].bias.data.fill_(-1.0 - rank)


def mesh_body(rank: int, world_size: int) -> dict[str, Any]:
    """4 ranks, FSDP2 applied directly: HSDP on a (replicate 2, shard 2) mesh, and TP on
    a (dp 2, tp 2) mesh with FSDP over dp. modifier_rank=3 sits at (1, 1): its writes must
    cross both mesh axes. Uneven shards too (6 rows over 2 x 2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    out: dict[str, Any] = {}
    for layout in ("hsdp", "tp"):
        model = small_model()
        if layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
            fully_shard(model, mesh=mesh)
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(model, mesh=mesh["dp"])
        names = [n for n, _ in model.named_parameters()]
        with deepspeed.zero.GatheredParameters(model.parameters()):
            read = {n: _attr(model, n).detach().clone() for n in names}
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=3):
            _edit(model, rank)
        after = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
        out[layout] = {"read": read, "after": after}
    return out


def mesh_reference() -> dict[str, torch.Tensor]:
    model = small_model()
    _edit(model, 3)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def lifecycle_body(rank: int, world_size: int) -> dict[str, Any]:
    """Stage 2 with accumulation: between micro-steps FSDP2 holds the parameters unsharded
    (plain tensors); gathering them there must read the right values and leave training
    unchanged. Then the refusal inside forward and a modifier_rank that reshapes."""
    config = {**_config("2"), "gradient_accumulation_steps": 2}
    config["train_micro_batch_size_per_gpu"] = 1
    runs = {}
    for gather in (False, True):
        engine, *_ = deepspeed.initialize(model=make_model(), config=config)
        model = engine.module
        (micro,) = global_batches(1, 1, seed=3)
        x, y = micro[0]
        reads: dict[str, torch.Tensor] = {}
        kinds: set[str] = set()
        for half in (0, 1):
            xs, ys = (shard_batch(t, rank, world_size) for t in (x, y))
            xs, ys = xs[half : half + 1], ys[half : half + 1]
            engine.backward(engine(xs, ys))
            if gather and half == 0:
                params = list(model.parameters())
                kinds = {type(p).__name__ for p in params}
                with deepspeed.zero.GatheredParameters(params):
                    reads = {n: _attr(model, n).detach().clone() for n in (MLP_W, WTE)}
            engine.step()
        runs[str(gather)] = {"params": _full(engine), "reads": reads, "kinds": kinds}
        if gather:
            w = _attr(model, MLP_W)
            before = w.to_local().clone()
            # Only modifier_rank raises; the other rank leaves the context normally.
            expect = (
                pytest.raises(RuntimeError, match="on modifier_rank the parameter's data became")
                if rank == 0
                else contextlib.nullcontext()
            )
            with expect, deepspeed.zero.GatheredParameters(w, modifier_rank=0):
                if rank == 0:
                    _attr(model, MLP_W).data = torch.zeros(3)
            runs["unchanged"] = torch.equal(w.to_local(), before)  # type: ignore[assignment]
            hook_errors: list[str] = []

            def hook(module: nn.Module, args: Any, hook_errors: list[str] = hook_errors) -> None:
                try:
                    with deepspeed.zero.GatheredParameters(module.up_proj.weight):
                        pass
                except RuntimeError as err:
                    hook_errors.append(str(err))

            handle = model.get_submodule("blocks.0.mlp").register_forward_pre_hook(hook)
            engine(shard_batch(x, rank, world_size)[:1], shard_batch(y, rank, world_size)[:1])
            handle.remove()
            runs["hook_errors"] = hook_errors  # type: ignore[assignment]

        engine.destroy()
    return runs
