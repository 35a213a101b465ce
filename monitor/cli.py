"""The `fsdpx-monitor` command.

    fsdpx-monitor [ADDR ...]                 watch relays live (default: this node's relay)
    fsdpx-monitor --rendezvous HOST:PORT     every relay the job published in its
                                             rendezvous store (needs torch here)
    fsdpx-monitor --discovery FILE           every relay in telemetry.discovery_file
    fsdpx-monitor replay RUN.tlm             replay a relay's log (space, arrows, [ ])
    fsdpx-monitor export RUN.tlm --csv DIR   one CSV row per run-rank-step (+ events.csv)
                                             (--run RUN: one run of the log)
    fsdpx-monitor export RUN.tlm --tensorboard DIR   TensorBoard event files per rank
    fsdpx-monitor export RUN.tlm --jsonl FILE        one JSON object per line
    fsdpx-monitor export RUN.tlm --prometheus FILE   latest per-rank gauges (text format)
    fsdpx-monitor demo                       train the demo GPT on 2 CPU ranks, watch it
                                             (what `fsdpx demo` runs; monitor/demo.py)

ADDR: a Unix socket path or host:port (monitor/PROTOCOL.md). A relay started with a
shared secret needs the same secret here, read from the environment variable named by
--secret-env (FSDPX_TELEMETRY_SECRET by default), never from the command line.

Exit codes: 0 success, 2 bad input (bad address, unreadable log, missing package).
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.transport import DEFAULT_SECRET_ENV, default_address, read_secret
from monitor.discover import relays_from_file, relays_from_store

if TYPE_CHECKING:
    from monitor.app import MonitorApp

TEXTUAL_MISSING = (
    "the monitor's screen needs the optional `textual` package, which is not installed: "
    "`pip install 'fsdpx[monitor]'` (export works without it)"
)
EXIT_OK = 0
EXIT_BAD_INPUT = 2
SUBCOMMANDS = ("replay", "export", "demo")


def _add_thresholds(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stale-after", type=float, default=10.0, metavar="S", help="seconds until stale"
    )
    parser.add_argument(
        "--dead-after", type=float, default=60.0, metavar="S", help="seconds until dead"
    )
    parser.add_argument(
        "--refresh-hz",
        type=float,
        default=None,
        metavar="HZ",
        help="screen refreshes/s (default: 2, or 1 for a run of more than 1,000 ranks)",
    )


def build_parsers() -> dict[str, argparse.ArgumentParser]:
    """The live parser and one per subcommand (the live form takes bare addresses, which
    argparse subparsers cannot mix with subcommand names)."""
    live = argparse.ArgumentParser(
        prog="fsdpx-monitor",
        description="Live per-rank telemetry of fsdpx runs. Subcommands: "
        "`fsdpx-monitor replay RUN.tlm`, `fsdpx-monitor export RUN.tlm --csv DIR`.",
    )
    live.add_argument(
        "addresses",
        nargs="*",
        metavar="ADDR",
        help="relay addresses (Unix socket path or host:port); default: this node's relay",
    )
    live.add_argument(
        "--secret-env",
        default=DEFAULT_SECRET_ENV,
        metavar="NAME",
        help="environment variable holding the relays' shared secret",
    )
    live.add_argument(
        "--rendezvous",
        metavar="HOST:PORT",
        help="follow every relay the job published in its rendezvous store (torchrun's "
        "--rdzv-endpoint; needs torch here)",
    )
    live.add_argument(
        "--discovery",
        type=Path,
        metavar="FILE",
        help="follow every relay listed in the job's telemetry.discovery_file",
    )
    live.add_argument(
        "--discover-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="how long to wait for the job to publish its relays (default 60)",
    )
    _add_thresholds(live)

    replay = argparse.ArgumentParser(
        prog="fsdpx-monitor replay", description="Replay a relay's log (*.tlm)."
    )
    replay.add_argument("log", type=Path, metavar="RUN.tlm")
    replay.add_argument("--speed", type=float, default=1.0, help="playback speed (default 1)")
    replay.add_argument("--paused", action="store_true", help="start paused")
    _add_thresholds(replay)

    export = argparse.ArgumentParser(
        prog="fsdpx-monitor export",
        description="Export a relay's log as CSV (one row per rank-step) and/or TensorBoard "
        "event files (needs the optional `tensorboard` package).",
    )
    export.add_argument("log", type=Path, metavar="RUN.tlm")
    export.add_argument("--csv", type=Path, metavar="DIR", help="write records.csv, events.csv")
    export.add_argument("--tensorboard", type=Path, metavar="DIR", help="write event files")
    export.add_argument(
        "--jsonl", type=Path, metavar="FILE", help="write one JSON object per record/event/dump"
    )
    export.add_argument(
        "--prometheus",
        type=Path,
        metavar="FILE",
        help="write each rank's latest record as Prometheus gauges (text format)",
    )
    export.add_argument(
        "--run",
        metavar="RUN",
        help="export only this run id (a log can hold several: a resume, or a relay that "
        "outlived a job); '' picks records written without a run id. Default: every run, "
        "told apart by the run_id column",
    )
    return {"live": live, "replay": replay, "export": export, "demo": _demo_parser()}


def _demo_parser() -> argparse.ArgumentParser:
    from monitor.demo import add_arguments

    # `fsdpx demo` is the documented name; it runs this ([Note: fsdpx demo] in fsdpx/cli.py).
    demo = argparse.ArgumentParser(
        prog="fsdpx demo",
        description="Launch the demo training (python -m fsdpx.demo.train) on CPU ranks with "
        "telemetry on and open the monitor on it in this terminal (plain progress lines when "
        "stdout is not a terminal). Writes a replay log and the training's output under "
        "--out. Also `fsdpx-monitor demo`.",
    )
    add_arguments(demo)
    return demo


def _error(command: str, message: str) -> int:
    print(f"{command}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _check_log(command: str, log: Path) -> str | None:
    """Read the first frame so a wrong path or file fails here, not inside the TUI."""
    try:
        next(iter(iter_log(log)), None)
    except (ValueError, OSError) as exc:
        return str(exc) if isinstance(exc, ValueError) else f"{log}: {exc.strerror}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `fsdpx-monitor`; returns the exit code.

    Example::

        $ fsdpx-monitor replay runs/today.tlm --speed 8
    """
    args_in = list(sys.argv[1:] if argv is None else argv)
    parsers = build_parsers()
    command = args_in[0] if args_in and args_in[0] in SUBCOMMANDS else "live"
    if command == "export":
        return _export(parsers["export"].parse_args(args_in[1:]))
    if command == "demo":
        from monitor.demo import run_demo

        return run_demo(parsers["demo"].parse_args(args_in[1:]))
    if command == "replay":
        args = parsers["replay"].parse_args(args_in[1:])
    else:
        args = parsers["live"].parse_args(args_in)
    return _run_app(command, args)


