"""Per-rank gauges in the Prometheus text exposition format (version 0.0.4), from each
rank's latest record: what the relay serves at `--prometheus-port` and what
`fsdpx-monitor export --prometheus` writes. Stdlib only (the relay and the monitor use it).

One gauge family per numeric record field (`fsdpx_loss`, `fsdpx_step_time_seconds`, ...,
phase times as `fsdpx_phase_seconds{phase="data_wait"}`, the comm wait inside forward,
backward and the optimizer step as `fsdpx_comm_wait_in_phase_seconds{phase="forward"}`),
one sample per rank, labelled `run_id`, `job`, `rank`, `host`; a field a rank does not
report (nil, or absent from an older publisher's records) has no sample.

[Note: Prometheus access]
Prometheus scrapes plain HTTP and cannot do the relay's HMAC handshake (DESIGN, Round 2
clarification 15), so the metrics endpoint has its own rule: it listens on loopback by
default, and any other address needs a bearer token (read from an environment variable,
never the command line) that every scrape must present (`Authorization: Bearer <token>`,
Prometheus's `authorization` / `bearer_token_file` scrape setting); without one the relay
refuses to start, as it does for its own port without a secret.

Example::

    text = prometheus_text({(run_id, 0): record})
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (record field, metric name, help); units in the name as Prometheus names them.
GAUGES: tuple[tuple[str, str, str], ...] = (
    ("step", "fsdpx_step", "optimizer step the rank finished last"),
    ("loss", "fsdpx_loss", "mean micro-batch loss of the rank's last step"),
    ("lr", "fsdpx_learning_rate", "learning rate of param group 0"),
    ("grad_norm", "fsdpx_grad_norm", "total gradient norm before clipping"),
    ("loss_scale", "fsdpx_loss_scale", "fp16 loss scale"),
    ("step_time_s", "fsdpx_step_time_seconds", "wall time of the last step"),
    ("tokens_per_s", "fsdpx_tokens_per_second", "tokens per second on the rank"),
    ("mem_allocated", "fsdpx_mem_allocated_bytes", "CUDA caching allocator, allocated"),
    ("mem_reserved", "fsdpx_mem_reserved_bytes", "CUDA caching allocator, reserved"),
    ("mem_peak", "fsdpx_mem_peak_bytes", "peak allocated since the previous record"),
    ("device_mem_used", "fsdpx_device_mem_used_bytes", "NVML device memory used"),
    ("device_util", "fsdpx_device_util_percent", "NVML GPU utilisation"),
    ("device_power_w", "fsdpx_device_power_watts", "NVML power draw"),
    ("device_temp_c", "fsdpx_device_temp_celsius", "NVML temperature"),
    ("host_rss", "fsdpx_host_rss_bytes", "resident set size of the rank process"),
    ("tflops", "fsdpx_tflops", "achieved model TFLOP/s"),
    ("mfu", "fsdpx_mfu_ratio", "model FLOPs utilisation (0-1)"),
    ("dropped", "fsdpx_dropped_records", "telemetry records the rank lost so far"),
)
PHASES: tuple[str, ...] = ("data_wait", "forward", "backward", "optimizer", "comm_wait", "h2d")
"""The phase label values of fsdpx_phase_seconds (record fields `<phase>_s`)."""
COMM_SPLIT: tuple[str, ...] = ("forward", "backward", "optimizer")
"""The phase label values of fsdpx_comm_wait_in_phase_seconds (record fields
`comm_wait_<phase>_s`, protocol.COMM_SPLIT_FIELDS)."""
# (family, phases, record field of a phase, help)
_PHASE_FAMILIES: tuple[tuple[str, tuple[str, ...], str, str], ...] = (
    (
        "fsdpx_phase_seconds",
        PHASES,
        "{}_s",
        "time of the rank's last step spent in each phase",
    ),
    (
        "fsdpx_comm_wait_in_phase_seconds",
        COMM_SPLIT,
        "comm_wait_{}_s",
        "time of the rank's last step spent waiting for collectives while each phase ran",
    ),
)


def _number(value: Any) -> str | None:
    if isinstance(value, bool):
        return "1" if value else "0"
    if not isinstance(value, int | float):
        return None
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return str(value)


def _label(value: Any) -> str:
    """A label value, escaped as the format requires (backslash, double quote, newline)."""
    text = "" if value is None else str(value)
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(record: Mapping[str, Any], extra: str = "") -> str:
    parts = [
        f'run_id="{_label(record.get("run_id"))}"',
        f'job="{_label(record.get("job"))}"',
        f'rank="{_label(record.get("rank"))}"',
        f'host="{_label(record.get("host"))}"',
    ]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}"


def prometheus_text(latest: Mapping[Any, Mapping[str, Any]]) -> str:
    """The exposition text of the gauges over `latest` (any key -> a rank's newest
    record), families in GAUGES order, samples in key order."""
    records = [latest[k] for k in sorted(latest, key=repr)]
    out: list[str] = []
    for field, name, help_text in GAUGES:
        samples = []
        for rec in records:
            value = _number(rec.get(field))
            if value is not None:
                samples.append(f"{name}{_labels(rec)} {value}")
        if samples:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *samples]
    for name, phases, field_of, help_text in _PHASE_FAMILIES:
        phase_samples = []
        for rec in records:
            for phase in phases:
                value = _number(rec.get(field_of.format(phase)))
                if value is not None:
                    labels = _labels(rec, f'phase="{phase}"')
                    phase_samples.append(f"{name}{labels} {value}")
        if phase_samples:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *phase_samples]
    return "\n".join(out) + "\n" if out else ""
