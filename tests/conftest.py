"""Shared pytest setup for the fsdpx test suite."""

import sys
from pathlib import Path

# Put the repo root on sys.path so `import tests` works under a bare `pytest` as well as
# `python -m pytest` (which adds the current directory itself).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """A test that starts the default process group in this process (fsdpx.shard or
    fsdpx.deepspeed.initialize on one rank) leaves it to the next test, which then sees
    `dist.is_initialized()`; end it after each test. torch is looked up, not imported, so
    tests that check what a module imports are unaffected."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
