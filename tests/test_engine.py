"""The engine end to end: fp16 loss scaling and step skipping, the stage-1 accumulation
trap, gradient clipping, world size 1 without a launcher, shard()'s errors, train_batch
and DeepSpeed's counters. Multi-rank parts run through tests/dist.py; rank bodies live in
tests/engine_bodies.py. Checks that could pass vacuously are paired with a broken variant
that must fail them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpx.config import SchedulerConfig
from fsdpx.demo.gpt import shard_batch
from fsdpx.schedulers import build_scheduler
from tests import engine_bodies
from tests.dist import run_ranks
from tests.parity import global_batches, make_model

REPO = Path(__file__).resolve().parent.parent
LR = 1e-2
FP16 = {"param_dtype": "fp16", "reduce_dtype": "fp32"}
WARMUP = {
    "type": "WarmupLR",
    "warmup_min_lr": LR / 2,
    "warmup_max_lr": LR,
    "warmup_num_steps": 20,
    "warmup_type": "linear",
}


def reference(
    cfg: dict[str, Any], steps: int, dp: int, *, clip: float | None = None
) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, plain torch: the global-batch losses, the pre-clip gradient norms and
    the final parameters, each data-parallel chunk's loss weighted 1 / (gas * dp)."""
    gas = cfg.get("gradient_accumulation_steps", 1)
    ocfg = {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0, **cfg.get("optimizer", {})}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks do
    try:
        model = make_model()
        params = list(model.parameters())
        if ocfg["type"] == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=ocfg["lr"])
        else:
            opt = torch.optim.AdamW(params, lr=ocfg["lr"], weight_decay=ocfg["weight_decay"])
        sched = None
        if "scheduler" in cfg:
            sched = build_scheduler(opt, SchedulerConfig(**cfg["scheduler"]))
        losses, norms = [], []
        for micro in global_batches(steps, gas):
            chunk_losses = []
            for x, y in micro:
                for r in range(dp):
                    loss = model(shard_batch(x, r, dp), shard_batch(y, r, dp))
                    (loss / (gas * dp)).backward()
                    chunk_losses.append(float(loss.detach()))
            losses.append(sum(chunk_losses) / len(chunk_losses))
            norms.append(
                float(torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf")))
            )
            opt.step()
            opt.zero_grad()
            if sched is not None:
                sched.step()
        return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)


def assert_params_close(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str, **tol: Any
) -> None:
    assert got.keys() == want.keys()
    for name, ref in want.items():
        torch.testing.assert_close(got[name], ref, **tol, msg=lambda m, n=name: f"{what}: {n}: {m}")


RankResults = list[dict[str, tuple[str, Any]]]


@pytest.fixture(scope="module")
def two_ranks() -> RankResults:
    """Every 2-rank part of this module in one spawn (start-up dominates their cost)."""
    parts = {
        "shard_errors": (engine_bodies.shard_errors_body, ()),
        "fp16_skip": (
            engine_bodies.fp16_skip_body,
            ({n: {k: c[k] for k in ("cfg", "steps", "inject")} for n, c in SKIP_CASES.items()},),
        ),
        "fp16_vs_fp32": (engine_bodies.fp16_vs_fp32_body, (FP16_CASES, FP16_STEPS)),
        "stale_params": (engine_bodies.stale_params_body, (TRAP_CFG, 3)),
        "clip": (engine_bodies.clip_body, (CLIP_CASES_2, CLIP_STEPS)),
        "train_batch": (engine_bodies.train_batch_body, (TRAIN_BATCH_CFG, TRAIN_BATCH_STEPS)),
    }
    return run_ranks(engine_bodies.run_parts, 2, (parts,))


def part(results: RankResults, name: str) -> list[Any]:
    """One part's per-rank values; fails the test with the rank's traceback if it raised."""
    values = []
    for rank, per_rank in enumerate(results):
        status, value = per_rank[name]
        if status != "ok":
            pytest.fail(f"part {name!r} failed on rank {rank}:\n{value}", pytrace=False)
        values.append(value)
    return values


def assert_not_close(got: Any, want: Any, **tol: Any) -> None:
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got, want, **tol)


# --- 1. fp16 loss scaling ----------------------------------------------------------------

