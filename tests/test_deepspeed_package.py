"""fsdpx.deepspeed: `import fsdpx.deepspeed as deepspeed` shows only DeepSpeed's own names,
and the package imports lazily, so the ds_config translation modules inside it load in any
order without an import cycle through fsdpx.config."""

from __future__ import annotations

import subprocess
import sys

import pytest

import fsdpx.deepspeed

TRANSLATION = [
    "fsdpx.deepspeed._json",
    "fsdpx.deepspeed._keys",
    "fsdpx.deepspeed._config",
    "fsdpx.deepspeed._explain",
]

# Top-level names of DeepSpeed's own `deepspeed` package (deepspeed/__init__.py): a public
# name of fsdpx.deepspeed must be one of these.
DEEPSPEED_NAMES = {
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "InferenceEngine",
    "PipelineEngine",
    "PipelineModule",
    "accelerator",
    "add_config_arguments",
    "add_tuning_arguments",
    "checkpointing",
    "comm",
    "default_inference_config",
    "get_accelerator",
    "init_distributed",
    "init_inference",
    "initialize",
    "module_inject",
    "moe",
    "ops",
    "pipe",
    "runtime",
    "utils",
    "zero",
}


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_public_names_are_deepspeed_names() -> None:
    public = {n for n in dir(fsdpx.deepspeed) if not n.startswith("_")}
    assert public <= DEEPSPEED_NAMES, sorted(public - DEEPSPEED_NAMES)
    assert set(fsdpx.deepspeed.__all__) <= DEEPSPEED_NAMES
    with pytest.raises(AttributeError, match="fsdpx.deepspeed' has no attribute 'translate'"):
        fsdpx.deepspeed.translate  # noqa: B018  (the translation stays private)


def test_package_import_loads_no_translation_module() -> None:
    out = _run(
        "import sys, fsdpx.deepspeed; "
        f"print([m for m in {TRANSLATION + ['fsdpx.config']!r} if m in sys.modules])"
    )
    assert out == "[]"


@pytest.mark.parametrize("module", TRANSLATION)
def test_each_translation_module_imports_first(module: str) -> None:
    # A fresh interpreter importing this module before anything else: an eager package
    # __init__ or a new cycle through fsdpx.config would fail here.
    assert _run(f"import {module}; print('ok')") == "ok"
