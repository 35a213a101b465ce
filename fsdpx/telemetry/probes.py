"""Readers of process and device state for telemetry records, each optional and silent.

- `AllocatorProbe`: the CUDA caching allocator (allocated, reserved, per-interval peak,
  retries, OOMs). Host-side counters only: reading them never syncs the device.
- `NvmlProbe`: NVML (the `nvidia-ml-py` package, imported as `pynvml`) for the device
  memory, utilisation, power and temperature, found by the device's UUID (not its
  index, which CUDA_VISIBLE_DEVICES and MIG renumber). No package, no driver, no
  matching device: the probe reports nothing, says why once in `unavailable`, and
  never raises.
- `host_rss`: resident set size from /proc/self/statm (None elsewhere).

Example::

    nvml = NvmlProbe.for_device(torch.device("cuda", 0))
    nvml.sample()      # {"device_mem_used": ..., ...} or all None
"""

from __future__ import annotations

import os
from typing import Any

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
NVML_FIELDS = (
    "device_mem_used",
    "device_mem_total",
    "device_util",
    "device_power_w",
    "device_temp_c",
)


def host_rss() -> int | None:
    """This process's resident set size in bytes (Linux), else None."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class AllocatorProbe:
    """CUDA caching-allocator numbers for one device; all None on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def at_step(self) -> tuple[int | None, int | None, int | None]:
        """(allocated, reserved, peak since the last call): read on the training thread
        at the step boundary, then the peak counter is reset for the next interval."""
        if not self.cuda:
            return None, None, None
        allocated = torch.cuda.memory_allocated(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        return allocated, reserved, peak

    def counters(self) -> tuple[int | None, int | None]:
        """(alloc retries, OOMs), cumulative; read on the sender thread (a dict build)."""
        if not self.cuda:
            return None, None
        stats = torch.cuda.memory_stats(self.device)
        return stats.get("num_alloc_retries"), stats.get("num_ooms")


class NvmlProbe:
    """NVML metrics of one device (module docstring). Use `for_device` to make one."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml = nvml
        self._handle = handle
        self.unavailable: str | None = None if handle is not None else "no device"

    @classmethod
    def for_device(cls, device: torch.device) -> NvmlProbe:
        """The probe for `device`; an inert one (with `unavailable` set) when NVML cannot
        serve it. Never raises."""
        if device.type != "cuda":
            return cls._inert("not a CUDA device")
        try:
            import pynvml
        except ImportError:
            return cls._inert("nvidia-ml-py is not installed (pip install nvidia-ml-py)")
        try:
            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            for candidate in (uuid, f"GPU-{uuid}", f"MIG-{uuid}"):
                try:
                    return cls(pynvml, pynvml.nvmlDeviceGetHandleByUUID(candidate))
                except pynvml.NVMLError:
                    continue
            return cls._inert(f"NVML has no device with UUID {uuid}")
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return cls._inert(f"NVML unavailable: {exc}")

    @classmethod
    def _inert(cls, why: str) -> NvmlProbe:
        probe = cls(None, None)
        probe.unavailable = why
        return probe

    def sample(self) -> dict[str, float | int | None]:
        """Device memory (bytes), utilisation (%), power (W), temperature (C); None for
        any value NVML does not give. After a failure the probe goes inert (no retry
        storm, no log flood)."""
        out: dict[str, float | int | None] = dict.fromkeys(NVML_FIELDS)
        if self._handle is None:
            return out
        nvml, handle = self._nvml, self._handle
        try:
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            out["device_mem_used"], out["device_mem_total"] = int(mem.used), int(mem.total)
        except Exception as exc:
            self._handle, self.unavailable = None, f"NVML memory query failed: {exc}"
            return out
        for key, read in (
            ("device_util", lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu),
            ("device_power_w", lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            (
                "device_temp_c",
                lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            ),
        ):
            try:
                out[key] = read()
            except Exception:
                out[key] = None  # e.g. not supported on MIG slices: leave unknown
        return out
