"""Shared pytest setup for the fsdpx test suite."""

import sys
from pathlib import Path

# Put the repo root on sys.path so `import tests` works under a bare `pytest` as well as
# `python -m pytest` (which adds the current directory itself).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
