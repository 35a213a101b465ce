"""Telemetry costs: training step time with telemetry on vs off, and relay fan-in
throughput (frames per relay CPU-second).

Run from the repository root::

    python benchmarks/telemetry.py                      # both parts, defaults below
    python benchmarks/telemetry.py --steps 20 --fanin-frames 200 --tiny    # smoke

Step time (one process, CPU): the GPT of fsdpx/demo/gpt.py (the example's size unless
--tiny) is sharded once with telemetry enabled; local rank 0 starts the in-process relay
(writing a zstd log), as a one-node run does, so the relay thread's work is inside the
measured process. Steps are interleaved on/off (order flipped every pair; "off" sets
engine.telemetry = None for that step, the engine's only telemetry branch), every step is
timed with perf_counter around forward + backward + engine.step. Printed: median step
time per side, the ratio of medians, p10/median/p90 of the per-pair ratios, and the
measured cost of the telemetry calls on the training thread (observe_loss + on_step) as
a fraction of the step time. Goal: overhead under 0.5%.

Fan-in: a relay thread in this process; --fanin-procs client processes open
--fanin-conns rank connections in total and send --fanin-frames frames each as fast as
they can (one full record per frame, as a publisher polling every step sends), while one
monitor process drains the live stream, once per --fanin-batch-s value: 0, the frames as
they came; a number of seconds, the monitor asks for `batch` frames (the relay's
coalescing, fsdpx/telemetry/wire/coalesce.py). Printed: frames and records per
CPU-second of the relay thread (time.thread_time), and frames per wall second.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fsdpx  # noqa: E402
from fsdpx.demo.gpt import GPT, GPTConfig  # noqa: E402
from fsdpx.telemetry.wire.protocol import RECORD_FIELDS, encode_frame  # noqa: E402
from fsdpx.telemetry.wire.relay import Relay  # noqa: E402
from fsdpx.telemetry.wire.transport import connect  # noqa: E402


def _pct(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]
        if len(values) > 1
        else values[0]
    )


def step_time(args: argparse.Namespace, workdir: Path) -> None:
    model_cfg = (
        GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        if args.tiny
        else GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=128)
    )
    batch = 8
    cfg = fsdpx.Config.from_dict(
        {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_clipping": 1.0,
            "telemetry": {
                "enabled": True,
                "relay": str(workdir / "relay.sock"),
                "log_path": str(workdir / "bench.tlm"),
                "tokens_per_step": batch * model_cfg.block_size,
            },
        }
    )
    # One thread: on a shared machine OpenMP threads spin-waiting for a descheduled peer
    # make step times swing by 100x, which hides everything else.
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    engine = fsdpx.shard(GPT(model_cfg), cfg)
    publisher = engine.telemetry
    assert publisher is not None and publisher.relay is not None
    g = torch.Generator().manual_seed(1)

    def one_step(on: bool) -> tuple[float, float]:
        x = torch.randint(0, model_cfg.vocab_size, (batch, model_cfg.block_size), generator=g)
        engine.telemetry = publisher if on else None
        start = time.perf_counter()
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - start, 0.0

    for i in range(args.warmup):  # includes the FLOP-counting first step
        one_step(i % 2 == 0)
    on_times: list[float] = []
    off_times: list[float] = []
    for i in range(args.steps):
        order = (True, False) if i % 2 == 0 else (False, True)
        for on in order:
            (on_times if on else off_times).append(one_step(on)[0])
    # The telemetry calls alone, on the same engine state (observe_loss + on_step).
    loss = torch.ones(())
    result = fsdpx.StepResult(engine.global_steps, False, 1.0, 1.0)
    calls = 2000
    start = time.perf_counter()
    for _ in range(calls):
        publisher.observe_loss(loss)
        publisher.on_step(engine, result)
    call_s = (time.perf_counter() - start) / calls
    engine.telemetry = publisher
    publisher.close()
    ratios = [a / b for a, b in zip(on_times, off_times, strict=True)]
    med_on, med_off = statistics.median(on_times), statistics.median(off_times)
    print(
        f"step time, {args.steps} interleaved pairs ({'tiny' if args.tiny else 'example'} "
        f"GPT, CPU, 1 process, {args.threads} thread(s))"
    )
    print(f"  median on {med_on * 1e3:.2f} ms | off {med_off * 1e3:.2f} ms")
    print(
        f"ratio on/off of medians {med_on / med_off:.4f} | per-pair p10/median/p90 "
        f"{_pct(ratios, 10):.4f}/{statistics.median(ratios):.4f}/{_pct(ratios, 90):.4f}"
    )
    print(
        f"telemetry calls on the training thread: {call_s * 1e6:.1f} us/step = "
        f"{100 * call_s / med_off:.4f}% of the median step"
    )
    print(
        f"  publisher: {publisher.stats.records_sent} records sent, {publisher.dropped} "
        f"dropped; in-process relay CPU {publisher.relay.stats.cpu_s:.3f}s"
    )


def _record(rank: int, step: int) -> dict[str, Any]:
    record = dict.fromkeys(RECORD_FIELDS)
    record.update(
        rank=rank,
        local_rank=rank % 8,
        host="bench",
        pid=1000 + rank,
        step=step,
        time=time.time(),
        loss=2.5,
        lr=1e-4,
        grad_norm=1.0,
        loss_scale=1.0,
        skipped=False,
        step_time_s=0.1,
        host_rss=1 << 30,
        dropped=0,
    )
    return record


def _blast(address: str, ranks: list[int], frames: int, ready: Any) -> None:
    conns = [
        connect(address, role="rank", secret=None, timeout_s=10, rank=r, host="bench")
        for r in ranks
    ]
    payload = {r: encode_frame({"type": "records", "records": [_record(r, 1)]}) for r in ranks}
    ready.wait()
    for _ in range(frames):
        for r, conn in zip(ranks, conns, strict=True):
            conn.sock.sendall(payload[r])
    for conn in conns:
        conn.close()


def _drain(address: str, ready: Any, stop: Any, batch_s: float) -> None:
    hello = {"batch_s": batch_s} if batch_s else {}
    monitor = connect(address, role="monitor", secret=None, timeout_s=10, **hello)
    ready.wait()
    monitor.sock.settimeout(0.5)
    while not stop.is_set():
        try:
            if not monitor.sock.recv(1 << 20):
                return
        except TimeoutError:
            continue


def fan_in(args: argparse.Namespace, workdir: Path, batch_s: float) -> None:
    relay = Relay(str(workdir / f"fanin{batch_s}.sock"), log_path=workdir / f"fanin{batch_s}.tlm")
    address = str(relay.bind())
    relay.start_thread()
    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    ranks = list(range(args.fanin_conns))
    procs = [
        ctx.Process(
            target=_blast, args=(address, ranks[i :: args.fanin_procs], args.fanin_frames, ready)
        )
        for i in range(args.fanin_procs)
    ]
    drain = ctx.Process(target=_drain, args=(address, ready, stop, batch_s))
    for p in [*procs, drain]:
        p.start()
    total = args.fanin_conns * args.fanin_frames
    while relay.stats.accepted < args.fanin_conns + 1:
        time.sleep(0.05)
    cpu0, frames0, wall0 = relay.stats.cpu_s, relay.stats.frames_in, time.perf_counter()
    ready.set()
    while relay.stats.frames_in - frames0 < total:
        time.sleep(0.02)
    wall = time.perf_counter() - wall0
    time.sleep(0.6)  # let the loop publish its thread_time once more
    cpu = relay.stats.cpu_s - cpu0
    stop.set()
    for p in [*procs, drain]:
        p.join(30)
    relay.stop()
    to_monitor = f"batch_s={batch_s} ({relay.stats.batches_out} batches)" if batch_s else "as sent"
    print(
        f"relay fan-in: {args.fanin_conns} rank connections x {args.fanin_frames} frames "
        f"(1 record each) + 1 monitor (frames {to_monitor}), log on"
    )
    print(
        f"  {total / cpu:,.0f} frames per relay CPU-second | {total / wall:,.0f} frames/s wall "
        f"| relay CPU {cpu:.2f}s over {wall:.2f}s | monitor frames dropped "
        f"{relay.stats.monitor_frames_dropped}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="interleaved on/off pairs")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke runs)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--fanin-conns", type=int, default=64)
    parser.add_argument("--fanin-frames", type=int, default=2000)
    parser.add_argument("--fanin-procs", type=int, default=2)
    parser.add_argument(
        "--fanin-batch-s",
        type=float,
        nargs="+",
        default=[0.0, 0.5],
        help="the monitor's hello batch_s per run (0: frames as they came)",
    )
    parser.add_argument("--skip-step", action="store_true")
    parser.add_argument("--skip-fanin", action="store_true")
    args = parser.parse_args()
    print(
        f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}"
    )
    with tempfile.TemporaryDirectory(prefix="fsdpx-bench-") as tmp:
        if not args.skip_step:
            step_time(args, Path(tmp))
        if not args.skip_fanin:
            for batch_s in args.fanin_batch_s:
                fan_in(args, Path(tmp), batch_s)
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
