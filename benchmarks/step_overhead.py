"""Step-time overhead of `fsdpx.shard` against hand-written FSDP2, and per-rank model-state
bytes against the ZeRO formula, for each ZeRO stage.

Run from the repository root (2 gloo ranks on CPU)::

    torchrun --standalone --nproc_per_node=2 benchmarks/step_overhead.py --stages 0 1 2 3 --steps 40 --warmup 5 --gas 1

Smallest run (used by tests/test_benchmarks_smoke.py)::

    torchrun --standalone --nproc_per_node=2 benchmarks/step_overhead.py --steps 2 --warmup 1 --tiny

``cfg.compile`` (torch.compile of each block before sharding) against the same engine
without it, added per stage with ``--compile``::

    torchrun --standalone --nproc_per_node=2 benchmarks/step_overhead.py --stages 3 --steps 20 --warmup 3 --compile

What is compared, per stage
---------------------------
The GPT of ``fsdpx/demo/gpt.py`` is built twice from the same seed:

* **raw**: hand-written FSDP2 as DESIGN.md section 3 says: ``fully_shard`` on every block
  (``reshard_after_forward=True`` for stage 3, ``False`` for stages 0-2), then on the root
  with ``reshard_after_forward=False``. Stages 1-3 shard over a 1D mesh of all ranks;
  stage 0 (DDP) shards over a 2D ``(dp, 1)`` mesh, i.e. replicates. With ``--gas`` > 1 the
  loop makes the same ``set_requires_gradient_sync`` / ``set_reshard_after_backward``
  calls before each backward as ``fsdpx.zero.prepare_micro_step``. Optimizer:
  ``torch.optim.AdamW`` with fsdpx's default hyper-parameters; step = forward, backward
  (of ``loss / gas``), ``opt.step()``, ``opt.zero_grad(set_to_none=True)``.
* **fsdpx**: ``fsdpx.shard(model, Config(zero=ZeroConfig(stage=s), ...))``, step =
  ``engine(x, y)``, ``engine.backward(loss)``, ``engine.step()`` per micro-step.

Both run the same micro-batches. Steps are interleaved (raw, fsdpx, fsdpx, raw, ...: the
order flips every step) so that machine noise hits both sides alike; every timed step
starts after a ``dist.barrier()`` and is timed with ``time.perf_counter`` around the whole
optimizer step (all micro-steps' forward + backward, then the optimizer step). A step's
time is the slowest rank's. The table gives p10/median/p90 per side, the ratio of the
medians (goal <= 1.03), the p10/median/p90 of the per-pair ratios, and the ratio of the
median CPU time (process CPU seconds summed over ranks: less sensitive than wall time to
other load on the machine, which the header and footer report). The two sides compute the
same numbers, so the largest difference of their losses is printed as a check that they
did the same work (0 expected). ``--profile DIR`` adds a cProfile per side and lists the
functions where fsdpx spends more time than raw.

With ``--compile`` each stage also times two fsdpx engines built from the same seed, one
with ``cfg.compile`` (**compiled**) and one without (**eager**), interleaved the same way on
the same micro-batches; the table gives their medians and the ratio compiled/eager (below
1: compile pays off). Compilation (inductor, C++ on CPU) happens in the warm-up steps,
whose total seconds per side are printed too, so ``--warmup`` must be at least 1; the
steps after it are timed. Compiled kernels round differently, so the losses differ by fp32
rounding (printed; tests/test_compile.py checks parity).

Model-state bytes (per rank)
----------------------------
Measured, after one warm-up optimizer step (Adam's state exists), during one optimizer
step of ``--mem-gas`` micro-steps (default 2, so that ZeRO-1's unsharded accumulated
gradients exist), at every phase: after each forward, after each backward, after the
optimizer step (before ``zero_grad``). At each phase the bytes of distinct storages are
summed over:

* master params: each FSDP parameter's padded local shard (``_sharded_param_data``);
* working params: the gathered (unsharded) copy FSDP2 holds, when allocated;
* grads: sharded grads (local tensor of ``p.grad``) and unsharded grads that wait for the
  boundary (``_unsharded_param.grad`` / ``unsharded_accumulated_grad``);
* optimizer states: every tensor in ``optimizer.state`` (local shards).

Activations and transient communication buffers are not model states and not counted.
The peak over the phases is compared with the ZeRO formula below.

The formula. The ZeRO paper counts model states as working params + grads + K * psi
"optimizer states" (fp32 master copy + Adam's two moments, K = 12), each term divided by
N where the stage partitions it. Here everything is fp32 (psi = number of parameters,
N = shard group size, 1 for stage 0) and FSDP2 holds:

* M, master params: 4 psi / N (the sharded parameters the optimizer updates);
* O, Adam m and v: 8 psi / N;
* W, working params: the gathered copy compute reads, kept from the forward until the
  boundary backward reshards it: 4 psi for stages 0-2 (``reshard_after_forward=False``;
  with a shard group of one rank FSDP2 still copies the shard into a separate buffer),
  for stage 3 only the root's parameters, 4 psi_root (root ``reshard_after_forward=False``;
  the blocks' gathered copies live one block at a time and are not held);
* G, grads: 4 psi unsharded for stages 0-1 until the boundary reduce, 4 psi / N for 2-3.

The forward of the last micro-step holds W + M + O + G_acc (G_acc: the gradients the
earlier micro-steps accumulated, G when gas > 1, 0 when gas = 1 since zero_grad freed
them); after the boundary backward W is freed and M + O + G_final remain (G_final = 4 psi
/ N, sharded, except 4 psi for stage 0). The formula is the larger of the two:

    stage   gas > 1 (default --mem-gas 2)        gas = 1
    0       4 + 4 + 4 + 8 psi   = 20 psi         16 psi
    1       8 psi + 12 psi / N                   4 psi + 12 psi / N
    2       4 psi + 16 psi / N                   4 psi + 12 psi / N
    3       4 psi_root + 16 psi / N              max(4 psi_root + 12 psi / N, 16 psi / N)

This is the paper's (2 + 2 + K) psi with 4-byte working params and grads and K = 12:
stage 0 is its DDP row, (4 + 4 + 12) psi; stages 1 and 2 are its rows (working params and,
for stage 1, grads whole; the rest / N). Two FSDP2 differences: the paper's ZeRO-3 keeps a
separate working shard, (4 + 4 + 12) psi / N, while FSDP2 gathers straight from the master
shard (16 psi / N); and the root's parameters stay gathered from forward to backward
(4 psi_root), as DeepSpeed's ZeRO-3 "persistent parameters" do. With gas = 1 the boundary
reduce-scatters at once, so ZeRO-1 holds exactly what ZeRO-2 holds. FSDP2 pads each
shard so dim 0 splits evenly over the N ranks (and the last ranks hold less); that padding
is in the measurement and is reported separately.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsdpx  # noqa: E402
from fsdpx.config import OptimizerConfig, ZeroConfig  # noqa: E402
from fsdpx.demo.gpt import GPT, GPTConfig, batches, stdlib_corpus  # noqa: E402

Batch = tuple[torch.Tensor, torch.Tensor]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=40, help="timed optimizer steps per side")
    p.add_argument("--warmup", type=int, default=5, help="untimed optimizer steps per side")
    p.add_argument("--gas", type=int, default=1, help="micro-steps per optimizer step (timing)")
    p.add_argument(
        "--mem-gas", type=int, default=2, help="micro-steps per optimizer step (memory pass)"
    )
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="micro batch per rank")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="a very small model and batch (smoke test)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time fsdpx with cfg.compile on against fsdpx without it, per stage",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="cProfile each side's timed steps (one profiler per side, per rank), write "
        "DIR/stage{S}_{side}_rank{R}.prof and print the functions where fsdpx spends more "
        "time than raw. Profiling slows Python code: read ratios from a run without it.",
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.n_layer, args.n_embd, args.n_head, args.block_size, args.batch_size = 2, 32, 2, 16, 2
    for name in ("steps", "gas", "mem_gas"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.compile and args.warmup < 1:
        p.error("--compile needs --warmup >= 1 (the first steps compile; they are not timed)")
    if args.n_layer < 2:
        # fsdpx.blocks.find_blocks takes a ModuleList as blocks only from two children on;
        # with one block fsdpx would shard the GPT as one unit and the sides would differ.
        p.error("--n-layer must be >= 2")
    return args


# --- the two sides -----------------------------------------------------------------------


def build_gpt(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(
        GPTConfig(
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
        )
    )


OPT = OptimizerConfig(type="adamw")  # fsdpx's defaults; the raw side uses the same numbers


@dataclass
class Side:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step: Callable[[list[Batch]], torch.Tensor]
    """Run one optimizer step over the micro-batches; returns the last micro-step's loss."""


