"""The `fsdpx` command line.

    fsdpx config show FILE      print FILE's fully resolved config (every default filled) as JSON

Exit codes: 0 success, 2 bad input (unreadable file, invalid config, bad arguments).

Each command group has its own `_add_<group>` function that registers its subcommands
and sets `func` on the parsed namespace; a new command is one more such function and one
line in `build_parser`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_OK = 0
EXIT_BAD_INPUT = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fsdpx", description="DeepSpeed's feature set on PyTorch FSDP2: tools."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_config(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fsdpx` console script; returns the exit code.

    Example::

        $ fsdpx config show train.json
    """
    args = build_parser().parse_args(argv)
    return int(args.func(args))


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


if __name__ == "__main__":
    sys.exit(main())
