"""`deepspeed.runtime`: the submodule paths DeepSpeed scripts import from (`utils`,
`dataloader`, `lr_schedules`), also reachable as attributes after `import deepspeed`, as
DeepSpeed's own import makes them."""

import importlib as _importlib
from typing import Any as _Any

_SUBMODULES = ("dataloader", "lr_schedules", "utils")


def __getattr__(name: str) -> _Any:
    if name not in _SUBMODULES:
        raise AttributeError(f"module 'fsdpx.deepspeed.runtime' has no attribute {name!r}")
    return _importlib.import_module(f"{__name__}.{name}")
