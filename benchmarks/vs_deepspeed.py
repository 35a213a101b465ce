"""Step time of one DeepSpeed training script run by DeepSpeed and by fsdpx, side by side.

The same script body runs twice per step: once with ``deepspeed.initialize`` and once with
``fsdpx.deepspeed.initialize``, from the same DeepSpeed JSON config, the same model built from
the same seed (the GPT of ``fsdpx/demo/gpt.py``) and the same micro-batches. DeepSpeed is
never a dependency of fsdpx: this script needs it installed beside fsdpx and stops with a
message if it is not.

Run from the repository root, on one GPU (or under torchrun for several)::

    python benchmarks/vs_deepspeed.py --stages 1 2 3 --steps 20 --warmup 5
    DS_ACCELERATOR=cpu python benchmarks/vs_deepspeed.py --tiny --steps 3 --warmup 1  # CPU smoke

What is timed
-------------
One optimizer step per engine: ``loss = cross_entropy(engine(x).float(), y)``,
``engine.backward(loss)``, ``engine.step()``. Steps are interleaved (DeepSpeed, fsdpx, fsdpx, DeepSpeed, ...: the order
flips every step) so that machine noise hits both alike; each is timed with
``time.perf_counter`` after a device synchronize and a barrier, and a step's time is the
slowest rank's. The table gives the median per side and the ratio fsdpx / DeepSpeed (below 1:
fsdpx is faster), plus the largest difference between the two sides' losses over the timed
steps (both start from the same weights and see the same data, so this checks that they did
the same work; bf16 rounding may differ between the engines), and the loss at the first and
last timed step (training happens).

Optimizer (``--optimizer``)
---------------------------
* ``torch`` (default): both engines get the same callable,
  ``torch.optim.AdamW(params, fused=True)`` on CUDA (foreach on CPU) — the difference is the
  engine alone, not the Adam kernel, and DeepSpeed needs no JIT op build.
* ``config``: ``"optimizer": {"type": "AdamW"}`` in the JSON: each engine uses its own fused
  Adam (DeepSpeed's FusedAdam, JIT-built on first use; fsdpx's ``adam_step``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdpx.demo.gpt import GPT, GPTConfig  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps per side")
    p.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps per side")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--optimizer", choices=["torch", "config"], default="torch")
    p.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model (smoke test)")
    args = p.parse_args(argv)
    if args.tiny:
        args.n_layer, args.n_embd, args.n_head, args.seq, args.vocab = 2, 64, 4, 32, 256
        args.batch = min(args.batch, 2)
    return args


def init_process_group() -> torch.device:
    """One process group both engines use: torchrun's, or a world of one."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def ds_config(args: argparse.Namespace, stage: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if args.optimizer == "config":
        cfg["optimizer"] = {
            "type": "AdamW",
            "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        }
    return cfg


def torch_adamw(device: torch.device) -> Callable[[Any], torch.optim.Optimizer]:
    fused = device.type == "cuda"

    def build(params: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=fused
        )

    return build


def build_engine(
    initialize: Callable[..., Any], args: argparse.Namespace, stage: int, device: torch.device
) -> Any:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(
            GPTConfig(
                vocab_size=args.vocab,
                block_size=args.seq,
                n_layer=args.n_layer,
                n_head=args.n_head,
                n_embd=args.n_embd,
            )
        )
    optimizer = torch_adamw(device) if args.optimizer == "torch" else None
    engine, *_ = initialize(
        model=model,
        model_parameters=model.parameters(),
        optimizer=optimizer,
        config=ds_config(args, stage),
    )
    return engine


def micro_batches(args: argparse.Namespace, device: torch.device) -> Iterator[tuple[Any, Any]]:
    g = torch.Generator().manual_seed(1000 + dist.get_rank())
    while True:
        x = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        yield x[:, :-1].to(device), x[:, 1:].to(device)


def timed_step(engine: Any, batch: tuple[Any, Any], device: torch.device) -> tuple[float, float]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    t0 = time.perf_counter()
    x, y = batch
    # The loss in fp32 from the logits, so that the printed losses resolve more than bf16's
    # 2-3 significant digits (the model's own loss would be a bf16 scalar).
    loss = F.cross_entropy(engine(x).float().flatten(0, 1), y.flatten())
    engine.backward(loss)
    engine.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item(), float(loss.detach().float().item())


def run_stage(args: argparse.Namespace, stage: int, device: torch.device) -> dict[str, float]:
    import deepspeed

    import fsdpx.deepspeed as fsdpx_ds

    engines = {
        "deepspeed": build_engine(deepspeed.initialize, args, stage, device),
        "fsdpx": build_engine(fsdpx_ds.initialize, args, stage, device),
    }
    times: dict[str, list[float]] = {k: [] for k in engines}
    losses: dict[str, list[float]] = {k: [] for k in engines}
    data = micro_batches(args, device)
    order = ["deepspeed", "fsdpx"]
    for step in range(args.warmup + args.steps):
        batch = next(data)
        for name in order:
            seconds, loss = timed_step(engines[name], batch, device)
            if step >= args.warmup:
                times[name].append(seconds)
                losses[name].append(loss)
        order.reverse()
    ds_med = statistics.median(times["deepspeed"])
    fx_med = statistics.median(times["fsdpx"])
    diff = max(abs(a - b) for a, b in zip(losses["deepspeed"], losses["fsdpx"], strict=True))
    del engines
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "deepspeed_ms": ds_med * 1e3,
        "fsdpx_ms": fx_med * 1e3,
        "loss_diff": diff,
        "first_loss": losses["fsdpx"][0],
        "last_loss": losses["fsdpx"][-1],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        print("benchmarks/vs_deepspeed.py needs deepspeed installed beside fsdpx", file=sys.stderr)
        return 2
    device = init_process_group()
    rank0 = dist.get_rank() == 0
    if rank0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(
            f"# {name}, world {dist.get_world_size()}, torch {torch.__version__}, "
            f"deepspeed {deepspeed.__version__}, {args.dtype}, optimizer={args.optimizer}, "
            f"GPT {args.n_layer}x{args.n_embd} vocab {args.vocab}, "
            f"micro-batch {args.batch}x{args.seq}, {args.steps} timed steps"
        )
        print(
            "| stage | DeepSpeed ms | fsdpx ms | fsdpx / DeepSpeed | max loss diff "
            "| loss, first -> last timed step |"
        )
        print("| --- | --- | --- | --- | --- | --- |")
    for stage in args.stages:
        row = run_stage(args, stage, device)
        if rank0:
            print(
                f"| {stage} | {row['deepspeed_ms']:.1f} | {row['fsdpx_ms']:.1f} | "
                f"{row['fsdpx_ms'] / row['deepspeed_ms']:.3f} | {row['loss_diff']:.2e} | "
                f"{row['first_loss']:.4f} -> {row['last_loss']:.4f} |",
                flush=True,
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