SKIP_CASES = {
    # hysteresis 2 (the default): the first overflow only spends the budget, the second
    # halves the scale.
    "hysteresis2_stage3": {
        "cfg": {
            "zero": {"stage": 3},
            "precision": FP16,
            "fp16": {"initial_scale_power": 8},
            "optimizer": {"type": "adamw", "lr": LR},
            "scheduler": WARMUP,
        },
        "steps": 6,
        "inject": [2, 4],
        "result_scale": [256.0, 256.0, 256.0, 256.0, 256.0, 128.0],
        "scale_after": [256.0, 256.0, 256.0, 256.0, 128.0, 128.0],
    },
    # hysteresis 1 halves at once; window 2 also doubles the scale on clean steps 1 and 4.
    "hysteresis1_stage1_gas2": {
        "cfg": {
            "zero": {"stage": 1},
            "gradient_accumulation_steps": 2,
            "precision": FP16,
            "fp16": {"initial_scale_power": 8, "hysteresis": 1, "window": 2},
            "optimizer": {"type": "adamw", "lr": LR},
            "scheduler": WARMUP,
        },
        "steps": 5,
        "inject": [2],
        "result_scale": [256.0, 256.0, 512.0, 256.0, 256.0],
        "scale_after": [256.0, 512.0, 256.0, 256.0, 512.0],
    },
    # A static scale, even 1, still skips an overflowing step (DeepSpeed's static scaler).
    "static1_stage2": {
        "cfg": {
            "zero": {"stage": 2},
            "precision": FP16,
            "fp16": {"static_scale": 1.0},
            "optimizer": {"type": "adamw", "lr": LR},
            "scheduler": WARMUP,
        },
        "steps": 3,
        "inject": [1],
        "result_scale": [1.0, 1.0, 1.0],
        "scale_after": [1.0, 1.0, 1.0],
    },
}


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere(two_ranks: RankResults) -> None:
    results = part(two_ranks, "fp16_skip")
    for name, case in SKIP_CASES.items():
        for rank, per_rank in enumerate(results):
            res = per_rank[name]
            recs = res["records"]
            where = f"{name} rank {rank}"
            skipped = [i in case["inject"] for i in range(case["steps"])]
            assert [r["injected"] for r in recs] == [s and rank == 1 for s in skipped], where
            assert [r["skipped"] for r in recs] == skipped, where
            assert [r["skipped_steps"] for r in recs] == [
                sum(skipped[: i + 1]) for i in range(len(skipped))
            ], where
            assert [r["global_steps"] for r in recs] == list(range(1, case["steps"] + 1)), where
            assert [r["result_scale"] for r in recs] == case["result_scale"], where
            assert [r["scale_after"] for r in recs] == case["scale_after"], where
            for i, r in enumerate(recs):
                if skipped[i]:
                    assert r["had_state"], f"{where} step {i}: no optimizer state to check"
                    assert r["unchanged"], f"{where} step {i}: skipped step changed state"
                    assert r["lr_after"] == r["lr_before"], f"{where} step {i}: lr stepped"
                else:
                    assert not r["params_unchanged"], f"{where} step {i}: step did nothing"
                assert torch.isfinite(torch.tensor(r["loss"])), where
            # The scheduler moved once per applied step, not per optimizer-step call.
            applied = res["applied"]
            assert applied == case["steps"] - len(case["inject"])
            assert res["sched_last_epoch"] == applied, where
            assert recs[-1]["lr_after"] == [res["expected_lrs"][applied]], where
            assert res["expected_lrs"][applied] != res["expected_lrs"][case["steps"]]


FP32_SGD = {
    "zero": {"stage": 3},
    "gradient_clipping": 1e6,  # only to have StepResult.grad_norm reported
    "optimizer": {"type": "sgd", "lr": 1.0},
}
FP16_SGD = {**FP32_SGD, "precision": FP16, "fp16": {"initial_scale_power": 8, "window": 2}}
FP16_STEPS = 6


FP16_CASES = {
    "fp32": {"cfg": FP32_SGD},
    "fp16": {"cfg": FP16_SGD},
    "fp16_no_unscale": {"cfg": FP16_SGD, "broken": True},
}