def build_raw(
    args: argparse.Namespace, stage: int, gas: int, meshes: dict[str, DeviceMesh]
) -> Side:
    model = build_gpt(args)
    mesh = meshes["replicate"] if stage == 0 else meshes["shard"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=stage == 3)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    assert isinstance(model, FSDPModule)
    opt = torch.optim.AdamW(
        model.parameters(), lr=OPT.lr, betas=OPT.betas, eps=OPT.eps, weight_decay=OPT.weight_decay
    )
    sync_every_micro_step = stage in (2, 3)

    def step(micro_batches: list[Batch]) -> torch.Tensor:
        for k, (x, y) in enumerate(micro_batches):
            loss = model(x, y)
            if gas > 1:
                boundary = k == gas - 1
                model.set_requires_gradient_sync(sync_every_micro_step or boundary)
                if stage != 3:
                    model.set_reshard_after_backward(boundary)
                (loss * (1.0 / gas)).backward()
            else:
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return Side("raw", model, opt, step)


def build_fsdpx(
    args: argparse.Namespace, stage: int, gas: int, *, compile_blocks: bool = False
) -> Side:
    """fsdpx.shard's engine; with compile_blocks, cfg.compile on and the side is named
    "compiled"."""
    cfg = fsdpx.Config(
        train_micro_batch_size_per_gpu=args.batch_size,
        gradient_accumulation_steps=gas,
        zero=ZeroConfig(stage=stage),  # type: ignore[arg-type]  # argparse checked 0-3
        optimizer=OPT,
        device="cpu",
        seed=args.seed,
        compile=compile_blocks,
    )
    engine = fsdpx.shard(build_gpt(args), cfg)

    def step(micro_batches: list[Batch]) -> torch.Tensor:
        for x, y in micro_batches:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
        return loss.detach()

    name = "compiled" if compile_blocks else "fsdpx"
    return Side(name, cast(nn.Module, engine.module), engine.optimizer, step)


