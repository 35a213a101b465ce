"""DeepSpeed's model states file (`mp_rank_00_model_states.pt`, ZeRO-3: rank 0's
`zero_pp_rank_0_mp_rank_00_model_states.pt`): parameter shapes and groups, buffers,
shared parameters, counters, config, client_state.

[Note: imported names]
DeepSpeed records the names of `engine.module.named_parameters()`, i.e. the user's own
module's names, which are the fqns fsdpx.shard of the same model uses (FSDP2 does not
rename). A model that was wrapped before DeepSpeed saw it (DistributedDataParallel,
a `module` attribute) carries a `module.` prefix on every name: when *every* parameter
and buffer name has it, it is removed and the import says so. `--rename REGEX=REPL`
rewrites the rest (re.sub, in order). Two names becoming one is an error.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.deepspeed.zero import Param
from checkpoint_tools.format.errors import DeepSpeedImportError
from checkpoint_tools.format.layout import check_tensor_name


@dataclass
class ModelStates:
    raw: dict[str, Any]
    groups: list[list[Param]]
    """Trainable parameters per optimizer group, in DeepSpeed's flat order."""
    buffers: dict[str, torch.Tensor]
    shared: dict[str, str]
    """alias name -> the parameter it shares storage with."""
    config: dict[str, Any]
    dtype: str
    """"fp16", "bf16" or "fp32" (the run's ds_config)."""


def _shape(value: Any, path: Path, name: str) -> tuple[int, ...]:
    if isinstance(value, torch.Size | tuple | list) and all(
        isinstance(d, int) and d >= 0 for d in value
    ):
        return tuple(int(d) for d in value)
    raise DeepSpeedImportError(
        f"expected a shape (torch.Size) for parameter {name!r}; found {value!r}",
        path=path,
        tensor="param_shapes",
    )


def parse_model_states(raw: Any, path: Path) -> ModelStates:
    if not isinstance(raw, dict) or "param_shapes" not in raw:
        raise DeepSpeedImportError(
            "expected a DeepSpeed model states dict with 'param_shapes' (saved by a ZeRO "
            f"engine); found {type(raw).__name__} with keys "
            f"{sorted(map(str, raw))[:10] if isinstance(raw, dict) else '-'}",
            path=path,
            tensor="param_shapes",
        )
    shapes = raw["param_shapes"]
    if isinstance(shapes, dict):
        shapes = [shapes]
    if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
        raise DeepSpeedImportError(
            f"expected a list of {{name: shape}} dicts, one per parameter group; found "
            f"{type(shapes).__name__}",
            path=path,
            tensor="param_shapes",
        )
    groups = [
        [Param(str(n), _shape(s, path, str(n)), g) for n, s in group.items()]
        for g, group in enumerate(shapes)
    ]
    if raw.get("frozen_param_shapes"):
        raise DeepSpeedImportError(
            f"the model has frozen parameters ({sorted(raw['frozen_param_shapes'])[:5]}); "
            "importing checkpoints with frozen parameters is not supported yet",
            path=path,
            tensor="frozen_param_shapes",
        )
    module = raw.get("module") or {}
    names = raw.get("buffer_names") or []
    if not isinstance(module, dict) or not isinstance(names, list):
        raise DeepSpeedImportError(
            "expected 'module' (a state dict) and 'buffer_names' (a list)",
            path=path,
            tensor="module",
        )
    buffers = {}
    for n in names:
        t = module.get(n)
        if not isinstance(t, torch.Tensor):
            raise DeepSpeedImportError(
                f"buffer {n!r} is listed in buffer_names but 'module' holds no tensor for it",
                path=path,
                tensor="module",
            )
        buffers[str(n)] = t
    shared = raw.get("shared_params") or {}
    if not isinstance(shared, dict):
        raise DeepSpeedImportError("expected a dict", path=path, tensor="shared_params")
    found = raw.get("ds_config")
    config: dict[str, Any] = found if isinstance(found, dict) else {}
    return ModelStates(
        raw,
        groups,
        buffers,
        {str(k): str(v) for k, v in shared.items()},
        config,
        config_dtype(config),
    )


def config_dtype(config: dict[str, Any]) -> str:
    """ "fp16", "bf16" or "fp32": the run's ds_config."""
    dtype = "fp32"
    for key, name in (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16")):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled"):
            dtype = name
    return dtype


class Naming:
    """DeepSpeed names -> fsdpx fqns ([Note: imported names])."""

    def __init__(self, names: Sequence[str], renames: Sequence[tuple[str, str]]) -> None:
        self.notes: list[str] = []
        strip = bool(names) and all(n.startswith("module.") for n in names)
        if strip:
            self.notes.append("removed the 'module.' prefix that every name carried")
        self._map: dict[str, str] = {}
        for n in names:
            fqn = n[len("module.") :] if strip else n
            for pattern, repl in renames:
                fqn = re.sub(pattern, repl, fqn)
            problem = check_tensor_name("model/" + fqn)
            if problem is not None or not fqn:
                raise DeepSpeedImportError(
                    f"parameter {n!r} would be named {fqn!r}, which is not a valid name "
                    f"({problem or 'empty'}); fix the --rename rules"
                )
            self._map[n] = fqn
        seen: dict[str, str] = {}
        for n, fqn in self._map.items():
            if fqn in seen and seen[fqn] != n:
                raise DeepSpeedImportError(
                    f"parameters {seen[fqn]!r} and {n!r} would both be named {fqn!r}; fix "
                    "the --rename rules"
                )
            seen[fqn] = n

    def fqn(self, name: str) -> str:
        return self._map[name]


def parse_renames(rules: Sequence[str]) -> list[tuple[str, str]]:
    """`["REGEX=REPL", ...]` (the first `=` splits) as compiled-checked pairs."""
    out = []
    for rule in rules:
        if "=" not in rule:
            raise ValueError(f"--rename expects REGEX=REPL; got {rule!r}")
        pattern, repl = rule.split("=", 1)
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"--rename {rule!r}: bad regular expression ({exc})") from None
        out.append((pattern, repl))
    return out