def test_fp16_training_tracks_fp32(two_ranks: RankResults) -> None:
    """SGD (unlike Adam) is not invariant to the gradient scale, so a missing or wrong
    unscale shows up in the trajectory; the no-unscale variant proves it."""
    results = part(two_ranks, "fp16_vs_fp32")
    ref_losses, ref_norms, ref_params = reference(FP32_SGD, FP16_STEPS, dp=2)
    loose = {"rtol": 2e-2, "atol": 2e-3}
    for res in results:
        fp32, fp16, broken = res["fp32"], res["fp16"], res["fp16_no_unscale"]
        # The fp32 engine run is the exact anchor...
        torch.testing.assert_close(torch.tensor(fp32["losses"]), torch.tensor(ref_losses))
        torch.testing.assert_close(torch.tensor(fp32["norms"]), torch.tensor(ref_norms))
        assert_params_close(fp32["params"], ref_params, "fp32 engine vs reference")
        # ...and fp16 with the scaler (no overflow, scale doubling every 2 steps) tracks it.
        assert fp16["skipped"] == [False] * FP16_STEPS
        assert fp16["scales"] == [256.0, 256.0, 512.0, 512.0, 1024.0, 1024.0]
        # Random tokens: the loss cannot fall much, but the parameters must move well
        # past the tolerance, or "close" would prove nothing.
        assert_not_close(dict(make_model().named_parameters()), ref_params, **loose)
        torch.testing.assert_close(torch.tensor(fp16["losses"]), torch.tensor(ref_losses), **loose)
        torch.testing.assert_close(torch.tensor(fp16["norms"]), torch.tensor(ref_norms), **loose)
        assert_params_close(fp16["params"], ref_params, "fp16 vs fp32", **loose)
        # Without unscaling the same comparison fails.
        # Without unscaling, the first norm is the scaled one and training diverges.
        torch.testing.assert_close(broken["norms"][0], 256.0 * ref_norms[0], **loose)
        assert_not_close(torch.tensor(broken["losses"]), torch.tensor(ref_losses), **loose)
        assert_not_close(broken["params"], ref_params, **loose)


# --- 2. the stage-1 accumulation trap ------------------------------------------------------


TRAP_CFG = {
    "zero": {"stage": 1},
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "adamw", "lr": LR},
}


def test_stage1_accumulation_forward_uses_updated_params(two_ranks: RankResults) -> None:
    """DESIGN.md section 3: resharding must be back on before the boundary backward, or the
    next forward runs on the pre-step gathered copy. The broken variant shows the check
    catches exactly that."""
    results = part(two_ranks, "stale_params")
    for rank, res in enumerate(results):
        for rec in res["fixed"]:
            torch.testing.assert_close(
                rec["logits"],
                rec["expected"],
                msg=lambda m, r=rec, rank=rank: (
                    f"rank {rank} step {r['step']} micro {r['micro']}: {m}"
                ),
            )
        broken = res["broken"]
        assert len(broken) == 6
        for rec in broken:
            if rec["step"] == 0:  # nothing updated yet: still equal
                torch.testing.assert_close(rec["logits"], rec["expected"])
            else:  # every later forward ran on stale parameters
                assert_not_close(rec["logits"], rec["expected"])


# --- 3. gradient clipping ------------------------------------------------------------------

CLIP = 0.05
CLIP_STEPS = 3


def test_clip_grad_norm_scales_gradients_like_torch() -> None:
    """Single process, plain tensors: the same norm and the same clipped gradients as
    torch.nn.utils.clip_grad_norm_ (fsdpx once handed torch the gradients instead of the
    parameters, which clipped nothing)."""
    from fsdpx.clip import clip_grad_norm_

    g = torch.Generator().manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(3)]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, theirs, strict=True):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(ours, 0.5)
    torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(theirs, 0.5))
    assert norm > 1.0  # so clipping happened
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def _check_clip(results: list[dict[str, Any]], cases: dict[str, dict[str, Any]], dp: int) -> None:
    for name, cfg in cases.items():
        ref_losses, ref_norms, ref_params = reference(cfg, CLIP_STEPS, dp, clip=CLIP)
        assert min(ref_norms) > 4 * CLIP, "clipping must actually engage"
        _, _, unclipped = reference(cfg, CLIP_STEPS, dp)
        assert_not_close(unclipped, ref_params)  # so the comparison below can fail
        for rank, res in enumerate(results):
            got = res[name]
            what = f"{name} rank {rank}"
            torch.testing.assert_close(
                torch.tensor(got["direct"]),
                torch.tensor(ref_norms),
                msg=lambda m, w=what: f"{w} direct: {m}",
            )
            torch.testing.assert_close(
                torch.tensor(got["reported"]),
                torch.tensor(ref_norms),
                msg=lambda m, w=what: f"{w} reported: {m}",
            )
            assert_params_close(got["params"], ref_params, what)


def _clip_cfg(**extra: Any) -> dict[str, Any]:
    return {
        "zero": {"stage": 3},
        "gradient_clipping": CLIP,
        "optimizer": {"type": "sgd", "lr": 1.0},
        **extra,
    }