# --- timing --------------------------------------------------------------------------------


@dataclass
class Timings:
    """Per-step seconds, indexed [side name][step]; losses for the same-work check;
    total wall seconds of the warm-up steps per side (slowest rank)."""

    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)
    loss: dict[str, list[float]] = field(default_factory=dict)
    warmup: dict[str, float] = field(default_factory=dict)


def timed(
    side: Side, micro_batches: list[Batch], prof: cProfile.Profile | None = None
) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of this process, loss) of one optimizer step."""
    dist.barrier()
    if prof is not None:
        prof.enable()
    c0, t0 = time.process_time(), time.perf_counter()
    loss = side.step(micro_batches)
    t1, c1 = time.perf_counter(), time.process_time()
    if prof is not None:
        prof.disable()
    return t1 - t0, c1 - c0, float(loss)


def run_interleaved(
    a: Side,
    b: Side,
    data: Iterator[Batch],
    args: argparse.Namespace,
    profs: dict[str, cProfile.Profile] | None = None,
) -> Timings:
    """Time sides `a` (raw, or eager fsdpx) and `b` on the same micro-batches, alternating
    which goes first; results are keyed by the sides' names."""
    names = (a.name, b.name)
    out = Timings(
        wall={n: [] for n in names}, cpu={n: [] for n in names}, loss={n: [] for n in names}
    )
    warm = dict.fromkeys(names, 0.0)
    for i in range(args.warmup + args.steps):
        micro = [next(data) for _ in range(args.gas)]
        order = (a, b) if i % 2 == 0 else (b, a)
        for side in order:
            prof = profs[side.name] if profs is not None and i >= args.warmup else None
            wall, cpu, loss = timed(side, micro, prof)
            if i >= args.warmup:
                out.wall[side.name].append(wall)
                out.cpu[side.name].append(cpu)
                out.loss[side.name].append(loss)
            else:
                warm[side.name] += wall
    # A step lasts as long as its slowest rank; its CPU cost is the sum over ranks.
    walls = torch.tensor([out.wall[n] for n in names], dtype=torch.float64)
    cpus = torch.tensor([out.cpu[n] for n in names], dtype=torch.float64)
    warms = torch.tensor([warm[n] for n in names], dtype=torch.float64)
    dist.all_reduce(walls, op=dist.ReduceOp.MAX)
    dist.all_reduce(warms, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpus, op=dist.ReduceOp.SUM)
    out.wall = {n: walls[k].tolist() for k, n in enumerate(names)}
    out.cpu = {n: cpus[k].tolist() for k, n in enumerate(names)}
    out.warmup = {n: float(warms[k]) for k, n in enumerate(names)}
    return out


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def compare_compile(args: argparse.Namespace, stage: int, data: Iterator[Batch]) -> Timings:
    """fsdpx with cfg.compile against fsdpx without it, interleaved (the eager side is
    named "fsdpx")."""
    eager = build_fsdpx(args, stage, args.gas)
    compiled = build_fsdpx(args, stage, args.gas, compile_blocks=True)
    t = run_interleaved(eager, compiled, data, args)
    del eager, compiled
    gc.collect()
    return t


