"""Consolidation of a sharded checkpoint into one full state-dict file: fsdpx-ckpt
against PyTorch DCP's `dcp_to_torch_save`, same tensors, side by side in one run.

Run from the repository root::

    python benchmarks/checkpoint_consolidate.py                  # 300M fp32 params (1.2 GB)
    python benchmarks/checkpoint_consolidate.py --params 20e6    # quick run

What is compared
----------------
One GPT-like set of fp32 tensors (24 blocks of attention + MLP weights, embeddings;
seeded `randn * 0.02`) is written twice:

* as an fsdpx checkpoint of `--ranks` writers, each holding a dim-0 shard of every tensor
  (what an FSDP2 save writes), zstd level 1;
* with `torch.distributed.checkpoint.save` (no process group, full tensors).

Each consolidation then runs in a fresh child process (so peak memory is its own):

* `fsdpx -> safetensors`: `checkpoint_tools.consolidate(ckpt, dir)` (what
  `fsdpx-ckpt consolidate ckpt dir` runs), streaming block by block;
* `fsdpx -> torch.save`: `consolidate(ckpt, "model.pt")` (torch.save needs every tensor
  in memory, so this one is not streamed);
* `DCP -> torch.save`: `dcp_to_torch_save(dcp_dir, "model.pt")`.

Reported per side: CPU time (user + system, all threads: the steadier number on a shared
machine), wall time of the call until its output is durable (the child fsyncs
the output files after the call; fsdpx already did, torch.save does not; the parent runs
`sync` before each child so no side pays for another's writeback), peak RSS of the whole process
(`VmHWM`, after `import torch` which alone is ~220 MB), and the RSS the call added over
the process's RSS just before it (`VmHWM - VmRSS`, the high-water mark reset first via
`/proc/self/clear_refs`). Inputs are read from the page cache on both sides (each
checkpoint was just written). Outputs are checked equal to the source tensors bitwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, resource, sys, time
import torch
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
kind, src, out = sys.argv[1:4]
if kind == "dcp":
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    run = lambda: dcp_to_torch_save(src, out)
else:
    from checkpoint_tools import consolidate
    run = lambda: consolidate(src, out)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS:")
r0 = resource.getrusage(resource.RUSAGE_SELF)
t0 = time.perf_counter()
run()
# Time until the output is durable on both sides: fsdpx fsyncs its files itself (then
# this is ~free), torch.save does not, and unflushed pages would bill the next run.
for root, _, names in os.walk(out) if os.path.isdir(out) else [("", [], [out])]:
    for name in names:
        fd = os.open(os.path.join(root, name), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
dt = time.perf_counter() - t0
r1 = resource.getrusage(resource.RUSAGE_SELF)
cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
print(json.dumps({"time": dt, "cpu": cpu, "peak": status("VmHWM:"), "added": status("VmHWM:") - before}))
"""


