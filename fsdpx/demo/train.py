"""Train the small byte-level GPT of fsdpx/demo/gpt.py with fsdpx (ZeRO-3 by default), then
export it as safetensors and print a sample. Runs on CPU in a minute or two. It ships with
the package: `fsdpx demo` runs it under torchrun, from a pip install as from a checkout.

Launch, from anywhere:

    python -m fsdpx.demo.train                                          # one process
    torchrun --standalone --nproc_per_node=2 -m fsdpx.demo.train        # 2 ranks (gloo on CPU)

Options:

    --steps N          optimizer steps (default 150)
    --config FILE      an fsdpx config (JSON or TOML; `fsdpx config show FILE` prints it
                       resolved) used instead of the built-in one below
    --out DIR          where the model and sample go (default out/train_gpt)
    --eval-every N, --log-every N, --sample-tokens N
    --telemetry [LOG]  live per-rank telemetry for the monitor; LOG: replay log path
    --stop-file FILE   stop cleanly at the next step once FILE exists (`fsdpx demo` creates
                       it when you quit the monitor)

The data is the Python standard library's own source read as bytes (nothing is
downloaded); the last 10% is held out for evaluation. Every rank draws the same global
batch and trains on its slice of it, as a data loader with a distributed sampler would.
`main` reads top to bottom as the DeepSpeed-style loop it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist

import fsdpx
from fsdpx.demo.gpt import GPT, GPTConfig, batches, generate, shard_batch, stdlib_corpus
from fsdpx.export import save_full_model


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line above."""
    assert __doc__ is not None
    parser = argparse.ArgumentParser(
        prog="python -m fsdpx.demo.train", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps")
    parser.add_argument("--config", type=Path, default=None, help="fsdpx config file (JSON/TOML)")
    parser.add_argument("--out", type=Path, default=Path("out/train_gpt"), help="output directory")
    parser.add_argument("--eval-every", type=int, default=50, help="evaluate every N steps")
    parser.add_argument("--log-every", type=int, default=10, help="print every N steps")
    parser.add_argument("--sample-tokens", type=int, default=200, help="length of the sample")
    parser.add_argument(
        "--telemetry",
        nargs="?",
        const="",
        default=None,
        metavar="LOG",
        help="publish live per-rank telemetry (watch with the monitor); with LOG, the relay "
        "started by local rank 0 also writes a replay log there (e.g. out/run.tlm)",
    )
    parser.add_argument(
        "--stop-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="stop cleanly (exit 0, no export) at the next step once FILE exists",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Train, export and sample (module docstring); returns the exit code."""
    args = parse_args(argv)

    # --- threads: split the machine's cores between the ranks on it ----------------------

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_ranks))

    # --- config: DeepSpeed's knobs, fsdpx's names ------------------------------------------

    if args.config is not None:
        cfg = fsdpx.Config.from_file(args.config)
    else:
        cfg = fsdpx.Config.from_dict(
            {
                "train_micro_batch_size_per_gpu": 8,  # sequences per rank per micro-step
                "gradient_accumulation_steps": 2,
                "gradient_clipping": 1.0,
                "zero": {"stage": 3},
                "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1},
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "warmup_num_steps": max(1, args.steps // 10),
                    "warmup_type": "linear",
                    "total_num_steps": args.steps,
                    "cos_min_ratio": 0.1,
                },
            }
        )

    # --- model and engine ------------------------------------------------------------------

    model_cfg = GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128)
    if args.telemetry is not None:
        # Off by default. Each rank publishes a record per step to this node's relay (local
        # rank 0 starts one in-process when none runs): fsdpx/telemetry, monitor/PROTOCOL.md.
        cfg = dataclasses.replace(
            cfg,
            telemetry=dataclasses.replace(
                cfg.telemetry,
                enabled=True,
                log_path=args.telemetry or None,
                tokens_per_step=cfg.train_micro_batch_size_per_gpu
                * model_cfg.block_size
                * cfg.gradient_accumulation_steps,
            ),
        )
    torch.manual_seed(cfg.seed)  # every rank builds the same model; shard() keeps its slice
    engine = fsdpx.shard(GPT(model_cfg), cfg)  # starts the process group (torchrun or 1 rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    n_params = sum(p.numel() for p in engine.parameters())  # DTensor numel is the global size

    def log(*parts: object) -> None:
        if rank == 0:
            print(*parts, flush=True)

    log(
        f"world {world} | ZeRO stage {cfg.zero.stage} | {n_params / 1e6:.2f}M params | "
        f"{torch.get_num_threads()} threads/rank"
    )

    # --- data: a global batch per micro-step, each rank trains on its slice --------------

    corpus = stdlib_corpus()
    split = int(0.9 * corpus.numel())
    train_data, val_data = corpus[:split], corpus[split:]
    global_batch = cfg.train_micro_batch_size_per_gpu * world
    # Same generator seed on every rank: all ranks draw the same global batches.
    train_iter = batches(
        train_data,
        global_batch,
        model_cfg.block_size,
        generator=torch.Generator().manual_seed(cfg.seed + 1),
    )
    val_iter = batches(
        val_data, global_batch, model_cfg.block_size, generator=torch.Generator().manual_seed(1234)
    )
    val_batches = [next(val_iter) for _ in range(4)]  # fixed held-out set, same every eval

    @torch.no_grad()
    def evaluate() -> float:
        """Mean held-out loss: each rank evaluates its slice, the means are averaged."""
        engine.eval()
        total = torch.zeros(())
        for x, y in val_batches:
            total += engine(shard_batch(x, rank, world), shard_batch(y, rank, world)).float()
        engine.train()
        return float(engine.all_reduce_mean(total / len(val_batches)).item())

    # --- training: the DeepSpeed loop ------------------------------------------------------

    tokens_per_step = global_batch * model_cfg.block_size * cfg.gradient_accumulation_steps
    log(f"{tokens_per_step} tokens per optimizer step; initial val loss {evaluate():.3f}")
    start = last = time.perf_counter()
    cpu_start = time.process_time()
    last_logged = 0
    for step in range(1, args.steps + 1):
        lr = engine.get_lr()[0]
        loss_sum = torch.zeros(())
        for _ in range(cfg.gradient_accumulation_steps):
            x, y = next(train_iter)
            loss = engine(shard_batch(x, rank, world), shard_batch(y, rank, world))
            engine.backward(loss)
            engine.step()  # steps the optimizer only after the last micro-step
            loss_sum += loss.detach().float()
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            loss_now = engine.all_reduce_mean(loss_sum / cfg.gradient_accumulation_steps).item()
            now = time.perf_counter()
            norm = engine.get_global_grad_norm()
            log(
                f"step {step:4d} | loss {loss_now:.3f} | lr {lr:.2e} | "
                f"grad norm {norm if norm is None else f'{norm:.2f}'} | "
                f"{(step - last_logged) * tokens_per_step / (now - last):,.0f} tokens/s"
            )
            last, last_logged = now, step
        if step % args.eval_every == 0 and step != args.steps:
            log(f"step {step:4d} | val loss {evaluate():.3f}")
        if args.stop_file is not None and step != args.steps:
            # Every rank must stop at the same step (a rank that stops alone leaves the
            # others waiting in a collective), so the ranks agree: one tiny all-reduce a step.
            stop = torch.tensor([float(args.stop_file.exists())])
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            if stop.item():
                log(f"step {step:4d} | stopping: {args.stop_file} appeared (a user stop)")
                _finish(engine)
                return 0
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    log(
        f"trained {args.steps} steps in {elapsed:.1f}s ({cpu:.1f}s CPU on rank 0); "
        f"final val loss {evaluate():.3f}"
    )

    # --- export and sample -----------------------------------------------------------------

    # Every rank takes part (each tensor is gathered in turn); rank 0 writes the files.
    files = save_full_model(engine.module, args.out)
    log("saved", ", ".join(str(f) for f in files))

    # Generation runs the sharded model, so every rank runs it (same seed, same tokens).
    engine.eval()
    prompt = torch.tensor([list(b"def ")])
    sample_ids = generate(
        cast(GPT, engine.module),  # the GPT, its parameters sharded in place
        prompt,
        args.sample_tokens,
        temperature=0.8,
        top_k=10,
        generator=torch.Generator().manual_seed(0),
    )
    sample = bytes(sample_ids[0].tolist()).decode("utf-8", errors="replace")
    if rank == 0:
        (args.out / "sample.txt").write_text(sample)
    log(f"--- sample (also in {args.out / 'sample.txt'}) ---\n{sample}\n---")

    _finish(engine)
    return 0


def _finish(engine: fsdpx.Engine) -> None:
    """Close the telemetry publisher (its "exit" event, which tells the monitor the ranks
    finished rather than went quiet, is sent by close(); the os._exit below skips the
    atexit hook that would otherwise send it), then the process group."""
    if engine.telemetry is not None:
        engine.telemetry.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # [Note: exit without interpreter teardown] A gloo process group can abort its process
    # (SIGABRT, "terminate called without an active exception") while the interpreter
    # tears down objects still holding it, after destroy_process_group (DESIGN.md's traps;
    # seen once in eleven fresh-clone demo runs, after training had finished). Everything
    # the demo writes is closed by now, so it flushes and exits without that teardown, as
    # the test workers do (tests/dist.py).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