def report_compile(rows: list[tuple[int, Timings]], say: Callable[..., None]) -> None:
    """The --compile table: eager vs compiled step time per stage, and the ratio line."""
    say("cfg.compile step time in ms (fsdpx eager vs compiled; same measurement as above)")
    say(
        f"{'stage':>5} | {'eager p10':>9} {'eager p50':>9} {'eager p90':>9} | "
        f"{'comp p10':>8} {'comp p50':>8} {'comp p90':>8} | {'ratio':>6} | "
        f"{'paired p10/p50/p90':>18} | {'cpu ratio':>9} | {'warm-up s e/c':>13} | "
        f"{'max|dloss|':>10}"
    )
    ratios = []
    for stage, t in rows:
        e, c = t.wall["fsdpx"], t.wall["compiled"]
        ratio = statistics.median(c) / statistics.median(e)
        ratios.append(f"stage{stage}={ratio:.3f}")
        pairs = [b / a for a, b in zip(e, c, strict=True)]
        cpu = statistics.median(t.cpu["compiled"]) / statistics.median(t.cpu["fsdpx"])
        dloss = max(abs(a - b) for a, b in zip(t.loss["fsdpx"], t.loss["compiled"], strict=True))
        say(
            f"{stage:>5} | {quantile(e, 0.1) * 1e3:9.1f} {quantile(e, 0.5) * 1e3:9.1f} "
            f"{quantile(e, 0.9) * 1e3:9.1f} | {quantile(c, 0.1) * 1e3:8.1f} "
            f"{quantile(c, 0.5) * 1e3:8.1f} {quantile(c, 0.9) * 1e3:8.1f} | {ratio:6.3f} | "
            f"{quantile(pairs, 0.1):5.3f} {quantile(pairs, 0.5):5.3f} {quantile(pairs, 0.9):5.3f} | "
            f"{cpu:9.3f} | {t.warmup['fsdpx']:6.1f}/{t.warmup['compiled']:<6.1f} | {dloss:10.3g}"
        )
    say("ratio compiled/eager (median step time; below 1: compile pays off): " + " ".join(ratios))


# --- model-state bytes ------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


