"""What `fsdpx-ckpt inspect` shows: per-checkpoint layout and per-tensor sizes."""

from __future__ import annotations

from typing import Any

from checkpoint_tools.format import CheckpointReader, TensorMeta


def describe_layout(meta: TensorMeta) -> str:
    """Short description of how a tensor is split: "whole", "4 pieces along dim 0",
    "2x2 grid", with "xN replicas" when ranks hold identical pieces."""
    boxes = {(p.offsets, p.shape) for p in meta.pieces}
    replicas = len(meta.pieces) // max(len(boxes), 1)
    split_dims = [d for d in range(len(meta.shape)) if len({off[d] for off, _ in boxes}) > 1]
    if len(boxes) == 1:
        text = "whole"
    elif len(split_dims) == 1:
        text = f"{len(boxes)} pieces along dim {split_dims[0]}"
    else:
        text = f"{len(boxes)} pieces along dims {split_dims}"
    return f"{text}, x{replicas} replicas" if replicas > 1 else text


def tensor_rows(reader: CheckpointReader) -> list[dict[str, Any]]:
    """One dict per tensor: name, dtype, shape, raw bytes (one copy), stored bytes (all
    pieces, replicas included), stored_ratio = stored / raw bytes of the chunks
    (0.83 means compression saved 17%), layout."""
    rows = []
    for name in reader.names():
        m = reader.meta(name)
        chunks = [c for p in m.pieces for c in p.chunks]
        raw = sum(c.raw_size for c in chunks)
        stored = sum(c.stored_size for c in chunks)
        rows.append(
            {
                "name": name,
                "dtype": str(m.dtype).removeprefix("torch."),
                "shape": list(m.shape),
                "bytes": m.nbytes,
                "stored_bytes": stored,
                "stored_ratio": stored / raw if raw else 1.0,
                "pieces": len(m.pieces),
                "layout": describe_layout(m),
            }
        )
    return rows


def summary(reader: CheckpointReader) -> dict[str, Any]:
    """Checkpoint-level facts for `inspect` (JSON-serialisable)."""
    rows = tensor_rows(reader)
    return {
        "directory": str(reader.directory),
        "format_version": "{}.{}".format(*reader.format_version),
        "writer": reader.writer,
        "world_size": reader.world_size,
        "files": [
            {
                "rank": rf.rank,
                "data_file": rf.data_file,
                "data_bytes": rf.data_size,
                "index_file": rf.index_file,
                "index_bytes": rf.index_size,
            }
            for rf in reader.rank_files
        ],
        "state_keys": sorted(str(k) for k in reader.state),
        "tensors": rows,
        "total_bytes": sum(r["bytes"] for r in rows),
        "stored_bytes": sum(rf.data_size for rf in reader.rank_files),
    }


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def format_text(info: dict[str, Any]) -> str:
    """Human-readable table of `summary(reader)`."""
    lines = [
        f"checkpoint  {info['directory']}",
        f"format      {info['format_version']} ({info['writer']})",
        f"world size  {info['world_size']}",
        f"tensors     {len(info['tensors'])}, {human(info['total_bytes'])} "
        f"({human(info['stored_bytes'])} in data files)",
        f"state keys  {', '.join(info['state_keys']) or '-'}",
        "",
    ]
    rows = info["tensors"]
    width = max([len(r["name"]) for r in rows] + [4])
    lines.append(
        f"{'name':<{width}}  {'dtype':<14} {'shape':<20} {'size':>10} {'stored':>10} {'of raw':>7}  layout"
    )
    for r in rows:
        shape = "x".join(map(str, r["shape"])) or "()"
        lines.append(
            f"{r['name']:<{width}}  {r['dtype']:<14} {shape:<20} {human(r['bytes']):>10} "
            f"{human(r['stored_bytes']):>10} {r['stored_ratio']:7.1%}  {r['layout']}"
        )
    lines.append("")
    for f in info["files"]:
        lines.append(
            f"rank {f['rank']:>5}  {f['data_file']} {human(f['data_bytes'])}, "
            f"{f['index_file']} {human(f['index_bytes'])}"
        )
    return "\n".join(lines)
