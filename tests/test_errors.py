"""One error tree: every exception class defined in fsdpx or checkpoint_tools is exported,
as the same object, by fsdpx.errors and by fsdpx, and drawn in fsdpx.errors' docstring;
`import fsdpx.errors` stays light (no torch)."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
from types import ModuleType

import pytest

import checkpoint_tools
import fsdpx
import fsdpx.errors


def _modules() -> list[ModuleType]:
    found = []
    for package in (fsdpx, checkpoint_tools):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.rsplit(".", 1)[-1] == "__main__":  # importing it runs the CLI
                continue
            found.append(importlib.import_module(info.name))
    return found


def _defined_exceptions() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for module in _modules():
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == module.__name__
            ):
                assert found.get(value.__name__, value) is value, f"two {value.__name__}"
                found[value.__name__] = value
    return found


def test_every_exception_class_is_exported_by_errors_and_fsdpx() -> None:
    defined = _defined_exceptions()
    # The walk really finds classes outside fsdpx.errors (it would pass vacuously if not).
    assert {"CheckpointError", "ProtocolError", "RankFailureError"} <= set(defined)
    missing_errors = sorted(set(defined) - set(fsdpx.errors.__all__))
    missing_fsdpx = sorted(set(defined) - set(fsdpx.__all__))
    assert not missing_errors, f"add to fsdpx/errors.py: {missing_errors}"
    assert not missing_fsdpx, f"add to fsdpx/__init__.py _EXPORTS: {missing_fsdpx}"
    for name, cls in defined.items():
        assert getattr(fsdpx.errors, name) is cls, name
        assert getattr(fsdpx, name) is cls, name
    # and fsdpx.errors exports nothing that is not an exception
    for name in fsdpx.errors.__all__:
        assert issubclass(getattr(fsdpx.errors, name), BaseException), name
        assert name in fsdpx.__all__, name


def test_the_docstring_draws_every_error() -> None:
    doc = fsdpx.errors.__doc__ or ""
    assert not [name for name in fsdpx.errors.__all__ if f" {name} " not in doc]


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="'fsdpx.errors' has no attribute 'NopeError'"):
        fsdpx.errors.NopeError  # noqa: B018


def test_import_errors_loads_no_torch() -> None:
    code = (
        "import sys, fsdpx.errors; "
        "print([m for m in ('torch', 'checkpoint_tools', 'fsdpx.telemetry.wire.protocol') "
        "if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