class Ledger:
    """Bytes per category, each storage counted once (views of one buffer share it).

    Padding is what the storages hold beyond the tensors viewed in them: FSDP2 pads each
    shard (and so the all-gather output and the reduce-scatter output) to split dim 0
    evenly over the shard group.
    """

    def __init__(self) -> None:
        self.storages: dict[int, tuple[str, int]] = {}
        self.views: dict[tuple[int, int], int] = {}

    def add(
        self, category: str, t: torch.Tensor | None, storage_of: torch.Tensor | None = None
    ) -> None:
        """Count `t` (a DTensor counts its local tensor) under `category`; its storage is
        that of `storage_of` when given (a padded buffer `t` is carved from)."""
        if t is None:
            return
        view = _local(t)
        s = _local(storage_of if storage_of is not None else view).untyped_storage()
        if s.nbytes() == 0:  # freed (FSDP2 resizes unsharded storage to 0)
            return
        self.storages.setdefault(s.data_ptr(), (category, s.nbytes()))
        self.views[(view.data_ptr(), view.numel())] = view.numel() * view.element_size()

    def totals(self) -> dict[str, int]:
        out = dict.fromkeys(("master", "working", "grads", "optim"), 0)
        for category, nbytes in self.storages.values():
            out[category] += nbytes
        out["total"] = sum(out.values())
        out["padding"] = out["total"] - sum(self.views.values())
        return out


def fsdp_params(model: nn.Module) -> list[Any]:
    """Every FSDPParam of the FSDP modules in `model` (torch private API, 2.13)."""
    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            if group is not None:
                out.extend(group.fsdp_params)
    return out


def model_state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    ledger = Ledger()
    for fp in fsdp_params(model):
        ledger.add("master", fp.sharded_param, storage_of=fp._sharded_param_data)
        unsharded = getattr(fp, "_unsharded_param", None)
        if unsharded is not None and fp.all_gather_outputs:
            ledger.add("working", unsharded, storage_of=fp.all_gather_outputs[0])
        for t in fp.all_gather_outputs[1:] + list(getattr(fp, "_unsharded_inner_tensors", [])):
            ledger.add("working", t)
        ledger.add("grads", fp.sharded_param.grad)
        ledger.add("grads", fp.unsharded_accumulated_grad)
        if unsharded is not None:
            ledger.add("grads", unsharded.grad)
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                ledger.add("optim", v)
    return ledger.totals()


def measure_peak(side: Side, micro_batches: list[Batch]) -> tuple[dict[str, int], str]:
    """Run one optimizer step of len(micro_batches) micro-steps, sampling the model-state
    bytes after every forward, backward and the optimizer step; return the peak sample."""
    samples: list[tuple[dict[str, int], str]] = []

    def sample(phase: str) -> None:
        samples.append((model_state_bytes(side.model, side.optimizer), phase))

    hook = side.optimizer.register_step_post_hook(lambda *_: sample("after opt.step"))
    n_fwd = 0

    def after_forward(*_: Any) -> None:
        # Registered after fully_shard's own hooks, so it runs after FSDP's post-forward.
        nonlocal n_fwd
        sample(f"after forward {n_fwd}")
        n_fwd += 1

    fwd_hook = side.model.register_forward_hook(after_forward)
    # Sample once backward (and FSDP's post-backward callback) has returned.
    orig_backward = torch.Tensor.backward
    n_bwd = 0

    def backward(self: torch.Tensor, *a: Any, **kw: Any) -> None:
        nonlocal n_bwd
        orig_backward(self, *a, **kw)
        sample(f"after backward {n_bwd}")
        n_bwd += 1

    torch.Tensor.backward = backward  # type: ignore[method-assign]
    try:
        side.step(micro_batches)
    finally:
        torch.Tensor.backward = orig_backward  # type: ignore[method-assign]
        fwd_hook.remove()
        hook.remove()
    return max(samples, key=lambda s: s[0]["total"])


def zero_formula(stage: int, psi: int, psi_root: int, n: int, gas: int) -> int:
    """Per-rank model-state bytes the ZeRO formula predicts (see the module docstring)."""
    if stage == 0:
        n = 1
    m, o = 4 * psi / n, 8 * psi / n
    g_full = 4 * psi if stage in (0, 1) else 4 * psi / n
    g_final = 4 * psi / n
    w = 4 * psi_root if stage == 3 else 4 * psi
    at_forward = w + m + o + (g_full if gas > 1 else 0)
    after_boundary = m + o + g_final
    return round(max(at_forward, after_boundary))


# --- profile ------------------------------------------------------------------------------


