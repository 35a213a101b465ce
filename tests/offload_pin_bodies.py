"""Per-rank body of tests/test_offload_pin.py (module level, so spawned ranks import it)."""

from __future__ import annotations

import logging
import traceback
from pathlib import Path
from typing import Any

import fsdpx
from fsdpx.offload import pin
from tests import offload_bodies as ob


class _Lines(logging.Handler):
    """Collects the "pin_memory=true is ignored" messages logged on the "fsdpx" logger."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "pin_memory=true is ignored" in message and record.levelno == logging.INFO:
            self.lines.append(message)


def ds_parity_body(
    rank: int, world_size: int, cases: dict[str, dict[str, Any]], root: str
) -> dict[str, Any]:
    """cases: name -> {"ds": a DeepSpeed config dict} (read with Config.from_deepspeed) or
    {"cfg": an fsdpx config dict, "same": bool}. Each trains ob.STEPS steps from the same
    seed as tests/test_offload.py's parity cases (ob.run_case); its record gains "pin_logs",
    the INFO lines about pin_memory logged while the case was translated, built and trained
    (the once-per-process memory is cleared before each case, so each case starts fresh).
    A case that raises records {"error": traceback}."""
    logger = logging.getLogger("fsdpx")
    logger.setLevel(logging.INFO)
    handler = _Lines()
    logger.addHandler(handler)
    out: dict[str, Any] = {}
    for name, case in cases.items():
        pin._said.clear()
        handler.lines = []
        try:
            if "ds" in case:
                cfg = fsdpx.Config.from_deepspeed(case["ds"], world_size=world_size)
            else:
                cfg = fsdpx.Config.from_dict(case["cfg"])
            out[name] = ob.run_case(cfg, Path(root), name, same=case.get("same", False))
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        out[name]["pin_logs"] = handler.lines
    logger.removeHandler(handler)
    return out
