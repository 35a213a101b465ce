"""Text for `fsdpx config explain`: the translated config and the per-key table, and the
whole DeepSpeed key table (mapped / ignored / refused) as Markdown."""

from __future__ import annotations

import json
from collections.abc import Sequence

from fsdpx.config import Config
from fsdpx.deepspeed._config import Row, summary_line
from fsdpx.deepspeed._keys import DS_KEYS


def _cell(value: object, width: int) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def format_rows(rows: Sequence[Row]) -> str:
    """One line per DeepSpeed key: key, value, status, and the fsdpx value or the reason.

    Example::

        print(format_rows(explain("ds_config.json")[0]))
    """
    width = max([len(r.key) for r in rows] + [len("DeepSpeed key")])
    lines = [f"{'DeepSpeed key':<{width}}  {'value':<14}  {'status':<8}  fsdpx / reason"]
    for r in rows:
        lines.append(f"{r.key:<{width}}  {_cell(r.value, 14):<14}  {r.status:<8}  {r.detail}")
    return "\n".join(lines)


def format_explain(rows: Sequence[Row], cfg: Config | None, name: str, world_size: int) -> str:
    """The translated config as JSON (when translation succeeded), the table, and the
    summary line Config.from_deepspeed logs."""
    parts = []
    if cfg is not None:
        parts.append(f"# fsdpx config translated from {name} (world size {world_size})")
        parts.append(json.dumps(cfg.to_dict(), indent=2))
        parts.append("")
    parts.append(f"# DeepSpeed keys of {name}")
    parts.append(format_rows(rows))
    if cfg is not None:
        parts.append("")
        parts.append(summary_line(tuple(rows), name, world_size))
    return "\n".join(parts)


def key_table_markdown() -> str:
    """Every DeepSpeed key fsdpx knows, as a Markdown table (README / closing notes).

    Example::

        print(key_table_markdown())
    """
    lines = ["| DeepSpeed key | fsdpx | notes |", "|---|---|---|"]
    for key, rule in DS_KEYS.items():
        if rule.action == "section" and not rule.note:
            continue
        if rule.action == "mapped":
            what = f"`{rule.target}`" if rule.target else "mapped (derived)"
        elif rule.action == "refused" and rule.accept:
            off = ", ".join(json.dumps(a) for a in rule.accept)
            what = f"refused (accepted when {off})"
        else:
            what = rule.action
        note = rule.note.replace("|", "\\|")
        lines.append(f"| `{key}` | {what} | {note} |")
    return "\n".join(lines)
