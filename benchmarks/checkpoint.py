"""Checkpoint save/load: fsdpx against torch.distributed.checkpoint (DCP) and torch.save,
side by side in one run, on the same FSDP2 state.

Run from the repository root (2 gloo ranks on CPU; ~300M fp32 parameters, needs about
8 GB of RAM and 12 GB of free disk under --dir)::

    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint.py --params-m 300

Smallest run::

    torchrun --standalone --nproc_per_node=2 benchmarks/checkpoint.py --params-m 4

One rank with 2 codec threads (the "2 cores per rank" case), bf16::

    torchrun --standalone --nproc_per_node=1 benchmarks/checkpoint.py --threads 2 --dtype bf16

What is measured
----------------
One model (a stack of `--layers` square-ish Linear blocks, fp32, `--params-m` million
parameters in total), sharded ZeRO-3 by `fsdpx.shard` over 2 ranks, trained one AdamW
step so the optimizer state exists. Its sharded state (parameters + exp_avg + exp_avg_sq
+ step) is then written by:

* **fsdpx sync**: `engine.save_checkpoint` (zstd level 1 after byte shuffle, per-chunk
  CRC, fsync, atomic commit);
* **fsdpx async**: the same with `checkpoint.async_save`: the *blocking* time is until
  `save_checkpoint` returns (host snapshot), the total until `wait_for_checkpoint`. Two
  saves: the first allocates the host snapshot buffers, the next reuses them (the
  steady state of a training run);
* **DCP**: `torch.distributed.checkpoint.save` of `get_state_dict(model, optimizer)`
  (FileSystemWriter defaults: fsync on); **DCP async**: `async_save`, blocking time until
  it returns, total until its future is done;
* **torch.save**: each rank `torch.save`s its local shards (model and optimizer state
  dicts of local tensors) to one file, then fsyncs it.

Each save starts after a barrier and ends when the slowest rank is done (another
barrier). Both libraries' checkpoint code is imported and the native ops built before
anything is timed. Loads: `engine.load_checkpoint` vs `torch.distributed.checkpoint.load` into the
same state dicts plus `set_state_dict`. Next to each time: the CPU seconds each rank spent
(process CPU time, all its threads), as `r0/r1`. Loads read files just written, so mostly from the
page cache, for both sides alike. One run on a shared machine: timings are noisy; bytes
are exact.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fsdpx  # noqa: E402
import fsdpx.checkpoint.saving  # noqa: E402, F401  (timed saves must not import it: see main)
from fsdpx.ops._loader import load_ops  # noqa: E402
from fsdpx.ops.shuffle import checkpoint_kernels  # noqa: E402


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


def build(params_m: float, layers: int) -> tuple[nn.Sequential, int]:
    width = int((params_m * 1e6 / layers) ** 0.5)
    torch.manual_seed(0)
    blocks = [Block(width) for _ in range(layers)]
    for block in blocks:
        nn.init.normal_(block.fc.weight, std=0.02)  # trained-like scale (compressibility)
    return nn.Sequential(*blocks), width


CPU: dict[str, list[float]] = {}


def timed(fn: Callable[[], object], label: str = "") -> float:
    """Seconds from a common start to the slowest rank's end; each rank's CPU seconds go
    to CPU[label]."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    cpu = time.process_time() - c0
    dist.barrier()
    wall = time.perf_counter() - t0
    if label:
        got: list[float] = [0.0] * dist.get_world_size()
        dist.all_gather_object(got, cpu)
        CPU[label] = got
    return wall


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def torch_save_shards(engine: fsdpx.Engine, path: Path) -> None:
    def local(t: object) -> object:
        return t.to_local() if isinstance(t, DTensor) else t

    model = {k: local(v) for k, v in engine.module.state_dict().items()}
    optim = engine.optimizer.state_dict()
    optim["state"] = {k: {n: local(v) for n, v in s.items()} for k, s in optim["state"].items()}
    path.mkdir(parents=True, exist_ok=True)
    f = path / f"rank{dist.get_rank()}.pt"
    with open(f, "wb") as fh:
        torch.save({"model": model, "optim": optim}, fh)
        fh.flush()
        os.fsync(fh.fileno())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params-m", type=float, default=300.0, help="model size, millions")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--compression", choices=("zstd", "none"), default="zstd")
    ap.add_argument("--threads", type=int, default=0, help="checkpoint.threads (0: auto)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args()

    torch.set_num_threads(1)
    # The native ops (shuffle + CRC) are JIT-built on a machine's first use: build them before
    # any timing, or the first save counts a compile (seen as a 6x save on a fresh host).
    load_ops()
    # The engine imports its checkpoint package on the first save ([Note: engine imports on
    # first use]); DCP's is imported above, so fsdpx's is too (0.09 CPU s per rank here,
    # otherwise counted in the first fsdpx save; a training run pays it once), and the
    # kernels' first call (their fake registrations) is made here.
    checkpoint_kernels()
    base_cfg = {
        "zero": {"stage": 3},
        "checkpoint": {"compression": args.compression, "threads": args.threads},
        "timeout_s": 1800,
    }
    model, width = build(args.params_m, args.layers)
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)  # bf16 parameters and AdamW state
    engine = fsdpx.shard(model, fsdpx.Config.from_dict(base_cfg))
    rank = dist.get_rank()
    nparams = sum(p.numel() for p in engine.module.parameters())
    x = torch.randn(2, width, dtype=next(model.parameters()).dtype)
    engine.backward(engine(x).pow(2).mean())
    engine.step()

    scratch = Path(args.dir or tempfile.gettempdir()) / "fsdpx-ckpt-bench"
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(parents=True)
    dist.barrier()
    rows: dict[str, float] = {}
    sizes: dict[str, int] = {}

    rows["fsdpx save"] = timed(
        lambda: engine.save_checkpoint(scratch / "fsdpx", tag="sync"), "fsdpx save"
    )
    sizes["fsdpx"] = du(scratch / "fsdpx" / "sync")

    model_sd, optim_sd = get_state_dict(engine.module, engine.optimizer)
    dcp_state = {"model": model_sd, "optim": optim_sd}
    rows["DCP save"] = timed(lambda: dcp.save(dcp_state, checkpoint_id=scratch / "dcp"), "DCP save")
    sizes["DCP"] = du(scratch / "dcp")
    pending: list[object] = []
    # async_save runs its collectives from a background thread: on a group of their own,
    # so they never interleave with this script's barriers on the default group.
    dcp_group = dist.new_group(backend="gloo")
    blocking = timed(
        lambda: pending.append(
            dcp.async_save(dcp_state, checkpoint_id=scratch / "dcp_async", process_group=dcp_group)
        ),
        "DCP async save (blocking)",
    )
    rows["DCP async save (blocking)"] = blocking
    rows["DCP async save (total)"] = blocking + timed(
        lambda: pending[0].result(),  # type: ignore[attr-defined]
        "DCP async save (rest)",
    )
    if rank == 0:
        shutil.rmtree(scratch / "dcp_async")

    rows["torch.save save"] = timed(
        lambda: torch_save_shards(engine, scratch / "torchsave"), "torch.save save"
    )
    sizes["torch.save"] = du(scratch / "torchsave")
    if rank == 0:
        shutil.rmtree(scratch / "torchsave")

    # Async: the first save allocates its host snapshot buffers, later ones reuse them.
    engine._checkpointer.async_save = True
    for i in (1, 2):
        blocking = timed(lambda: engine.save_checkpoint(scratch / "fsdpx", tag="async"))
        rows[f"fsdpx async save #{i} (blocking)"] = blocking
        rows[f"fsdpx async save #{i} (total)"] = blocking + timed(engine.wait_for_checkpoint)
    engine._checkpointer.async_save = False

    rows["fsdpx load"] = timed(
        lambda: engine.load_checkpoint(scratch / "fsdpx", tag="sync"), "fsdpx load"
    )

    def dcp_load() -> None:
        m, o = get_state_dict(engine.module, engine.optimizer)
        state = {"model": m, "optim": o}
        dcp.load(state, checkpoint_id=scratch / "dcp")
        set_state_dict(engine.module, engine.optimizer, model_state_dict=m, optim_state_dict=o)

    rows["DCP load"] = timed(dcp_load, "DCP load")

    if rank == 0:
        print(
            f"model: {nparams / 1e6:.1f}M {args.dtype} params, {args.layers} layers, width "
            f"{width}; {dist.get_world_size()} gloo ranks, ZeRO-3, AdamW state; "
            f"compression={args.compression}, checkpoint threads="
            f"{engine._checkpointer.options.threads}"
        )
        print(
            f"machine: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} "
            "(shared: compare ratios within this run, not seconds across runs)"
        )
        print(f"{'what':34s} {'seconds':>9s}  CPU s per rank")
        for k, v in rows.items():
            cpu = CPU.get(k)
            shown = "/".join(f"{c:.2f}" for c in cpu) if cpu else ""
            print(f"{k:34s} {v:9.2f}  {shown}")
        print(f"{'bytes on disk':34s} {'MB':>9s}")
        for k, v in sizes.items():
            print(f"{k:34s} {v / 1e6:9.1f}")
        print(
            "ratio fsdpx/DCP: "
            f"bytes={sizes['fsdpx'] / sizes['DCP']:.3f} (goal <= 0.85) "
            f"save_time={rows['fsdpx save'] / rows['DCP save']:.3f} (goal <= 1.0) "
            f"load_time={rows['fsdpx load'] / rows['DCP load']:.3f} (goal <= 1.0) "
            f"save_cpu={sum(CPU['fsdpx save']) / sum(CPU['DCP save']):.3f} "
            f"load_cpu={sum(CPU['fsdpx load']) / sum(CPU['DCP load']):.3f}"
        )
        print(
            "ratio fsdpx async/DCP async: "
            f"blocking={rows['fsdpx async save #2 (blocking)'] / rows['DCP async save (blocking)']:.3f} "
            f"total={rows['fsdpx async save #2 (total)'] / rows['DCP async save (total)']:.3f}"
        )
        print(
            "ratio fsdpx/torch.save: "
            f"bytes={sizes['fsdpx'] / sizes['torch.save']:.3f} "
            f"save_time={rows['fsdpx save'] / rows['torch.save save']:.3f}"
        )
        print(
            "ratio async blocking/sync save: "
            f"first={rows['fsdpx async save #1 (blocking)'] / rows['fsdpx save']:.3f} "
            f"next={rows['fsdpx async save #2 (blocking)'] / rows['fsdpx save']:.3f} "
            "(goal <= 0.2)"
        )
        sys.stdout.flush()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    # A process exiting right after gloo checkpoint work can abort in teardown (DESIGN.md
    # section 3): destroy the group, then leave without atexit handlers.
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
