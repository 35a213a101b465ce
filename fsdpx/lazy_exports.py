"""Names a package exports but imports on first use (PEP 562's module `__getattr__`), so
that importing the package does not pay for modules most runs never call: fsdpx.comm's
1-bit all-reduce, fsdpx.offload's optimizer and state stores ([Note: onebit on first use],
[Note: offload imports on first use])."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `name` in `exports` is imported from the module
    `exports[name]` when first asked for; any other name is an AttributeError.

    Example (in a package's ``__init__.py``)::

        __getattr__ = lazy_getattr(__name__, {"OffloadedAdamW": "fsdpx.offload.optimizer"})
    """

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
