"""Generate the DeepSpeed checkpoint fixtures of tests/data/deepspeed_ckpt/ (issue 17).

Runs in a separate environment with DeepSpeed installed (never fsdpx's): real DeepSpeed
training on the CPU accelerator, 2 ranks over gloo, saving a real checkpoint mid-run and
recording how DeepSpeed's own run continues from it. The importer's tests compare
against these records without importing DeepSpeed.

    DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=/tmp/ds_ext \
        /tmp/dsvenv/bin/python scripts/make_deepspeed_fixtures.py tests/data/deepspeed_ckpt

For each case it writes `<case>/` (DeepSpeed's own checkpoint folder: `latest`,
`global_step4/*.pt`), `<case>/zero_to_fp32.safetensors` (DeepSpeed's zero_to_fp32 output
for that checkpoint: the fp32 weights an import must reproduce bitwise),
`<case>/continued.safetensors` (zero_to_fp32 of a checkpoint saved after CONTINUE more
steps) and `<case>/record.json` (config, versions, per-micro-batch losses before and
after the save). ZeRO stage 0 has no ZeRO files for zero_to_fp32 to read: its cases hold
`<case>/fp32_masters.safetensors` instead, the fp32 master weights DeepSpeed's optimizer
held at the save (named by the worker, which knows which module parameter each master
belongs to), and `continued.safetensors` the same after CONTINUE more steps.
`zero3_universal/` and `zero1_universal/` are `ds_to_universal` applied to zero3_bf16's
and zero1_fp32's checkpoints; their resume references are those cases' records.

    ... make_deepspeed_fixtures.py tests/data/deepspeed_ckpt zero0_fp32 zero0_fp16

(re)makes only the named cases (a universal case converts its source case's committed
checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STEPS = 4
"""Optimizer steps before the checkpoint."""
CONTINUE = 3
"""Optimizer steps DeepSpeed takes after it (the resume reference)."""
WORLD = 2


def _optimizer(lr: float) -> dict[str, Any]:
    # torch_adam: torch.optim.AdamW inside DeepSpeed (FusedAdam needs a JIT op build).
    return {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.99], "torch_adam": True}}


CASES: dict[str, dict[str, Any]] = {
    "zero1_fp32": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "optimizer": _optimizer(1e-2),
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
        },
    },
    "zero2_fp16": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 2},
        "optimizer": _optimizer(1e-2),
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 1e-2,
                "warmup_num_steps": 3,
                "total_num_steps": 20,
            },
        },
    },
    "zero3_bf16": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True},
        "optimizer": _optimizer(1e-2),
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {"warmup_num_steps": 3, "total_num_steps": 20},
        },
    },
    # Stage 0: plain torch AdamW (fp32) / DeepSpeed's FP16_UnfusedOptimizer around it
    # (fp16: per-parameter fp32 masters), the whole optimizer state in the model states file.
    "zero0_fp32": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "optimizer": _optimizer(1e-2),
        "scheduler": {
            "type": "OneCycle",
            "params": {
                "cycle_min_lr": 1e-3,
                "cycle_max_lr": 1e-2,
                "cycle_first_step_size": 3,
                "cycle_momentum": False,
            },
        },
    },
    "zero0_fp16": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 0},
        "fp16": {"enabled": True, "loss_scale": 256},
        "optimizer": _optimizer(1e-2),
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
        },
    },
    # Stage 0 fp16 with DeepSpeed's default Adam on a GPU: FusedAdam inside FP16_Optimizer,
    # whose masters are one flat fp32 tensor per param group (`fp32_groups_flat`). FusedAdam
    # is CUDA-only, so this case runs on one GPU (NCCL, world size 1; see CUDA_CASES).
    "zero0_fp16_fused": {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 0},
        "fp16": {"enabled": True, "loss_scale": 256},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.9, 0.99]}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
        },
    },
}
GROUPED = {"zero1_fp32", "zero3_bf16", "zero0_fp32", "zero0_fp16", "zero0_fp16_fused"}
"""Cases built with two param groups (model_parameters=param_groups(model))."""
CUDA_CASES = {"zero0_fp16_fused"}
"""Cases that need a CUDA device: one rank, NCCL, DS_ACCELERATOR=cuda (run on a GPU host:
`TORCH_CUDA_ARCH_LIST=9.0 python scripts/make_deepspeed_fixtures.py DEST zero0_fp16_fused`;
DeepSpeed JIT-builds FusedAdam on first use)."""


def worker(case: str, out: Path) -> None:
    """One rank of a DeepSpeed run (under torchrun)."""
    import deepspeed
    import deepspeed.comm.torch
    import torch
    import torch.distributed as dist

    # DeepSpeed's CPU backend JIT-builds a shared-memory all-reduce op on first use (minutes
    # of compiling); gloo's collectives give the same sums for these tiny tensors.
    # (`deepspeed.comm.torch` as an attribute is torch itself, re-exported: use sys.modules.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

    sys.path.insert(0, str(HERE.parent / "tests"))
    from ds_import_model import make_model, micro_batch, param_groups

    cuda = case in CUDA_CASES
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = json.loads(json.dumps(CASES[case]))
    model = make_model()
    params = param_groups(model) if case in GROUPED else model.parameters()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    gas = config["gradient_accumulation_steps"]

    def run(first_step: int, steps: int) -> list[float]:
        losses = []
        for micro in range(first_step * gas, (first_step + steps) * gas):
            x, y = micro_batch(micro, rank, world)
            if cuda:
                x, y = x.cuda(), y.cuda()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        return losses

    before = run(0, STEPS)
    engine.save_checkpoint(str(out / case), client_state={"epoch": 1, "dropped": torch.ones(2)})
    if config["zero_optimization"]["stage"] == 0 and rank == 0:
        save_masters(engine, out / f"{case}.masters.safetensors")
    after = run(STEPS, CONTINUE)
    engine.save_checkpoint(str(out / f"{case}.continued"))
    if config["zero_optimization"]["stage"] == 0 and rank == 0:
        save_masters(engine, out / f"{case}.continued.safetensors")
    if rank == 0:
        record = {
            "case": case,
            "config": CASES[case],
            "grouped": case in GROUPED,
            "world_size": world,
            "steps": STEPS,
            "continue": CONTINUE,
            "losses_before": before,
            "losses_after": after,
            "global_steps": engine.global_steps,
            "skipped_steps": engine.skipped_steps,
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
        }
        (out / f"{case}.record.json").write_text(json.dumps(record, indent=1) + "\n")
    dist.barrier()


def save_masters(engine: Any, dest: Path) -> None:
    """Stage 0: the fp32 masters DeepSpeed's optimizer holds, under their module names,
    plus the buffers as fp32 (what zero_to_fp32 gives for the other stages)."""
    from safetensors.torch import save_file

    names = {id(p): n for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    if hasattr(opt, "fp32_groups_flat"):  # FP16_Optimizer: one flat master per group
        from torch._utils import _unflatten_dense_tensors

        pairs = [
            (lp, hp)
            for lps, flat in zip(opt.fp16_groups, opt.fp32_groups_flat, strict=True)
            for lp, hp in zip(lps, _unflatten_dense_tensors(flat, lps), strict=True)
        ]
    elif hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer: per-parameter masters
        pairs = [
            (lp, hp)
            for lps, hps in zip(opt.fp16_groups, opt.fp32_groups, strict=True)
            for lp, hp in zip(lps, hps, strict=True)
        ]
    else:  # fp32: the optimizer steps the module's parameters themselves
        pairs = [(p, p) for g in opt.param_groups for p in g["params"]]
    out = {names[id(lp)]: hp.detach().float().cpu().clone() for lp, hp in pairs}
    for n, b in engine.module.named_buffers():
        out[n] = b.detach().float().cpu().clone()
    save_file(out, str(dest))


def fp32_reference(ckpt: Path, dest: Path) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file

    sd = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(dest))


def _free_port() -> int:
    # Other jobs on the machine may hold a fixed port.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


UNIVERSAL = {"zero3_universal": "zero3_bf16", "zero1_universal": "zero1_fp32"}
"""`ds_to_universal` cases: name -> the case whose checkpoint is converted."""


def main(dest: Path, only: list[str]) -> None:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.setdefault("TORCH_EXTENSIONS_DIR", tempfile.mkdtemp(prefix="ds_ext_"))
    work = Path(tempfile.mkdtemp(prefix="ds_fixtures_"))
    torchrun = Path(sys.executable).parent / "torchrun"
    unknown = set(only) - set(CASES) - set(UNIVERSAL)
    if unknown:
        sys.exit(f"unknown cases {sorted(unknown)}; known: {sorted(CASES) + sorted(UNIVERSAL)}")
    cases = [c for c in CASES if not only or c in only]
    for case in cases:
        cuda = case in CUDA_CASES
        subprocess.run(
            [
                str(torchrun),
                f"--nproc_per_node={1 if cuda else WORLD}",
                f"--master_port={_free_port()}",
                __file__,
                "--worker",
                case,
                str(work),
            ],
            check=True,
            env={**env, "DS_ACCELERATOR": "cuda"} if cuda else env,
        )
    dest.mkdir(parents=True, exist_ok=True)
    for case in cases:
        target = dest / case
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(work / case, target, ignore=shutil.ignore_patterns("zero_to_*.py"))
        if CASES[case]["zero_optimization"]["stage"] == 0:
            shutil.copy(work / f"{case}.masters.safetensors", target / "fp32_masters.safetensors")
            shutil.copy(work / f"{case}.continued.safetensors", target / "continued.safetensors")
        else:
            fp32_reference(work / case, target / "zero_to_fp32.safetensors")
            fp32_reference(work / f"{case}.continued", target / "continued.safetensors")
        shutil.copy(work / f"{case}.record.json", target / "record.json")
    for name, source in UNIVERSAL.items():
        if not only or name in only:
            universal(dest / source, dest / name, env)
    shutil.rmtree(work)


def universal(src: Path, uni: Path, env: dict[str, str]) -> None:
    """ds_to_universal (DeepSpeed's own converter, run as DeepSpeed documents)."""
    tag = (src / "latest").read_text().strip()
    shutil.rmtree(uni, ignore_errors=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "deepspeed.checkpoint.ds_to_universal",
            "--input_folder",
            str(src / tag),
            "--output_folder",
            str(uni / f"{tag}_universal"),
            "--num_extract_workers",
            "1",
            "--num_merge_workers",
            "1",
            # ZeRO 1/2 sources: DeepSpeed asks for Megatron's universal_checkpoint_info;
            # this flag (documented for other models) adds its default in memory only.
            "--inject_missing_state",
        ],
        check=True,
        env=env,
    )
    (uni / "latest_universal").write_text(f"{tag}_universal")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker(sys.argv[2], Path(sys.argv[3]))
    elif len(sys.argv) >= 2 and sys.argv[1] != "--worker":
        main(Path(sys.argv[1]), sys.argv[2:])
    else:
        sys.exit(__doc__)
