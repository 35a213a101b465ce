"""monitor/units.py: adaptive units, so small values never read `0.0 GiB` or `0.0`."""

from __future__ import annotations

import pytest

from monitor.units import fmt_bytes, fmt_flops

KIB, MIB, GIB = 1024, 1024**2, 1024**3


@pytest.mark.parametrize(
    ("value", "full", "compact"),
    [
        (0, "0 B", "0B"),
        (512, "512 B", "512B"),
        (1536, "1.50 KiB", "1.5K"),
        (12.3 * MIB, "12.3 MiB", "12.3M"),
        (830 * MIB, "830 MiB", "830M"),
        (3 * GIB, "3.00 GiB", "3.0G"),
        (1023 * MIB, "1023 MiB", "1023M"),
        (None, "-", "-"),
        (float("nan"), "-", "-"),
        (True, "-", "-"),
    ],
)
def test_fmt_bytes(value: object, full: str, compact: str) -> None:
    assert fmt_bytes(value) == full
    assert fmt_bytes(value, compact=True) == compact
    assert len(compact) <= 6  # fits the table's 6-wide memory columns


@pytest.mark.parametrize(
    ("tflops", "text"),
    [
        (312.0, "312 TFLOP/s"),
        (1.25, "1.25 TFLOP/s"),
        (0.0482, "48.2 GFLOP/s"),
        (0.00095, "950 MFLOP/s"),
        (0.0, "0 FLOP/s"),
        (None, "-"),
    ],
)
def test_fmt_flops(tflops: object, text: str) -> None:
    assert fmt_flops(tflops) == text
