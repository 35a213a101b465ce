"""Importing DeepSpeed checkpoints (`fsdpx-ckpt import-deepspeed`); layouts and the
unpickling allow-list: checkpoint_tools/DEEPSPEED.md. Imports nothing from fsdpx and
never imports DeepSpeed."""

from checkpoint_tools.deepspeed.convert import ImportReport, import_deepspeed
from checkpoint_tools.deepspeed.model_states import parse_renames

__all__ = ["ImportReport", "import_deepspeed", "parse_renames"]
