"""The `fsdpx` command line.

    fsdpx config show FILE      print FILE's fully resolved config (every default filled) as JSON
    fsdpx config explain FILE   translate a DeepSpeed config; table of mapped/ignored/refused keys
    fsdpx estimate --params 1.3B --world-size 64   per-rank memory per ZeRO stage / offload
    fsdpx demo                  train the demo GPT on 2 CPU ranks and watch it live
    fsdpx launch [--hostfile F] SCRIPT ARGS   DeepSpeed's launcher arguments, torchrun agents

Exit codes: 0 success, 2 bad input (unreadable file, invalid config, bad arguments).

Each command group has its own `_add_<group>` function that registers its subcommands
and sets `func` on the parsed namespace; a new command is one more such function and one
line in `build_parser`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

EXIT_OK = 0
EXIT_BAD_INPUT = 2
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a command a pipe cut short


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdpx", description="DeepSpeed's feature set on PyTorch FSDP2: tools."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_config(commands)
    _add_estimate(commands)
    _add_demo(commands)
    _add_launch(commands)
    return parser


def _add_launch(commands: argparse._SubParsersAction) -> None:
    # Parsed by fsdpx.launch.cli (the script's own arguments follow it unparsed).
    commands.add_parser(
        "launch",
        add_help=False,
        help="start a job on one or many hosts with DeepSpeed's launcher arguments "
        "(fsdpx launch --help)",
    )


def _add_demo(commands: argparse._SubParsersAction) -> None:
    # Its options (--help included) are the monitor's: passed on unparsed.
    commands.add_parser(
        "demo",
        add_help=False,
        help="train the demo GPT on 2 CPU ranks with the live monitor (fsdpx demo --help)",
    )


def _demo(argv: Sequence[str]) -> int:
    """Run `fsdpx-monitor demo ARGV` as a child process; its exit code.

    [Note: fsdpx demo] The demo is the monitor's (monitor/demo.py: a relay, the TUI or
    progress lines) and the training it watches is the library's (`python -m
    fsdpx.demo.train`, shipped in the package so a pip install runs it). The dependency
    goes monitor -> fsdpx only: this command starts `python -m monitor demo` with this
    interpreter instead of importing monitor, so the library never imports the monitor's
    code (nor Textual).
    """
    child = subprocess.Popen([sys.executable, "-m", "monitor", "demo", *argv])
    while True:
        try:
            return child.wait()
        except KeyboardInterrupt:
            # Ctrl-C reached the child too (same process group): it stops its training
            # cleanly and exits; wait for that rather than orphaning it.
            continue


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fsdpx` console script; returns the exit code.

    Example::

        $ fsdpx config show train.json
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        from fsdpx.launch.cli import main as launch_main
        from fsdpx.launch.cli import parse as launch_parse

        return launch_main(launch_parse(argv[1:]))
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        return _demo(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return int(args.func(args))
    except BrokenPipeError:
        # The reader went away (`fsdpx config explain ... | head`): not an error of ours.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


# --- fsdpx config ... -----------------------------------------------------------------


def _add_config(commands: argparse._SubParsersAction) -> None:
    config = commands.add_parser("config", help="inspect training config files")
    sub = config.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    show = sub.add_parser(
        "show",
        help="print the fully resolved config as JSON",
        description="Parse FILE (JSON or TOML, fsdpx keys) strictly and print the resolved "
        "config with every default filled in.",
    )
    show.add_argument("file", metavar="FILE", type=Path)
    show.set_defaults(func=_config_show)
    _add_config_explain(sub)


def _config_show(args: argparse.Namespace) -> int:
    from fsdpx.config import Config

    try:
        cfg = Config.from_file(args.file)
    except (ValueError, OSError) as exc:
        message = str(exc) if isinstance(exc, ValueError) else f"{args.file}: {exc.strerror}"
        print(f"fsdpx config show: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(cfg.to_dict(), indent=2))
    return EXIT_OK


def _add_config_explain(sub: argparse._SubParsersAction) -> None:
    explain = sub.add_parser(
        "explain",
        help="translate a DeepSpeed config and show what each key became",
        description="Translate a DeepSpeed ds_config file (JSON with // and /* */ comments "
        "and trailing commas) and print the fsdpx config and, for every key, whether it was "
        "mapped (and to what), ignored (and why) or refused (and what to use instead). "
        "With --all-keys, print every DeepSpeed key fsdpx knows as a Markdown table.",
    )
    explain.add_argument("file", metavar="FILE", type=Path, nargs="?")
    explain.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="ranks in the job (batch-size rule, MiCS); default: $WORLD_SIZE, else 1",
    )
    explain.add_argument("--all-keys", action="store_true", help="print the whole key table")
    explain.set_defaults(func=_config_explain)


def _config_explain(args: argparse.Namespace) -> int:
    from fsdpx.deepspeed._config import explain, world_size_from_env
    from fsdpx.deepspeed._explain import format_explain, key_table_markdown

    if args.all_keys:
        print(key_table_markdown())
        return EXIT_OK
    if args.file is None:
        print("fsdpx config explain: error: give FILE or --all-keys", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        rows, cfg, error = explain(args.file, world_size=args.world_size)
    except (ValueError, OSError) as exc:
        message = str(exc) if isinstance(exc, ValueError) else f"{args.file}: {exc.strerror}"
        print(f"fsdpx config explain: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    world = world_size_from_env(args.world_size)
    print(format_explain(rows, cfg, str(args.file), world))
    if error is not None:
        print(f"fsdpx config explain: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


# --- fsdpx estimate -------------------------------------------------------------------


def _add_estimate(commands: argparse._SubParsersAction) -> None:
    est = commands.add_parser(
        "estimate",
        help="per-rank memory for each ZeRO stage and offload setting",
        description="Per-rank bytes of parameters, gradients and optimizer state for each "
        "ZeRO stage and offload setting, next to DeepSpeed's estimators; with --model "
        "returning (model, sample_inputs), also activations and the peak from a fake run of "
        "the real sharding (any world size, nothing allocated).",
    )
    what = est.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="parameter count, e.g. 1.3B, 350M, 7e9")
    what.add_argument(
        "--model",
        metavar="MODULE:FUNCTION",
        help="a function returning the model, or (model, sample_inputs); built on meta",
    )
    cfg = est.add_mutually_exclusive_group()
    cfg.add_argument("--config", type=Path, help="an fsdpx config file (JSON or TOML)")
    cfg.add_argument("--deepspeed", type=Path, help="a DeepSpeed config file")
    est.add_argument("--world-size", type=int, default=None, help="default: --sp, else 1")
    est.add_argument("--largest-layer-params", help="stage 3 with --params: largest block")
    est.add_argument("--gpus-per-node", type=int, default=None)
    long = est.add_argument_group(
        "long context", "activations per rank and the longest sequence that fits (needs --shape)"
    )
    long.add_argument("--seq-len", type=int, help="tokens per sequence")
    long.add_argument("--sp", type=int, help="mesh.sp (default: the config's)")
    long.add_argument(
        "--shape",
        help="the decoder's shape: layers=,hidden=,heads=,kv_heads=,ffn=,vocab=",
    )
    long.add_argument("--device-memory", type=float, default=80.0, help="GiB per rank")
    long.add_argument("--mlp-tile", type=int, help="context_parallel.mlp_tile_tokens")
    long.add_argument("--loss-tile", type=int, default=0, help="tokens per loss tile")
    long.add_argument(
        "--checkpointing",
        choices=("none", "full", "every_n", "selective"),
        help="activation_checkpointing.mode (default: the config's)",
    )
    long.add_argument("--micro-batch", type=int, default=1, help="sequences per rank")
    long.add_argument("--cp-mode", choices=("ulysses", "ring"), help="context_parallel.mode")
    est.set_defaults(func=_estimate)


def _estimate(args: argparse.Namespace) -> int:
    import importlib
    import os

    from fsdpx.config import Config
    from fsdpx.estimate import estimate_report, parse_count
    from fsdpx.estimate_comm import comm_table, format_comm_table

    try:
        if args.config is not None:
            cfg = Config.from_file(args.config)
        elif args.deepspeed is not None:
            cfg = Config.from_deepspeed(args.deepspeed, world_size=args.world_size)
        else:
            cfg = Config()
        cfg = _long_context_config(cfg, args)
        world_size = args.world_size or cfg.mesh.sp
        sample = None
        if args.model is not None:
            module_name, _, fn_name = args.model.partition(":")
            if os.getcwd() not in sys.path:  # `fsdpx` run from a project: import its modules
                sys.path.insert(0, os.getcwd())
            import torch

            with torch.device("meta"):
                built = getattr(importlib.import_module(module_name), fn_name)()
            model, sample = built if isinstance(built, tuple) else (built, None)
            target = model
        else:
            target = parse_count(args.params)
        layer = args.largest_layer_params
        text = estimate_report(
            target,
            cfg,
            world_size,
            sample_inputs=sample,
            largest_layer_params=parse_count(layer) if layer else None,
            gpus_per_node=args.gpus_per_node,
        )
        volume = format_comm_table(comm_table(target, cfg, world_size))
        text = f"{text}\n\n{volume}"
        if args.seq_len is not None:
            text = f"{text}\n\n{_long_context(target, cfg, world_size, args)}"
    except (ValueError, OSError, ImportError, AttributeError) as exc:
        print(f"fsdpx estimate: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(text)
    return EXIT_OK


def _long_context_config(cfg: Any, args: argparse.Namespace) -> Any:
    """cfg with the long-context flags (--sp, --mlp-tile, --checkpointing, --cp-mode)."""
    from dataclasses import replace

    long_flags = (args.sp, args.shape, args.mlp_tile, args.checkpointing, args.cp_mode)
    if args.seq_len is None:
        if any(flag is not None for flag in long_flags):
            raise ValueError(
                "--sp, --shape, --mlp-tile, --checkpointing and --cp-mode describe a long-context "
                "estimate; add --seq-len N (and --shape)"
            )
        return cfg
    if args.shape is None:
        raise ValueError(
            "--seq-len needs the decoder's shape for its activations: add --shape "
            "layers=32,hidden=4096,heads=32,kv_heads=8,ffn=14336,vocab=128256 (your model's)"
        )
    cp = cfg.context_parallel
    cp = replace(
        cp,
        mode=args.cp_mode or cp.mode,
        mlp_tile_tokens=cp.mlp_tile_tokens if args.mlp_tile is None else args.mlp_tile,
    )
    ac = cfg.activation_checkpointing
    if args.checkpointing is not None:
        ac = replace(ac, mode=args.checkpointing)
    mesh = cfg.mesh if args.sp is None else replace(cfg.mesh, sp=args.sp)
    return replace(cfg, mesh=mesh, context_parallel=cp, activation_checkpointing=ac)


def _long_context(target: Any, cfg: Any, world_size: int, args: argparse.Namespace) -> str:
    import torch

    from fsdpx.estimate import estimate_memory
    from fsdpx.estimate_activations import TransformerShape, long_context_report
    from fsdpx.precision import torch_dtype

    own = estimate_memory(target, cfg, world_size)
    return long_context_report(
        TransformerShape.parse(args.shape),
        seq_len=args.seq_len,
        sp=cfg.mesh.sp,
        mode=cfg.context_parallel.mode,
        mlp_tile=cfg.context_parallel.mlp_tile_tokens,
        loss_tile=args.loss_tile,
        checkpointing=cfg.activation_checkpointing.mode,
        micro_batch=args.micro_batch,
        dtype_bytes=torch.empty((), dtype=torch_dtype(cfg.precision.param_dtype)).element_size(),
        model_states=own.device_model_states + (own.gathered_params or 0),
        device_memory=int(args.device_memory * 2**30),
    )


if __name__ == "__main__":
    sys.exit(main())
