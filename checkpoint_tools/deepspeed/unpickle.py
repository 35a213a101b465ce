"""Reading DeepSpeed's pickled `*.pt` files without running code from them.

[Note: DeepSpeed pickles]
DeepSpeed saves its checkpoints with `torch.save`: pickles that may name any importable
callable, so loading one with plain `pickle` (or `torch.load(weights_only=False)`) runs
whatever the file says. Here every file goes through `torch.load(weights_only=True)`:
torch's own restricted unpickler, which builds tensors, containers and torch's plain
types and refuses every other global. The few DeepSpeed classes real checkpoints
contain are mapped, for the duration of one load (torch's `safe_globals` context, under
a lock; nothing stays installed), to inert stand-ins (`Stand_in`): objects that record
their constructor arguments and pickled state and have no behaviour. DeepSpeed itself is
never imported. Anything else is refused with `DeepSpeedImportError` naming the global;
there is deliberately no switch to load more.

The allow-list (ALLOWED), each with the reason a real checkpoint holds it:
- `deepspeed.runtime.fp16.loss_scaler.LossScaler`, `...DynamicLossScaler`: the ZeRO
  fp16 optimizers pickle their loss-scaler object under `loss_scaler` (bf16/fp32
  checkpoints hold a LossScaler with scale 1). Its attributes (`cur_scale`, `cur_iter`,
  `last_overflow_iter`, `cur_hysteresis`, ...) are the scaler state the import keeps.
- `deepspeed.runtime.zero.config.ZeroStageEnum`: the `zero_stage` entry of the
  optimizer state (an IntEnum, pickled as a call with the stage number).
- `deepspeed.utils.tensor_fragment.fragment_address`: the `param_slice_mappings` of
  ZeRO 1/2 optimizer files (a dataclass: numel and start of a parameter's slice).
- `deepspeed.checkpoint.constants` has no classes; the universal checkpoint's files
  hold only tensors, dicts and strings.
Files are memory-mapped (`mmap=True`, so torch's zip format only: what torch.save has
written since torch 1.6), so a partition file's tensors are paged in as the importer
reads them rather than all at once.
"""

from __future__ import annotations

import pickle
import re
import threading
from pathlib import Path
from typing import Any, ClassVar

import torch

from checkpoint_tools.format.errors import DeepSpeedImportError


class Stand_in:  # noqa: N801 - named for what it is, not a real class of DeepSpeed's
    """An inert object standing for a DeepSpeed class: keeps constructor arguments and
    pickled state, nothing else."""

    ds_name: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Stand_in:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = {}
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) as pickle does
            merged = dict(state[0] or {})
            merged.update(state[1] or {})
            state = merged
        self.state = state if isinstance(state, dict) else {"state": state}

    args: tuple[Any, ...]
    state: dict[str, Any]

    def __repr__(self) -> str:
        return f"<stand-in for {self.ds_name} args={self.args} state={self.state}>"


def _stand_in(name: str) -> type[Stand_in]:
    return type(name.rsplit(".", 1)[1], (Stand_in,), {"ds_name": name})


ALLOWED: dict[str, type[Stand_in]] = {
    name: _stand_in(name)
    for name in (
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    )
}

_LOCK = threading.Lock()
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def load(path: Path) -> Any:
    """The object pickled in DeepSpeed file `path`, with DeepSpeed classes as Stand_in
    instances and tensors on the CPU (memory-mapped when the file is torch's zip format).

    Raises:
        DeepSpeedImportError: the file is missing, truncated, not a torch file, or names
            a global outside torch's plain types and ALLOWED (the message names it).
    """
    if not path.is_file():
        raise DeepSpeedImportError("expected a DeepSpeed file here; it does not exist", path=path)
    with _LOCK, torch.serialization.safe_globals([(c, n) for n, c in ALLOWED.items()]):
        try:
            return _torch_load(path)
        except pickle.UnpicklingError as exc:
            m = _GLOBAL_RE.search(str(exc))
            what = f"the global {m.group(1)!r}" if m else f"something it may not ({exc})"
            raise DeepSpeedImportError(
                f"refusing to load: the pickle calls {what}, which is not on the importer's "
                "allow-list (torch's plain types and the DeepSpeed classes listed in "
                "checkpoint_tools/DEEPSPEED.md). Nothing from the file was run. A real "
                "DeepSpeed checkpoint does not need it: check where this file came from",
                path=path,
            ) from None
        except (RuntimeError, EOFError, OSError, ValueError, KeyError, TypeError) as exc:
            raise DeepSpeedImportError(
                f"cannot read this DeepSpeed file ({type(exc).__name__}: {exc}); expected a "
                "complete torch.save file, e.g. it was truncated by an interrupted copy or "
                "save: copy it again from the source",
                path=path,
            ) from None


def _torch_load(path: Path) -> Any:
    # Always memory-mapped: the importer releases pages it has written
    # ([Note: releasing mapped pages] in pages.py), which is only safe on a file mapping.
    # mmap needs torch's zip format (torch >= 1.6 writes it; DeepSpeed uses torch.save).
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