def profile_report(profs: dict[str, cProfile.Profile], steps: int, top: int = 15) -> str:
    """Functions with more own time (tottime) per step under fsdpx than under raw."""
    stats = {k: pstats.Stats(p).stats for k, p in profs.items()}  # type: ignore[attr-defined]
    totals = {k: sum(v[2] for v in st.values()) / steps for k, st in stats.items()}
    keys = set(stats["raw"]) | set(stats["fsdpx"])

    def own(side: str, key: Any) -> tuple[int, float]:
        v = stats[side].get(key)
        return (0, 0.0) if v is None else (v[1], v[2] / steps)

    rows = sorted(keys, key=lambda k: own("fsdpx", k)[1] - own("raw", k)[1], reverse=True)
    lines = [
        f"  profiled own time per step: raw {totals['raw'] * 1e3:.2f} ms, "
        f"fsdpx {totals['fsdpx'] * 1e3:.2f} ms",
        f"  {'extra us/step':>13} {'calls/step raw':>14} {'fsdpx':>6}  function",
    ]
    for key in rows[:top]:
        (cr, tr), (cf, tf) = own("raw", key), own("fsdpx", key)
        filename, line, name = key
        lines.append(
            f"  {(tf - tr) * 1e6:13.1f} {cr / steps:14.1f} {cf / steps:6.1f}  "
            f"{filename}:{line}({name})"
        )
    return "\n".join(lines)


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "WORLD_SIZE" not in os.environ:
        sys.exit(
            "launch with torchrun, e.g.\n  torchrun --standalone --nproc_per_node=2 "
            "benchmarks/step_overhead.py"
        )
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = {
        "shard": init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)),
        "replicate": init_device_mesh(
            "cpu", (world, 1), mesh_dim_names=("dp_replicate", "dp_shard")
        ),
    }
    corpus = stdlib_corpus(200_000 if args.tiny else 2_000_000)
    say = print if rank == 0 else (lambda *a, **k: None)

    probe = build_gpt(args)
    psi = sum(p.numel() for p in probe.parameters())
    psi_root = psi - sum(p.numel() for p in probe.blocks.parameters())
    del probe
    say(
        f"fsdpx step overhead: {world} gloo ranks, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)/rank; GPT n_layer={args.n_layer} "
        f"n_embd={args.n_embd} block={args.block_size}, micro batch {args.batch_size}/rank, "
        f"gas {args.gas}; psi={psi:,} params (root {psi_root:,}); "
        f"{args.warmup} warm-up + {args.steps} timed steps per side, interleaved; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start"
    )

    time_rows, mem_rows, compile_rows = [], [], []
    profile_lines: list[str] = []
    for stage in args.stages:
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
        data = batches(corpus, args.batch_size, args.block_size, generator=gen)

        raw = build_raw(args, stage, args.gas, meshes)
        fx = build_fsdpx(args, stage, args.gas)
        profs = {"raw": cProfile.Profile(), "fsdpx": cProfile.Profile()} if args.profile else None
        t = run_interleaved(raw, fx, data, args, profs)
        if profs is not None:
            os.makedirs(args.profile, exist_ok=True)
            for name, prof in profs.items():
                prof.dump_stats(os.path.join(args.profile, f"stage{stage}_{name}_rank{rank}.prof"))
            profile_lines.append(
                f"stage {stage} (rank {rank}):\n" + profile_report(profs, args.steps)
            )
        del raw, fx
        gc.collect()
        if args.compile:
            compile_rows.append((stage, compare_compile(args, stage, data)))

        # Memory pass: fresh pair with --mem-gas micro-steps, one warm-up step first.
        raw = build_raw(args, stage, args.mem_gas, meshes)
        fx = build_fsdpx(args, stage, args.mem_gas)
        for side in (raw, fx):
            side.step([next(data) for _ in range(args.mem_gas)])
        micro = [next(data) for _ in range(args.mem_gas)]
        mem = {side.name: measure_peak(side, micro) for side in (raw, fx)}
        del raw, fx
        gc.collect()

        # Report the largest rank (ranks differ only by padding).
        peaks = torch.tensor(
            [mem["raw"][0]["total"], mem["fsdpx"][0]["total"]], dtype=torch.float64
        )
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        med = {k: statistics.median(v) for k, v in t.wall.items()}
        cpu = {k: statistics.median(v) for k, v in t.cpu.items()}
        pairs = [f / r for f, r in zip(t.wall["fsdpx"], t.wall["raw"], strict=True)]
        loss_diff = max(
            (abs(a - b) for a, b in zip(t.loss["raw"], t.loss["fsdpx"], strict=True)), default=0.0
        )
        time_rows.append(
            (stage, t, med["fsdpx"] / med["raw"], pairs, cpu["fsdpx"] / cpu["raw"], loss_diff)
        )
        shard_n = 1 if stage == 0 else world
        formula = zero_formula(stage, psi, psi_root, shard_n, args.mem_gas)
        mem_rows.append((stage, mem, peaks.tolist(), formula))
        say(f"  stage {stage} done")

    say("")
    say("step time in ms (wall: slowest rank per step; cpu: process CPU time summed over ranks)")
    say(
        f"{'stage':>5} | {'raw p10':>8} {'raw p50':>8} {'raw p90':>8} | "
        f"{'fsdpx p10':>9} {'fsdpx p50':>9} {'fsdpx p90':>9} | {'ratio':>6} | "
        f"{'paired p10/p50/p90':>18} | {'cpu ratio':>9} | {'max|dloss|':>10}"
    )
    for stage, t, ratio, pairs, cpu_ratio, loss_diff in time_rows:
        r, f = t.wall["raw"], t.wall["fsdpx"]
        say(
            f"{stage:>5} | {quantile(r, 0.1) * 1e3:8.1f} {quantile(r, 0.5) * 1e3:8.1f} "
            f"{quantile(r, 0.9) * 1e3:8.1f} | {quantile(f, 0.1) * 1e3:9.1f} "
            f"{quantile(f, 0.5) * 1e3:9.1f} {quantile(f, 0.9) * 1e3:9.1f} | {ratio:6.3f} | "
            f"{quantile(pairs, 0.1):5.3f} {quantile(pairs, 0.5):5.3f} {quantile(pairs, 0.9):5.3f} | "
            f"{cpu_ratio:9.3f} | {loss_diff:10.3g}"
        )
    if compile_rows:
        say("")
        report_compile(compile_rows, say)
    say("")
    say(
        f"per-rank model-state MiB (peak over one optimizer step of {args.mem_gas} "
        "micro-step(s), largest rank; breakdown of fsdpx on rank 0 at its peak)"
    )
    say(
        f"{'stage':>5} | {'formula':>8} | {'raw':>8} {'err':>7} | {'fsdpx':>8} {'err':>7} | "
        f"{'master':>7} {'working':>7} {'grads':>7} {'optim':>7} {'pad KiB':>7} | peak at"
    )
    mib = 2.0**20
    for stage, mem, (peak_raw, peak_fx), formula in mem_rows:
        parts, phase = mem["fsdpx"]
        say(
            f"{stage:>5} | {formula / mib:8.3f} | {peak_raw / mib:8.3f} "
            f"{(peak_raw - formula) / formula:+7.2%} | {peak_fx / mib:8.3f} "
            f"{(peak_fx - formula) / formula:+7.2%} | {parts['master'] / mib:7.3f} "
            f"{parts['working'] / mib:7.3f} {parts['grads'] / mib:7.3f} {parts['optim'] / mib:7.3f} "
            f"{parts['padding'] / 1024:7.1f} | {phase}"
        )
    say("")
    say(
        "ratio fsdpx/raw (median step time; goal <= 1.03): "
        + " ".join(f"stage{r[0]}={r[2]:.3f}" for r in time_rows)
    )
    say(
        "model-state error vs ZeRO formula (fsdpx; goal within 5%): "
        + " ".join(f"stage{r[0]}={(r[2][1] - r[3]) / r[3]:+.2%}" for r in mem_rows)
    )
    say(
        f"load average {os.getloadavg()[0]:.1f} at end (ratios are noise-bound when it exceeds the CPUs)"
    )
    if profile_lines:
        say("")
        say("cProfile: functions with more own time per step under fsdpx than raw")
        for block in profile_lines:
            say(block)
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
