"""`fsdpx demo`: train the demo GPT on 2 CPU ranks with telemetry on, and watch it.

`fsdpx demo` runs this as `fsdpx-monitor demo` (a child process: [Note: fsdpx demo] in
fsdpx/cli.py). The demo starts a relay itself (so it outlives the training and keeps a
replay log), launches `python -m fsdpx.demo.train` (shipped with the package, so a pip
install runs it) under torchrun with `--telemetry`, and opens the monitor
on the relay in this terminal; the training's own output goes to a file so it does not
draw over the screen. When stdout is not a terminal (CI, a pipe) it prints one progress
line per `--every` steps from the same telemetry instead, and ends with the training.

    fsdpx demo                     # 2 ranks, 150 steps, monitor in this terminal
    fsdpx demo --steps 20 | cat    # plain progress lines
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from monitor.progress import ProgressLines
from monitor.receiver import Batch, RelayClient
from monitor.table_view import fmt_duration, fmt_float

TRAINING = "fsdpx.demo.train"
"""The module torchrun runs on each rank (fsdpx/demo/train.py)."""


@dataclass(frozen=True)
class DemoPaths:
    """Where the demo writes: the relay's replay log and the training's output."""

    out: Path

    @property
    def log(self) -> Path:
        return self.out / "run.tlm"

    @property
    def train_output(self) -> Path:
        return self.out / "train.log"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (used by `fsdpx demo`)."""
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps (default 150)")
    parser.add_argument("--ranks", type=int, default=2, help="CPU ranks (default 2)")
    parser.add_argument(
        "--out", type=Path, default=Path("out/demo"), help="replay log and training output"
    )
    parser.add_argument("--every", type=int, default=10, help="steps per progress line")


STOP_WAIT_S = 60.0
"""How long a user stop waits for the ranks to finish their step (CPU steps take well
under a second, but a quit during start-up waits for imports and the first step)."""


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; returns the training's exit code, 0 when the user quit the monitor
    (a user stop), 2 for bad input.

    Example::

        run_demo(argparse.Namespace(steps=20, ranks=2, out=Path("out/demo"), every=5))
    """
    from fsdpx.telemetry.wire.relay import Relay

    if args.steps < 1 or args.ranks < 1 or args.every < 1:
        print(
            f"fsdpx demo: error: --steps, --ranks and --every must be >= 1; got "
            f"{args.steps}, {args.ranks}, {args.every}",
            file=sys.stderr,
        )
        return 2
    paths = DemoPaths(args.out)
    paths.out.mkdir(parents=True, exist_ok=True)
    paths.log.unlink(missing_ok=True)
    # A private socket: the demo never joins (or disturbs) a relay the user runs already.
    with tempfile.TemporaryDirectory(prefix="fsdpx-demo-") as tmp:
        address = os.path.join(tmp, "relay.sock")
        relay = Relay(address, log_path=paths.log)
        relay.bind()
        relay.start_thread()
        stop_file = Path(tmp) / "stop"
        try:
            train = _launch(args, address, paths, stop_file)
            try:
                if sys.stdout.isatty():
                    _watch(address)
                else:
                    asyncio.run(_progress(address, train, args.every, args.steps))
            finally:
                outcome = _finish(train, stop_file)
        finally:
            relay.stop()
    print(
        f"{outcome.message}; its output: {paths.train_output}\n"
        f"replay it: fsdpx-monitor replay {paths.log}",
        flush=True,
    )
    return outcome.code


@dataclass(frozen=True)
class Outcome:
    """How the training ended, as the demo reports it."""

    code: int
    message: str


def _launch(
    args: argparse.Namespace, address: str, paths: DemoPaths, stop_file: Path
) -> subprocess.Popen[bytes]:
    # The ranks find the demo's relay through telemetry.relay in a generated config (the
    # training's own settings plus that), and never start their own (start_relay false).
    config = paths.out / "demo_config.json"
    config.write_text(_config_json(args.steps, address))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={args.ranks}",
        "-m",
        TRAINING,
        "--steps",
        str(args.steps),
        "--config",
        str(config),
        "--telemetry",
        "--out",
        str(paths.out / "model"),
        "--stop-file",
        str(stop_file),
    ]
    output = open(paths.train_output, "wb")  # noqa: SIM115 (closed by the child's exit)
    return subprocess.Popen(
        command, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
    )


def _config_json(steps: int, address: str) -> str:
    import json

    return json.dumps(
        {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 1.0,
            "zero": {"stage": 3},
            "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1},
            "scheduler": {
                "type": "WarmupCosineLR",
                "warmup_num_steps": max(1, steps // 10),
                "warmup_type": "linear",
                "total_num_steps": steps,
                "cos_min_ratio": 0.1,
            },
            "telemetry": {"enabled": True, "relay": address, "start_relay": False},
        },
        indent=2,
    )


def _finish(train: subprocess.Popen[bytes], stop_file: Path) -> Outcome:
    """Wait for the training, or stop it when the user quit the monitor first.

    [Note: a user stop] Quitting is not a failure: the demo creates the stop file, the
    ranks agree to stop after their current step and exit 0, and so does torchrun, with
    nothing but the training's own lines in train.log. Signalling torchrun instead makes
    it raise SignalException (a traceback in train.log, exit code 1) and the ranks die
    mid-step. Signals remain the fallback for ranks that do not stop in STOP_WAIT_S.
    """
    if train.poll() is not None:
        return Outcome(train.returncode, f"training exited with {train.returncode}")
    stop_file.touch()
    try:
        train.wait(timeout=STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(train.pid, signal.SIGTERM)
        try:
            train.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(train.pid, signal.SIGKILL)
            train.wait()
        return Outcome(
            0,
            f"training stopped (monitor quit); it did not stop within {STOP_WAIT_S:.0f} s, "
            f"so it was terminated (exit code {train.returncode})",
        )
    if train.returncode != 0:
        return Outcome(train.returncode, f"training exited with {train.returncode}")
    return Outcome(0, "training stopped (monitor quit)")


def _watch(address: str) -> None:
    from monitor.app import MonitorApp
    from monitor.cli import run_app

    run_app(MonitorApp(sources=[address]))


async def _progress(address: str, train: subprocess.Popen[bytes], every: int, steps: int) -> None:
    """Plain progress lines from the relay while the training runs."""
    lines = ProgressLines(every=every, steps=steps)

    def on_batch(batch: Batch) -> None:
        for text in lines.feed(batch.records, batch.events, now=batch.received_at):
            print(text, flush=True)

    client = RelayClient(address, on_batch=on_batch, on_status=lambda up, detail: None)
    task = asyncio.create_task(client.run())
    while train.poll() is None:
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)  # the ranks' last records and exit events
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for text in lines.finish(time.time()):
        print(text, flush=True)
    s = lines.model.snapshot(time.time()).summary
    print(
        f"done: step {s.step}  loss {fmt_float(s.loss, 4)} (mean over ranks)  "
        f"ranks {s.exited} exited {s.dead} dead  elapsed {fmt_duration(s.elapsed_s)}",
        flush=True,
    )
