"""Rank bodies of the pipeline tests (importable by spawned ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

import fsdpx
from fsdpx.demo.gpt import GPT, shard_batch
from fsdpx.distributed import init_distributed
from fsdpx.parallel_dims import ParallelDims
from fsdpx.parallelize import parallelize
from tests.tp_bodies import MODEL, base_cfg, global_batches, lm_loss, make_model


def _init(name: str, t: torch.Tensor, g: torch.Generator) -> None:
    if t.ndim == 1:
        t.fill_(1.0)  # LayerNorm weights (the model has no biases)
    else:
        t.normal_(0.0, 0.02, generator=g)


def first_step_grads(cfg_dict: dict[str, Any], block_reshard_after_forward: bool) -> dict[str, Any]:
    """One schedule step through the parallelize recipe with the given block resharding under PP
    (fsdpx forces False; True is what ZeRO-3 would otherwise ask for). Returns this
    rank's full gradients (None where a parameter got no gradient)."""
    cfg = fsdpx.Config.from_dict(cfg_dict)
    info = init_distributed(cfg)
    dims = ParallelDims.from_config(cfg.mesh, info.world_size)
    mesh = dims.build_mesh("cpu")
    model = make_model()
    built = parallelize(
        model,
        list(model.blocks),
        cfg=cfg,
        dims=dims,
        mesh=mesh,
        device=info.device,
        loss_fn=lm_loss,
        pp_block_reshard_after_forward=block_reshard_after_forward,
    )
    assert built.pipeline is not None
    dp_mesh = ParallelDims.dp_mesh(mesh)
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    micro = global_batches(1, cfg.gradient_accumulation_steps)[0]
    batches = [(shard_batch(x, dp_rank, dp), shard_batch(y, dp_rank, dp)) for x, y in micro]
    built.pipeline.step(batches, 1.0, info.device)
    grads: dict[str, Any] = {}
    for name, p in built.module.named_parameters():
        g = p.grad
        grads[name] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g)
    return grads


def regression_body(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[Any, Any]:
    """First-step gradients with the forced (False) and ZeRO-3's (True) block resharding,
    and the engine errors (one spawn for both)."""
    out: dict[Any, Any] = {flag: first_step_grads(cfg_dict, flag) for flag in (False, True)}
    out["errors"] = engine_errors()
    out["fp16"] = fp16_pipeline(cfg_dict)
    return out


def fp16_pipeline(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """3 steps with fp16 compute and dynamic loss scaling (initial scale 2**16) through the
    pipeline, on the same data as the fp32 reference."""
    cfg = fsdpx.Config.from_dict(
        {**cfg_dict, "precision": {"param_dtype": "fp16", "reduce_dtype": "fp32"}}
    )
    engine = fsdpx.shard(make_model(), cfg, loss_fn=lm_loss)
    dp_mesh = ParallelDims.dp_mesh(engine.mesh)
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    losses = []
    for micro in global_batches(3, cfg.gradient_accumulation_steps):
        data = [(shard_batch(x, dp_rank, dp), shard_batch(y, dp_rank, dp)) for x, y in micro]
        losses.append(float(engine.train_batch(iter(data))))
    return {"losses": losses, "skipped": engine.skipped_steps, "scale": engine.loss_scale}


def engine_errors() -> dict[str, str]:
    """The user-facing errors of a pipelined engine, raised on every rank."""
    cfg = fsdpx.Config.from_dict(base_cfg(4, mesh={"pp": 2}))
    with pytest.raises(ValueError, match="pipeline parallelism needs loss_fn") as no_loss:
        fsdpx.shard(make_model(), cfg)
    bad = fsdpx.Config.from_dict(base_cfg(1, mesh={"pp": 2}))
    with pytest.raises(ValueError, match="at least as many micro-batches") as few:
        fsdpx.shard(make_model(), bad, loss_fn=lm_loss)
    lp = fsdpx.Config.from_dict(
        base_cfg(4, mesh={"pp": 2, "tp": 2}, tensor_parallel={"loss_parallel": True})
    )
    with pytest.raises(NotImplementedError, match="loss_parallel with pipeline") as lp_pp:
        fsdpx.shard(make_model(), lp, loss_fn=lm_loss)
    with torch.device("meta"):
        meta_model = GPT(MODEL)
    with pytest.raises(ValueError, match="needs init_fn") as meta:
        fsdpx.shard(meta_model, cfg, loss_fn=lm_loss)
    # With per_param_init a meta-built, pipelined model starts as the unsplit one.
    init = fsdpx.per_param_init(_init, seed=1)
    engine = fsdpx.shard(meta_model, cfg, loss_fn=lm_loss, init_fn=init)
    x = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(0))
    reference = GPT(MODEL)
    init(reference)
    expected = float(lm_loss(reference(x), x.roll(1, 1)))
    loss = float(engine.train_batch(iter([(x, x.roll(1, 1))] * 4)))
    assert abs(loss - expected) < 1e-5, (loss, expected)
    engine = fsdpx.shard(make_model(), cfg, loss_fn=lm_loss)
    x = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(NotImplementedError, match="use engine.train_batch") as fwd:
        engine(x)
    with pytest.raises(NotImplementedError, match="use engine.train_batch") as bwd:
        engine.backward(torch.zeros(()))
    with pytest.raises(ValueError, match=r"an \(inputs, targets\) pair") as pair:
        engine.train_batch(iter([{"idx": x}] * 4))
    return {
        k: str(e.value)
        for k, e in {
            "no_loss": no_loss,
            "few": few,
            "fwd": fwd,
            "bwd": bwd,
            "pair": pair,
            "lp_pp": lp_pp,
            "meta": meta,
        }.items()
    }
