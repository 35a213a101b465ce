"""The value checks every config section uses (one wording for every error)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

DType = Literal["fp32", "bf16", "fp16"]


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"config key '{key}' must be {allowed}; got {value!r}")


def check_unused(obj: Any, section: str, chooser: str, reads: frozenset[str]) -> None:
    """Reject fields that the variant named by `chooser` does not read, when they are set
    away from their defaults: a silently ignored option is a bug. A key written with its
    default value passes, so `from_dict(cfg.to_dict())` always works."""
    choice = getattr(obj, chooser)
    unused = [
        f"'{section}.{f.name}' ({getattr(obj, f.name)!r})"
        for f in dataclasses.fields(obj)
        if f.name != chooser and f.name not in reads and getattr(obj, f.name) != f.default
    ]
    if unused:
        what, it = ("key", "it") if len(unused) == 1 else ("keys", "them")
        read = ", ".join(sorted(reads)) or "no keys"
        raise ValueError(
            f"config {what} {', '.join(unused)} set, but {section}.{chooser} {choice!r} does "
            f"not read {it}; {choice!r} reads: {read}. Remove the {what}, or set "
            f"{section}.{chooser} to one that uses {it}."
        )