def make_state(params: float, seed: int = 0) -> dict[str, torch.Tensor]:
    """GPT-like fp32 tensors totalling about `params` elements."""
    d = 1024
    per_block = 12 * d * d + 9 * d
    blocks = max(1, int((params - 50304 * d) // per_block)) if params > 60e6 else 1
    if params <= 60e6:
        d = max(64, int((params / 12) ** 0.5) // 64 * 64)
    g = torch.Generator().manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    vocab = 50304 if params > 60e6 else 4096
    state["wte.weight"] = torch.randn(vocab, d, generator=g) * 0.02
    for i in range(blocks):
        p = f"h.{i}."
        state[p + "ln_1.weight"] = torch.ones(d)
        state[p + "attn.c_attn.weight"] = torch.randn(3 * d, d, generator=g) * 0.02
        state[p + "attn.c_attn.bias"] = torch.zeros(3 * d)
        state[p + "attn.c_proj.weight"] = torch.randn(d, d, generator=g) * 0.02
        state[p + "ln_2.weight"] = torch.ones(d)
        state[p + "mlp.c_fc.weight"] = torch.randn(4 * d, d, generator=g) * 0.02
        state[p + "mlp.c_proj.weight"] = torch.randn(d, 4 * d, generator=g) * 0.02
    state["ln_f.weight"] = torch.ones(d)
    return state


def write_fsdpx(state: dict[str, torch.Tensor], d: Path, ranks: int) -> None:
    from checkpoint_tools.format import RankWriter, model_name, write_manifest

    infos = []
    for rank in range(ranks):
        w = RankWriter(d, rank)
        for name, t in state.items():
            n = t.shape[0]
            lo, hi = n * rank // ranks, n * (rank + 1) // ranks
            w.add(
                model_name(name), t[lo:hi], global_shape=t.shape, offsets=(lo, *[0] * (t.dim() - 1))
            )
        infos.append(w.close())
    write_manifest(d, world_size=ranks, rank_files=infos, state={"global_steps": 0})


def write_dcp(state: dict[str, torch.Tensor], d: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group, saving without distributed"
        dcp.save(state, checkpoint_id=str(d))


def run_child(kind: str, src: Path, out: Path) -> dict[str, float]:
    os.sync()  # start each side with no dirty pages left by the previous one
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(src), str(out)],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def check_outputs(state: dict[str, torch.Tensor], st_dir: Path, pt_files: list[Path]) -> None:
    from safetensors import safe_open

    with safe_open(str(st_dir / "model.safetensors"), "pt") as f:
        for name, t in state.items():
            assert torch.equal(f.get_tensor(name), t), name
    for pt in pt_files:
        loaded = torch.load(pt, mmap=True, weights_only=True)
        for name, t in state.items():
            assert torch.equal(loaded[name], t), (pt, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=300e6, help="fp32 parameters (default 300e6)")
    ap.add_argument(
        "--ranks", type=int, default=2, help="writers the fsdpx checkpoint is split over"
    )
    ap.add_argument(
        "--workdir", type=Path, default=None, help="scratch directory (default: a temp dir)"
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.workdir))
    try:
        state = make_state(args.params)
        n = sum(t.numel() for t in state.values())
        print(f"model: {len(state)} tensors, {n / 1e6:.1f}M fp32 params, {n * 4 / 2**20:.0f} MiB")
        t0 = time.perf_counter()
        write_fsdpx(state, work / "fsdpx", args.ranks)
        t1 = time.perf_counter()
        write_dcp(state, work / "dcp")
        t2 = time.perf_counter()
        print(
            f"setup: fsdpx save {t1 - t0:.1f}s ({du(work / 'fsdpx') / 2**20:.0f} MiB on disk), "
            f"DCP save {t2 - t1:.1f}s ({du(work / 'dcp') / 2**20:.0f} MiB on disk)"
        )
        load0 = os.getloadavg()[0]
        rows = {
            "fsdpx -> safetensors": run_child("fsdpx", work / "fsdpx", work / "out_st"),
            "fsdpx -> torch.save": run_child("fsdpx", work / "fsdpx", work / "out_fsdpx.pt"),
            "DCP -> torch.save": run_child("dcp", work / "dcp", work / "out_dcp.pt"),
        }
        check_outputs(state, work / "out_st", [work / "out_fsdpx.pt", work / "out_dcp.pt"])
        print("outputs: all three equal the source tensors bitwise")
        print()
        print(f"load average (1 min) before/after: {load0:.1f} / {os.getloadavg()[0]:.1f}")
        print(f"{'side':<22} {'time s':>8} {'CPU s':>7} {'peak RSS MiB':>13} {'added RSS MiB':>14}")
        for name, r in rows.items():
            print(
                f"{name:<22} {r['time']:8.2f} {r['cpu']:7.2f} {r['peak'] / 2**20:13.0f} "
                f"{r['added'] / 2**20:14.0f}"
            )
        base = rows["DCP -> torch.save"]
        for name in ("fsdpx -> safetensors", "fsdpx -> torch.save"):
            r = rows[name]
            print(
                f"{name} / DCP: time {r['time'] / base['time']:.2f}x, "
                f"CPU {r['cpu'] / base['cpu']:.2f}x, peak RSS {r['peak'] / base['peak']:.2f}x, "
                f"added RSS {r['added'] / base['added']:.3f}x"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
