"""Per-rank bodies of tests/test_engine.py (module level, so spawned ranks can import them).

Each body returns plain data (numbers, booleans, CPU tensors); the assertions live in the
test module, except where a check needs this rank's live state (bitwise snapshots).
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import fsdpx
import fsdpx.engine
import fsdpx.optimizer_step
from fsdpx.demo.gpt import shard_batch
from fsdpx.schedulers import build_scheduler
from fsdpx.zero import stage_plan
from tests.parity import global_batches, make_model

INJECT_PARAM = "blocks.0.mlp.up_proj.weight"  # (128, 32): every rank holds rows of it


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _named_sharded(engine: fsdpx.Engine) -> dict[str, torch.Tensor]:
    # Taken right after shard(), while the module holds its sharded parameters: these are
    # the tensors the optimizer steps, whatever the module holds later.
    return dict(engine.module.named_parameters())


def _gather(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in named.items()
    }


def _my_batch(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world = dist.get_rank(), dist.get_world_size()
    return shard_batch(x, rank, world), shard_batch(y, rank, world)


def scheduled_lrs(cfg: fsdpx.Config, steps: int) -> list[float]:
    """The lr of cfg's schedule after 0, 1, ..., steps scheduler steps (a standalone one)."""
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.optimizer.lr)
    sched = build_scheduler(probe, cfg.scheduler)
    assert sched is not None
    lrs = [sched.get_last_lr()[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
        for _ in range(steps):
            sched.step()
            lrs.append(sched.get_last_lr()[0])
    return lrs


def run_parts(
    rank: int, world_size: int, parts: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]
) -> dict[str, tuple[str, Any]]:
    """Run several bodies in one spawn; each part's result is ("ok", value) or
    ("error", traceback), so one failing part does not hide the others (unless it leaves
    a collective unmatched, which then times out)."""
    out: dict[str, tuple[str, Any]] = {}
    for name, (fn, args) in parts.items():
        try:
            out[name] = ("ok", fn(rank, world_size, *args))
        except Exception:
            out[name] = ("error", traceback.format_exc())
    return out


# --- 1. fp16 loss scaler ----------------------------------------------------------------


def _snapshot(engine: fsdpx.Engine, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    snap = {f"param/{n}": _local(p) for n, p in named.items()}
    for n, p in named.items():
        for key, value in engine.optimizer.state.get(p, {}).items():
            snap[f"state/{n}/{key}"] = _local(value)
    return snap


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def fp16_skip_body(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Train each case, writing an inf into one gradient shard on rank 1 only at the
    optimizer steps in case["inject"]; record what every step did on this rank."""
    out = {}
    for name, case in cases.items():
        cfg = fsdpx.Config.from_dict(case["cfg"])
        engine = fsdpx.shard(make_model(), cfg)
        named = _named_sharded(engine)
        gas = cfg.gradient_accumulation_steps
        records = []
        for step, micro in enumerate(global_batches(case["steps"], gas)):
            for i, (x, y) in enumerate(micro):
                loss = engine(*_my_batch(x, y))
                engine.backward(loss)
                if i < gas - 1:
                    assert engine.step() is None
            injected = False
            if step in case["inject"] and rank == 1:
                grad = named[INJECT_PARAM].grad
                assert isinstance(grad, DTensor), type(grad)
                with torch.no_grad():
                    grad.to_local()[0, 0] = float("inf")
                injected = bool(torch.isinf(grad.to_local()).any())
            before = _snapshot(engine, named)
            lr_before = engine.get_lr()
            result = engine.step()
            assert result is not None
            after = _snapshot(engine, named)
            records.append(
                {
                    "injected": injected,
                    "skipped": result.skipped,
                    "result_scale": result.loss_scale,
                    "scale_after": engine.loss_scale,
                    "skipped_steps": engine.skipped_steps,
                    "global_steps": engine.global_steps,
                    "lr_before": lr_before,
                    "lr_after": engine.get_lr(),
                    "unchanged": _bitwise_equal(before, after),
                    "params_unchanged": all(
                        torch.equal(before[k], after[k]) for k in before if k.startswith("param/")
                    ),
                    "had_state": any(k.startswith("state/") for k in before),
                    "loss": float(engine.all_reduce_mean(loss.detach().float())),
                }
            )
        # The lr a scheduler reaches when stepped once per applied (not skipped) step.
        applied = sum(not r["skipped"] for r in records)
        out[name] = {
            "records": records,
            "applied": applied,
            "expected_lrs": scheduled_lrs(cfg, len(records)),
            "sched_last_epoch": engine.lr_scheduler.last_epoch,
        }
    return out


def _no_unscale(params: Any, inv_scale: float) -> None:
    pass


def fp16_vs_fp32_body(
    rank: int, world_size: int, cases: dict[str, dict[str, Any]], steps: int
) -> dict[str, Any]:
    """Losses, grad norms and final parameters of each case; a case with "broken": True
    runs with the engine's unscale replaced by a no-op (to prove the check can fail)."""
    out = {}
    for name, case in cases.items():
        ctx = (
            patched(fsdpx.optimizer_step, "unscale_grads_", _no_unscale)
            if case.get("broken")
            else contextlib.nullcontext()
        )
        with ctx:
            cfg = fsdpx.Config.from_dict(case["cfg"])
            engine = fsdpx.shard(make_model(), cfg)
            named = _named_sharded(engine)
            losses, norms, skipped, scales = [], [], [], []
            for micro in global_batches(steps, cfg.gradient_accumulation_steps):
                step_losses = []
                for x, y in micro:
                    loss = engine(*_my_batch(x, y))
                    engine.backward(loss)
                    result = engine.step()
                    step_losses.append(float(engine.all_reduce_mean(loss.detach().float())))
                assert result is not None
                losses.append(sum(step_losses) / len(step_losses))
                norms.append(result.grad_norm)
                skipped.append(result.skipped)
                scales.append(result.loss_scale)
            out[name] = {
                "losses": losses,
                "norms": norms,
                "skipped": skipped,
                "scales": scales,
                "params": _gather(named),
            }
    return out


# --- 2. accumulation trap ---------------------------------------------------------------


def _never_reshard_after_backward(model: Any, zero: Any, *, is_boundary: bool) -> None:
    """fsdpx.zero.prepare_micro_step without the fix: resharding stays off at the boundary."""
    plan = stage_plan(zero)
    model.set_requires_gradient_sync(plan.sync_grads_every_micro_step or is_boundary)
    if zero.stage != 3:
        model.set_reshard_after_backward(False)


def stale_params_body(
    rank: int, world_size: int, cfg_dict: dict[str, Any], steps: int
) -> dict[str, list[dict[str, Any]]]:
    """Before every micro-step forward, the engine's logits and those of a plain model
    holding the gathered current (optimizer-updated) parameters; once with fsdpx's
    prepare_micro_step ("fixed") and once with the unfixed one ("broken")."""
    variants: dict[str, Callable[..., None]] = {
        "fixed": fsdpx.engine.prepare_micro_step,
        "broken": _never_reshard_after_backward,
    }
    out = {}
    for variant, fn in variants.items():
        with patched(fsdpx.engine, "prepare_micro_step", fn):
            cfg = fsdpx.Config.from_dict(cfg_dict)
            engine = fsdpx.shard(make_model(), cfg)
            named = _named_sharded(engine)
            plain = make_model()
            records = []
            for step, micro in enumerate(global_batches(steps, cfg.gradient_accumulation_steps)):
                for i, (x, y) in enumerate(micro):
                    xl, yl = _my_batch(x, y)
                    plain.load_state_dict(_gather(named))
                    with torch.no_grad():
                        expected = plain(xl)
                    logits = engine(xl)
                    loss = F.cross_entropy(logits.flatten(0, 1), yl.flatten())
                    records.append(
                        {
                            "step": step,
                            "micro": i,
                            "logits": logits.detach().clone(),
                            "expected": expected,
                        }
                    )
                    engine.backward(loss)
                    engine.step()
            out[variant] = records
    return out


# --- 3. clipping ------------------------------------------------------------------------


def clip_body(rank: int, world_size: int, cases: dict[str, dict[str, Any]], steps: int) -> Any:
    """Per step: fsdpx.total_grad_norm before engine.step and StepResult.grad_norm; then
    the gathered final parameters."""
    out = {}
    for name, cfg_dict in cases.items():
        cfg = fsdpx.Config.from_dict(cfg_dict)
        engine = fsdpx.shard(make_model(), cfg)
        named = _named_sharded(engine)
        direct, reported = [], []
        for micro in global_batches(steps, cfg.gradient_accumulation_steps):
            for i, (x, y) in enumerate(micro):
                engine.backward(engine(*_my_batch(x, y)))
                if i == len(micro) - 1:
                    direct.append(float(fsdpx.total_grad_norm(named.values())))
                result = engine.step()
            assert result is not None
            reported.append(result.grad_norm)
        out[name] = {"direct": direct, "reported": reported, "params": _gather(named)}
    return out


# --- 5. user-facing errors of shard() ----------------------------------------------------


def shard_errors_body(rank: int, world_size: int) -> bool:
    import pytest
    from torch.distributed.fsdp import FSDPModule

    from fsdpx.config import MeshConfig

    model = make_model()
    with pytest.raises(ValueError, match=r"optimizer built before fsdpx\.shard .* pass optimizer"):
        fsdpx.shard(model, fsdpx.Config(), optimizer=torch.optim.AdamW(model.parameters()))
    assert not isinstance(model, FSDPModule), "shard() changed the model before failing"

    with pytest.raises(
        ValueError, match=r"optimizer must be None .* got 'adam'.*cfg\.optimizer\.type"
    ):
        fsdpx.shard(model, fsdpx.Config(), optimizer="adam")

    plain_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(plain_opt, step_size=1)
    with pytest.raises(ValueError, match=r"lr_scheduler must be None .* or a callable"):
        fsdpx.shard(model, fsdpx.Config(), lr_scheduler=sched)
    assert not isinstance(model, FSDPModule), "shard() changed the model before failing"

    with pytest.raises(ValueError, match=r"= 3 do not equal the world size 2"):
        fsdpx.shard(model, fsdpx.Config(mesh=MeshConfig(dp_replicate=3, dp_shard=1)))
    with pytest.raises(ValueError, match=r"cannot infer mesh\.dp_shard: world size 2"):
        fsdpx.shard(model, fsdpx.Config(mesh=MeshConfig(dp_replicate=3)))
    with pytest.raises(ValueError, match=r"= 4 do not equal the world size 2"):
        fsdpx.ParallelDims.from_config(MeshConfig(dp_replicate=2, dp_shard=2), world_size=2)
    # Layout errors of tensor / pipeline parallelism also come before the model changes.
    with pytest.raises(ValueError, match=r"pipeline parallelism needs loss_fn"):
        fsdpx.shard(model, fsdpx.Config(mesh=MeshConfig(pp=2)))
    assert not isinstance(model, FSDPModule), "shard() changed the model before failing"

    # The accepted forms still work on the same (untouched) model.
    engine = fsdpx.shard(
        model,
        fsdpx.Config(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1),
    )
    assert isinstance(engine.optimizer, torch.optim.SGD)
    assert isinstance(engine.lr_scheduler, torch.optim.lr_scheduler.StepLR)
    assert engine.lr_scheduler.optimizer is engine.optimizer
    return True


# --- 6. train_batch and DeepSpeed counters ----------------------------------------------


def train_batch_body(
    rank: int, world_size: int, cfg_dict: dict[str, Any], steps: int
) -> dict[str, Any]:
    """Engine A trains with train_batch, engine B with the manual backward/step loop on
    the same micro-batches; B records the counters around every call."""
    cfg = fsdpx.Config.from_dict(cfg_dict)
    gas = cfg.gradient_accumulation_steps
    batches = global_batches(steps, gas)

    a = fsdpx.shard(make_model(), cfg)
    a_named = _named_sharded(a)
    a_losses = []
    for micro in batches:
        a_losses.append(float(a.train_batch(iter([_my_batch(x, y) for x, y in micro]))))
    a_counters = (a.global_steps, a.micro_steps, a.get_lr())

    b = fsdpx.shard(make_model(), cfg)
    b_named = _named_sharded(b)
    b_losses, trace = [], []
    for micro in batches:
        total = 0.0
        for x, y in micro:
            before = {
                "micro_steps": b.micro_steps,
                "global_steps": b.global_steps,
                "boundary": b.is_gradient_accumulation_boundary(),
                "lr": b.get_lr(),
            }
            loss = b(*_my_batch(x, y))
            b.backward(loss)
            result = b.step()
            total += float(b.all_reduce_mean(loss.detach().float()))
            trace.append(
                {
                    "before": before,
                    "micro_steps": b.micro_steps,
                    "global_steps": b.global_steps,
                    "lr": b.get_lr(),
                    "optimizer_lrs": [g["lr"] for g in b.optimizer.param_groups],
                    "result": None
                    if result is None
                    else (result.global_step, result.skipped, result.grad_norm, result.loss_scale),
                }
            )
        b_losses.append(total / gas)

    expected_lrs = scheduled_lrs(cfg, steps)
    return {
        "a_losses": a_losses,
        "a_counters": a_counters,
        "a_params": _gather(a_named),
        "b_losses": b_losses,
        "b_params": _gather(b_named),
        "trace": trace,
        "expected_lrs": expected_lrs,
    }
