"""Recognising a DeepSpeed checkpoint folder, so that loading one is a clear error.

[Note: DeepSpeed folders]
DeepSpeed writes `<root>/latest` (the tag, like ours) and `<root>/<tag>/` holding pickled
`*_states.pt` files (`mp_rank_00_model_states.pt`,
`zero_pp_rank_0_mp_rank_00_optim_states.pt`, `bf16_zero_pp_rank_...`,
`layer_01-model_states.pt` under pipeline parallelism), plus `zero_to_fp32.py` and, for
universal checkpoints, `latest_universal`. A user moving from DeepSpeed points fsdpx at
such a folder; the root resolvers must then fail with a message that says what it is and
what to do, never with "no checkpoint" (a script that starts fresh on
CheckpointNotFoundError would silently throw the run away). So the error is a
CheckpointFormatError subclass, not a CheckpointNotFoundError.

The check only runs on the resolvers' failure paths (no MANIFEST where a checkpoint was
expected), so loading an fsdpx checkpoint never pays for it. It lists at most the
folder and its direct subdirectories, and opens no file.

The message names the import command (`fsdpx-ckpt import-deepspeed DS_DIR OUT_DIR`,
checkpoint_tools/deepspeed/), which converts the folder, optimizer state included,
without running its pickles; tests/test_ckpt_root.py checks that the hint names a
command `fsdpx-ckpt --help` lists.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from checkpoint_tools.format.errors import DeepSpeedCheckpointError

# `*_model_states.pt`, `*_optim_states.pt`, `layer_NN-model_states.pt`: DeepSpeed's names.
_STATES_RE = re.compile(r"[\w.-]*[_-](model|optim)_states\.pt")
# Files DeepSpeed leaves in the root next to `latest`.
_ROOT_MARKERS = ("latest_universal", "zero_to_fp32.py")

IMPORT_HINT = (
    "fsdpx cannot load DeepSpeed checkpoints directly (they are pickles, and loading "
    "never unpickles). Convert it once with `fsdpx-ckpt import-deepspeed DS_DIR OUT_DIR` "
    "(weights, Adam state, step counters, lr scheduler and loss scaler; nothing in the "
    "files is run) and load OUT_DIR, or point fsdpx at a checkpoint fsdpx saved"
)


def _states_file(directory: Path) -> str | None:
    try:
        with os.scandir(directory) as entries:
            for e in entries:
                if _STATES_RE.fullmatch(e.name) and e.is_file(follow_symlinks=False):
                    return e.name
    except OSError:
        return None
    return None


def deepspeed_evidence(path: Path) -> str | None:
    """A file showing that `path` is a DeepSpeed checkpoint folder (a tag directory, or a
    root holding one), as a path relative to `path`; None when nothing suggests so."""
    found = _states_file(path)
    if found is not None:
        return found
    for marker in _ROOT_MARKERS:
        if os.path.lexists(path / marker):
            return marker
    try:
        with os.scandir(path) as entries:
            subdirs = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
    except OSError:
        return None
    for name in sorted(subdirs):
        found = _states_file(path / name)
        if found is not None:
            return f"{name}/{found}"
    return None


def deepspeed_folder_error(path: Path, evidence: str) -> DeepSpeedCheckpointError:
    """The error for a DeepSpeed folder at `path` (`evidence`: a file found there)."""
    return DeepSpeedCheckpointError(
        f"{str(path)!r} is a DeepSpeed checkpoint folder (it holds {evidence!r}), not an "
        f"fsdpx checkpoint. {IMPORT_HINT}"
    )