def _run_app(command: str, args: argparse.Namespace) -> int:
    prog = "fsdpx-monitor" + ("" if command == "live" else f" {command}")
    # Textual and the app are imported here: `export` and errors stay fast, and `export`
    # works without the optional Textual.
    try:
        from monitor.app import MonitorApp
    except ModuleNotFoundError as exc:
        if exc.name != "textual":
            raise
        return _error(prog, TEXTUAL_MISSING)
    from monitor.model import MonitorSettings

    try:
        settings = MonitorSettings(stale_after_s=args.stale_after, dead_after_s=args.dead_after)
        if command == "replay":
            if (problem := _check_log(prog, args.log)) is not None:
                return _error(prog, problem)
            app = MonitorApp(
                replay=args.log,
                settings=settings,
                refresh_hz=args.refresh_hz,
                speed=args.speed,
                paused=args.paused,
            )
        else:
            addresses = live_addresses(args)
            app = MonitorApp(
                sources=addresses,
                settings=settings,
                secret=read_secret(args.secret_env),
                refresh_hz=args.refresh_hz,
            )
    except ValueError as exc:
        return _error(prog, str(exc))
    run_app(app)
    return EXIT_OK


def live_addresses(args: argparse.Namespace, err: TextIO = sys.stderr) -> list[str]:
    """The relays to follow: the ADDR arguments plus every relay the job published
    (--rendezvous / --discovery); this node's relay when none is given.

    Raises:
        ValueError: the published list cannot be found or read (the message says why).
    """
    addresses = list(args.addresses)
    found = []
    if args.discovery is not None:
        found += relays_from_file(args.discovery, args.discover_timeout)
    if args.rendezvous is not None:
        found += relays_from_store(args.rendezvous, args.discover_timeout)
    for entry in found:
        if entry.address not in addresses:
            addresses.append(entry.address)
            node = "?" if entry.node is None else entry.node
            print(
                f"fsdpx-monitor: node {node} ({entry.host}, {len(entry.ranks)} ranks): "
                f"relay {entry.address}",
                file=err,
            )
    return addresses or [str(default_address())]


def run_app(app: MonitorApp) -> None:
    """Run the app in this terminal, after freezing the garbage collector's view of
    everything imported so far.

    [Note: gc.freeze] Decoding thousands of records a second allocates fast, so the cyclic
    GC runs often, and each full collection rescans every long-lived object (Textual's,
    and torch's while importing fsdpx pulls it in): measured at about a third of the
    monitor's CPU at 1,024 ranks. Objects that exist before the app starts live for the
    whole process; `gc.freeze()` moves them out of the collector's scans.
    """
    gc.collect()
    gc.freeze()
    app.run()


def _export(args: argparse.Namespace) -> int:
    from monitor.export import MissingDependency, export_csv, export_tensorboard
    from monitor.export_lines import export_jsonl, export_prometheus

    prog = "fsdpx-monitor export"
    outputs = (args.csv, args.tensorboard, args.jsonl, args.prometheus)
    if all(o is None for o in outputs):
        return _error(
            prog,
            "nothing to export: give --csv DIR, --tensorboard DIR, --jsonl FILE and/or "
            "--prometheus FILE",
        )
    if (problem := _check_log(prog, args.log)) is not None:
        return _error(prog, problem)
    try:
        if args.csv is not None:
            for path in export_csv(args.log, args.csv, run=args.run):
                print(f"wrote {path}")
        if args.tensorboard is not None:
            dirs = export_tensorboard(args.log, args.tensorboard, run=args.run)
            print(f"wrote TensorBoard event files for {len(dirs)} ranks under {args.tensorboard}")
        if args.jsonl is not None:
            lines = export_jsonl(args.log, args.jsonl, run=args.run)
            print(f"wrote {args.jsonl} ({lines} lines)")
        if args.prometheus is not None:
            print(f"wrote {export_prometheus(args.log, args.prometheus, run=args.run)}")
    except (MissingDependency, ValueError) as exc:  # ValueError: an unknown --run
        return _error(prog, str(exc))
    except OSError as exc:
        return _error(prog, f"{exc.filename}: {exc.strerror}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
