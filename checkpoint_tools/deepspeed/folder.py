"""Finding the files of a DeepSpeed checkpoint (layouts: checkpoint_tools/DEEPSPEED.md).

DeepSpeed writes `<root>/latest` (a tag) and `<root>/<tag>/` with
`mp_rank_00_model_states.pt` (ZeRO 0-2) or `zero_pp_rank_R_mp_rank_00_model_states.pt`
(ZeRO-3, one per rank) and one `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt` per
data-parallel rank R. `ds_to_universal` writes `<tag>_universal/` holding the model
states file and `zero/<param name>/{fp32,exp_avg,exp_avg_sq,step}.pt`, named by
`<root>/latest_universal`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from checkpoint_tools.format.errors import DeepSpeedImportError
from checkpoint_tools.format.root import tag_problem

_OPTIM_RE = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_MP_RE = re.compile(r"(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt")
_MAX_LATEST = 4096


@dataclass(frozen=True)
class Files:
    """The files of one DeepSpeed checkpoint (a tag directory)."""

    directory: Path
    universal: bool
    model_states: list[Path]
    """`mp_rank_00_model_states.pt`, or ZeRO-3's per-rank model files in rank order."""
    optim_states: list[Path]
    """One per data-parallel rank, in rank order (empty for universal checkpoints and
    for ZeRO stage 0, whose optimizer state is in the model states file)."""


def _read_tag(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise DeepSpeedImportError(f"cannot open DeepSpeed's tag file: {exc}", path=path) from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(_MAX_LATEST + 1)
    tag = data.decode("utf-8", "replace").strip()
    problem = tag_problem(tag) if len(data) <= _MAX_LATEST else "longer than 4096 bytes"
    if problem is not None:
        raise DeepSpeedImportError(
            f"expected one checkpoint tag in this file; it holds {tag[:80]!r} ({problem}). "
            "Pass the tag with --tag",
            path=path,
        )
    return tag


def checkpoint_dir(ds_dir: Path, tag: str | None) -> Path:
    """The tag directory: `ds_dir/tag`, else the one `latest` (then `latest_universal`)
    names, else `ds_dir` itself when it holds DeepSpeed's files."""
    if not ds_dir.is_dir():
        raise DeepSpeedImportError("expected a DeepSpeed checkpoint directory", path=ds_dir)
    if tag is not None:
        problem = tag_problem(tag)
        if problem is not None:
            raise DeepSpeedImportError(f"--tag {tag!r} is not a tag ({problem})", path=ds_dir)
        return ds_dir / tag
    for marker in ("latest", "latest_universal"):
        if (ds_dir / marker).exists():
            return ds_dir / _read_tag(ds_dir / marker)
    return ds_dir


def find_files(ds_dir: Path, tag: str | None = None) -> Files:
    """The checkpoint's files, checked for completeness (every rank present, one model
    parallel rank) before anything is unpickled."""
    d = checkpoint_dir(ds_dir, tag)
    if not d.is_dir():
        raise DeepSpeedImportError(
            f"the checkpoint directory does not exist (tags here: "
            f"{sorted(p.name for p in ds_dir.iterdir() if p.is_dir())})",
            path=d,
        )
    names = sorted(os.listdir(d))
    if any(n.startswith("layer_") for n in names):
        raise DeepSpeedImportError(
            "this is a pipeline-parallel DeepSpeed checkpoint (layer_*-model_states.pt); "
            "importing pipeline checkpoints is not supported",
            path=d,
        )
    experts = [n for n in names if n.startswith(("expp_rank_", "exp_"))]
    if experts:
        raise DeepSpeedImportError(
            f"this checkpoint holds MoE expert files ({experts[:3]}); importing DeepSpeed "
            "MoE checkpoints is not supported",
            path=d,
        )
    mp = {int(m.group(1)) for n in names if (m := _MP_RE.fullmatch(n))}
    mp |= {int(m.group(3)) for n in names if (m := _OPTIM_RE.fullmatch(n))}
    if mp - {0}:
        raise DeepSpeedImportError(
            f"expected one model-parallel rank (mp_rank_00); found mp ranks {sorted(mp)}. "
            "Importing tensor-parallel DeepSpeed checkpoints is not supported",
            path=d,
        )
    if (d / "zero").is_dir():
        model = d / "mp_rank_00_model_states.pt"
        z3 = sorted(n for n in names if n.endswith("_mp_rank_00_model_states.pt"))
        if not model.is_file() and z3:
            model = d / z3[0]
        return Files(d, True, [model], [])
    optim = {int(m.group(2)): d / n for n in names if (m := _OPTIM_RE.fullmatch(n))}
    if not optim:
        # ZeRO stage 0 (the optimizer is in the model states file), or ZeRO files lost:
        # the model states file tells which (convert.zero_free).
        if not (d / "mp_rank_00_model_states.pt").is_file():
            raise DeepSpeedImportError(
                "expected DeepSpeed ZeRO optimizer files (*zero_pp_rank_R_mp_rank_00_optim_"
                "states.pt, ZeRO 1-3), mp_rank_00_model_states.pt alone (ZeRO stage 0) or a "
                f"universal checkpoint's zero/ folder; found {names[:10]}",
                path=d,
            )
        return Files(d, False, [d / "mp_rank_00_model_states.pt"], [])
    world = max(optim) + 1
    missing = sorted(set(range(world)) - set(optim))
    if missing:
        raise DeepSpeedImportError(
            f"expected one optimizer file per rank 0..{world - 1}; ranks {missing} are "
            "missing (an incomplete copy or an interrupted save)",
            path=d,
        )
    z3_models = [d / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    if (d / "mp_rank_00_model_states.pt").is_file():
        models = [d / "mp_rank_00_model_states.pt"]
    else:
        models = z3_models
        absent = [p.name for p in z3_models if not p.is_file()]
        if absent:
            raise DeepSpeedImportError(
                f"expected mp_rank_00_model_states.pt (ZeRO 0-2) or one "
                f"zero_pp_rank_R_mp_rank_00_model_states.pt per rank (ZeRO-3); missing "
                f"{absent}",
                path=d,
            )
    return Files(d, False, models, [optim[r] for r in range(world)])
