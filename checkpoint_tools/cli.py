"""`fsdpx-ckpt`: consolidate, inspect and verify fsdpx checkpoints offline.

Needs no GPU, no torch.distributed process group and no fsdpx runtime: it imports only
the checkpoint format package. Exit status: 0 success, 1 the checkpoint failed (missing,
corrupt, invalid), 2 bad command-line usage.

    fsdpx-ckpt inspect ckpt/                       # follows ckpt/latest
    fsdpx-ckpt verify ckpt/global_step100
    fsdpx-ckpt consolidate ckpt/ out/ --dtype bf16 --max-shard-size 5GB
    fsdpx-ckpt consolidate ckpt/ model.pt          # torch.save state dict
    fsdpx-ckpt consolidate run/checkpoint-40/fsdpx out/ --hf-config run/checkpoint-40
    fsdpx-ckpt import-deepspeed ds_ckpt/ ckpt/     # DeepSpeed ZeRO/universal -> fsdpx
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from checkpoint_tools.consolidate import CASTS, consolidate, select
from checkpoint_tools.format import CheckpointError, CheckpointReader, DeepSpeedCheckpointError
from checkpoint_tools.format.root import resolve_checkpoint
from checkpoint_tools.progress import Progress
from checkpoint_tools.report import format_text, human, summary

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'5GB' -> 5*10**9, '500MiB' -> 500*2**20, '1234' -> 1234 (Hugging Face's units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"expected a size like 5GB, 500MiB or 1000000; got {text!r}"
        )
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive; got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsdpx-ckpt", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write full tensors as safetensors or a torch file")
    c.add_argument("checkpoint", help="checkpoint directory, or a root with a `latest` file")
    c.add_argument("out", help="output directory or .safetensors file; .pt/.pth/.bin = torch.save")
    c.add_argument(
        "--to",
        choices=["safetensors", "torch"],
        default=None,
        help="output kind (default: from the OUT suffix)",
    )
    c.add_argument(
        "--dtype",
        choices=sorted(CASTS),
        default=None,
        help="cast floating-point model tensors (default: keep stored dtype)",
    )
    c.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=None,
        help="split safetensors into HF-style shards of at most this size (e.g. 5GB)",
    )
    c.add_argument(
        "--optimizer",
        action="store_true",
        help="include optimizer state tensors (optim/<fqn>/<key>)",
    )
    c.add_argument(
        "--hf-config",
        metavar="DIR",
        default=None,
        help="Hugging Face layout: also copy config.json (and generation_config.json when "
        "present) from DIR, e.g. the checkpoint-N folder of an fsdpx.hf.Trainer run",
    )
    i = sub.add_parser("inspect", help="list tensors, shapes, dtypes, sizes, compression, layout")
    i.add_argument("checkpoint")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    v = sub.add_parser("verify", help="check every checksum; exit 1 naming the first bad chunk")
    v.add_argument("checkpoint")
    v.add_argument("--deep", action="store_true", help="also decompress every chunk")
    d = sub.add_parser(
        "import-deepspeed",
        help="convert a DeepSpeed ZeRO or universal checkpoint, optimizer state included",
        description="Convert a DeepSpeed checkpoint (ZeRO 0-3 or ds_to_universal output) "
        "into an fsdpx checkpoint OUT_DIR/<tag> (and OUT_DIR/latest) that "
        "engine.load_checkpoint(OUT_DIR) resumes: fp32 weights, Adam moments and step, "
        "counters, scheduler, loss scaler, client_state. Unpickles only an allow-list "
        "(checkpoint_tools/DEEPSPEED.md).",
    )
    d.add_argument("ds_dir", help="DeepSpeed checkpoint root (with `latest`) or tag directory")
    d.add_argument("out_dir", help="fsdpx checkpoint root to write into")
    d.add_argument("--tag", default=None, help="DeepSpeed tag to import (default: `latest`)")
    d.add_argument(
        "--rename",
        action="append",
        default=[],
        metavar="REGEX=REPL",
        help="rewrite parameter names with re.sub (repeatable, applied in order)",
    )
    d.add_argument(
        "--compression",
        choices=["zstd", "none"],
        default="zstd",
        help="chunk compression of the output (default zstd)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `fsdpx-ckpt` console script. Returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "verify":
            return _verify(args)
        if args.command == "import-deepspeed":
            return _import_deepspeed(args)
        return _consolidate(args)
    except CheckpointError as exc:
        print(f"fsdpx-ckpt {args.command}: FAILED: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"fsdpx-ckpt {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _open(path: str) -> CheckpointReader:
    target = resolve_checkpoint(path)
    if str(target) != path.rstrip("/"):
        print(f"using {target}", file=sys.stderr)
    return CheckpointReader(target)


def _inspect(args: argparse.Namespace) -> int:
    try:
        reader = _open(args.checkpoint)
    except DeepSpeedCheckpointError:
        # A DeepSpeed folder: describe it (and what an import keeps) instead.
        from checkpoint_tools.deepspeed.describe import describe, format_description

        ds = describe(args.checkpoint)
        print(json.dumps(ds, indent=2) if args.json else format_description(ds))
        return 0
    with reader:
        info = summary(reader)
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 0


def _verify(args: argparse.Namespace) -> int:
    with _open(args.checkpoint) as reader:
        total = sum(rf.data_size for rf in reader.rank_files)
        with Progress("verify", total) as bar:
            reader.verify(bar.update, deep=args.deep)
        n = len(reader.names())
        print(
            f"OK: {reader.directory}: {n} tensors, {reader.world_size} ranks, "
            f"{human(total)} checked"
        )
    return 0


def _hf_config_files(args: argparse.Namespace) -> list[Path]:
    """The config files --hf-config copies, checked before anything is written."""
    if args.hf_config is None:
        return []
    if args.optimizer or args.to == "torch" or Path(args.out).suffix:
        raise ValueError(
            "--hf-config writes a Hugging Face model directory: OUT must be a directory "
            "(no suffix), safetensors, without --optimizer"
        )
    src = Path(args.hf_config)
    if not (src / "config.json").is_file():
        raise ValueError(f"--hf-config {src}: no config.json there (expected a model directory)")
    return [p for p in (src / "config.json", src / "generation_config.json") if p.is_file()]


def _consolidate(args: argparse.Namespace) -> int:
    configs = _hf_config_files(args)
    target = resolve_checkpoint(args.checkpoint)
    with CheckpointReader(target) as reader:
        cast = CASTS[args.dtype] if args.dtype else None
        total = sum(
            e.nbytes for _, e in select(reader, include_optimizer=args.optimizer, dtype=cast)
        )
    with Progress("consolidate", total) as bar:
        paths = consolidate(
            target,
            args.out,
            to=args.to,
            dtype=args.dtype,
            include_optimizer=args.optimizer,
            max_shard_bytes=args.max_shard_size,
            progress=bar.update,
        )
    for config in configs:
        copied = Path(args.out) / config.name
        shutil.copyfile(config, copied)
        paths.append(copied)
    for path in paths:
        print(path)
    return 0


def _import_deepspeed(args: argparse.Namespace) -> int:
    from checkpoint_tools.deepspeed import import_deepspeed, parse_renames

    report = import_deepspeed(
        args.ds_dir, args.out_dir, tag=args.tag, renames=parse_renames(args.rename)
    )
    for line in report.lines():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