CLIP_CASES_2 = {
    "stage3_sgd": _clip_cfg(),
    "stage3_adamw_gas2": _clip_cfg(
        optimizer={"type": "adamw", "lr": LR}, gradient_accumulation_steps=2
    ),
}


def test_clipping_stage3_matches_reference(two_ranks: RankResults) -> None:
    _check_clip(part(two_ranks, "clip"), CLIP_CASES_2, dp=2)


def test_clipping_hsdp_2x2_matches_reference() -> None:
    cases = {
        "hsdp2x2_sgd_gas2": _clip_cfg(
            mesh={"dp_replicate": 2, "dp_shard": 2}, gradient_accumulation_steps=2
        )
    }
    _check_clip(run_ranks(engine_bodies.clip_body, 4, (cases, CLIP_STEPS)), cases, dp=4)


# --- 4. world size 1 without a launcher ----------------------------------------------------

WS1_SCRIPT = """
import json, sys
import torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[1])
import fsdpx
from tests.parity import global_batches, make_model

engine = fsdpx.shard(make_model(), fsdpx.Config())
assert torch.distributed.get_world_size() == 1
losses = []
for micro in global_batches(3, 1):
    for x, y in micro:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
torch.save({n: p.full_tensor() for n, p in engine.module.named_parameters()}, sys.argv[2])
print(json.dumps(losses))
"""
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")


def test_world_size_1_without_launcher_matches_plain_adamw() -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCHER_VARS and k != "MASTER_PORT" and not k.startswith("TORCHELASTIC")
    }
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "params.pt")
        proc = subprocess.run(
            [sys.executable, "-c", WS1_SCRIPT, str(REPO), out],
            env=env,
            cwd=tmp,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        losses = json.loads(proc.stdout.strip().splitlines()[-1])
        params = torch.load(out)
    # fsdpx.Config() defaults: AdamW, lr 1e-3, betas (0.9, 0.999), eps 1e-8, no decay.
    ref_losses, _, ref_params = reference({}, 3, dp=1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses))
    assert_params_close(params, ref_params, "world size 1")


# --- 5. shard()'s user-facing errors ------------------------------------------------------


def test_shard_rejects_bad_arguments_with_actionable_messages(two_ranks: RankResults) -> None:
    # The pytest.raises checks run in the ranks (engine_bodies.shard_errors_body): shard()
    # starts a process group, and tp/pp > 1 need world size 2.
    assert part(two_ranks, "shard_errors") == [True, True]


# --- 6. train_batch and DeepSpeed's counters ----------------------------------------------


TRAIN_BATCH_CFG = {
    "zero": {"stage": 2},
    "gradient_accumulation_steps": 2,
    "optimizer": {"type": "adamw", "lr": LR},
    "scheduler": WARMUP,
}
TRAIN_BATCH_STEPS = 3


def test_train_batch_equals_manual_loop_and_counters_follow_deepspeed(
    two_ranks: RankResults,
) -> None:
    gas, steps, cfg = 2, TRAIN_BATCH_STEPS, TRAIN_BATCH_CFG
    results = part(two_ranks, "train_batch")
    ref_losses, _, ref_params = reference(cfg, steps, dp=2)
    for rank, res in enumerate(results):
        lrs = res["expected_lrs"]
        # train_batch returns the global-batch mean loss, the manual loop's value.
        torch.testing.assert_close(torch.tensor(res["a_losses"]), torch.tensor(res["b_losses"]))
        torch.testing.assert_close(torch.tensor(res["a_losses"]), torch.tensor(ref_losses))
        assert_params_close(res["a_params"], res["b_params"], f"rank {rank} a vs b")
        assert_params_close(res["a_params"], ref_params, f"rank {rank} vs reference")
        assert res["a_counters"] == (steps, steps * gas, [lrs[steps]])
        for k, t in enumerate(res["trace"]):
            boundary = (k + 1) % gas == 0
            assert t["before"] == {
                "micro_steps": k,
                "global_steps": k // gas,
                "boundary": boundary,
                "lr": [lrs[k // gas]],
            }, k
            assert t["micro_steps"] == k + 1, k
            assert t["global_steps"] == (k + 1) // gas, k
            assert t["lr"] == t["optimizer_lrs"] == [lrs[(k + 1) // gas]], k
            if boundary:
                assert t["result"] == ((k + 1) // gas, False, None, 1.0), k
            else:
                assert t["result"] is None, k
    # WarmupLR's first two values are both warmup_min_lr (DeepSpeed's f(-1) and f(0)).
    assert len(set(lrs[1:])) == steps, "the schedule must change the lr every step"
