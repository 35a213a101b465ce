"""Numbers with adaptive units: bytes (B, KiB, MiB, GiB, TiB) and FLOP rates (FLOP/s up to
PFLOP/s). One place, used by the table, the detail screen and the events log, so a small
value never shows as `0.0 GiB` or `0.0` and every screen spells units the same way."""

from __future__ import annotations

import math
from typing import Any

_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_FLOP_UNITS = ("FLOP/s", "kFLOP/s", "MFLOP/s", "GFLOP/s", "TFLOP/s", "PFLOP/s")


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    v = float(value)
    return v if math.isfinite(v) else None


def _scaled(v: float, step: float, units: tuple[str, ...]) -> tuple[float, str]:
    i = 0
    while abs(v) >= step and i < len(units) - 1:
        v /= step
        i += 1
    return v, units[i]


def _three_digits(v: float) -> str:
    # 3 significant digits without exponent notation: 1.23, 12.3, 123, 1023.
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.3g}" if v else "0"


def fmt_bytes(value: Any, *, compact: bool = False) -> str:
    """Bytes with a binary unit: `512 B`, `1.50 KiB`, `12.3 MiB`, `830 MiB`, `3.00 GiB`; `-` when
    unknown. `compact` is for table cells (at most 6 characters): `512B`, `830M`, `12.3G`.

    Example::

        fmt_bytes(3 << 30)                  # '3.00 GiB'
        fmt_bytes(850 << 20, compact=True)  # '850M'
    """
    v = _finite(value)
    if v is None:
        return "-"
    v, unit = _scaled(v, 1024.0, _BYTE_UNITS)
    if unit == "B" or abs(v) >= 100:
        text = f"{v:.0f}"
    else:
        text = f"{v:.1f}" if compact or abs(v) >= 10 else f"{v:.2f}"
    return text + unit[0] if compact else f"{text} {unit}"


def fmt_flops(tflops: Any) -> str:
    """A FLOP rate given in TFLOP/s (the record's `tflops`) with an adaptive unit:
    `312 TFLOP/s`, `1.25 TFLOP/s`, `48.2 GFLOP/s`, `950 MFLOP/s`; `-` when unknown.

    Example::

        fmt_flops(0.0482)  # '48.2 GFLOP/s'
    """
    v = _finite(tflops)
    if v is None:
        return "-"
    v, unit = _scaled(v * 1e12, 1000.0, _FLOP_UNITS)
    return f"{_three_digits(v)} {unit}"
