"""DeepSpeed's universal checkpoint (`ds_to_universal` output) into the fsdpx format.

Layout (DeepSpeed 0.19): `<tag>_universal/zero/<param name>/{fp32,exp_avg,exp_avg_sq}.pt`,
each one whole parameter (flattened for ZeRO-3 sources, or a dict with the tensor under
`param`), `zero/optimizer_state.pt` (rank 0's optimizer state: param groups with the
hyperparameters, loss scaler; ZeRO-3 sources: torch's state dict with Adam's `step`;
ZeRO 1/2 sources: `param_groups` at the top and a `zero/<param>/step.pt` per parameter)
and the source's model states file(s). ZeRO 1/2 sources also get `zero/<buffer>/fp32.pt`
folders; buffers are read from the model states file as for the other layouts.
One parameter file is read at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.deepspeed.convert import HYPER, GroupFacts, get_key, write_rank0_extras
from checkpoint_tools.deepspeed.folder import Files
from checkpoint_tools.deepspeed.model_states import ModelStates, Naming
from checkpoint_tools.deepspeed.sink import Sink
from checkpoint_tools.deepspeed.training_state import plain
from checkpoint_tools.deepspeed.unpickle import load
from checkpoint_tools.deepspeed.zero import Param
from checkpoint_tools.format import model_name, optim_name
from checkpoint_tools.format.errors import DeepSpeedImportError

_FILES = {"fp32": "fp32.pt", "exp_avg": "exp_avg.pt", "exp_avg_sq": "exp_avg_sq.pt"}


def _facts(common: Any, path: Path, ngroups: int) -> GroupFacts:
    # ZeRO-3 sources: torch's state dict under optimizer_state_dict; ZeRO 1/2 sources:
    # `param_groups` at the top (each parameter's step is in zero/<param>/step.pt).
    base = common.get("optimizer_state_dict") if isinstance(common, dict) else None
    if base is None and isinstance(common, dict):
        base = common.get("base_optimizer_state")
    if base is None and isinstance(common, dict) and "param_groups" in common:
        base = common
    groups = get_key(base, "param_groups", path, list)
    state = (base.get("state") if isinstance(base, dict) else None) or {}
    if len(groups) != ngroups:
        raise DeepSpeedImportError(
            f"expected {ngroups} optimizer param groups (param_shapes); found {len(groups)}",
            path=path,
            tensor="param_groups",
        )
    steps: list[float | None] = []
    for g, grp in enumerate(groups):
        step = (state.get(g) or {}).get("step", grp.get("step"))
        steps.append(None if step is None else float(torch.as_tensor(step).item()))
    hyper = [{k: plain(v) for k, v in grp.items() if k in HYPER} for grp in groups]
    return GroupFacts(hyper, steps, common.get("loss_scaler"))


def _step(path: Path) -> float:
    t = load(path)
    if not isinstance(t, torch.Tensor) or t.numel() != 1:
        raise DeepSpeedImportError(
            f"expected a one-element step tensor; found {getattr(t, 'shape', type(t).__name__)}",
            path=path,
            tensor="step",
        )
    return float(t.item())


def _tensor(path: Path, p: Param) -> torch.Tensor:
    t = load(path)
    if isinstance(t, dict):
        t = t.get("param")
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() != p.numel:
        raise DeepSpeedImportError(
            f"expected a floating-point tensor of {p.numel} elements for parameter "
            f"{p.name!r} of shape {p.shape}; found "
            f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}: the "
            "shapes do not add up",
            path=path,
            tensor=p.name,
        )
    return t.detach().reshape(p.shape)


def convert(files: Files, ms: ModelStates, naming: Naming, sink: Sink) -> tuple[GroupFacts, bool]:
    """Write every parameter (one file at a time); returns the optimizer facts and
    whether Adam moments were present."""
    zero = files.directory / "zero"
    common_path = zero / "optimizer_state.pt"
    facts = _facts(load(common_path), common_path, len(ms.groups))
    params = [p for g in ms.groups for p in g]
    for p in params:
        # Names come from a pickle: never let one walk out of zero/.
        if "/" in p.name or "\\" in p.name or p.name in ("", ".", ".."):
            raise DeepSpeedImportError(
                f"parameter name {p.name!r} cannot name a folder under zero/",
                path=files.model_states[0],
                tensor="param_shapes",
            )
    has = {k: all((zero / p.name / f).is_file() for p in params) for k, f in _FILES.items()}
    if not has["fp32"]:
        missing = [p.name for p in params if not (zero / p.name / "fp32.pt").is_file()]
        raise DeepSpeedImportError(
            f"expected zero/<param>/fp32.pt for every parameter; missing for {missing[:5]}",
            path=zero,
        )
    moments = has["exp_avg"] and has["exp_avg_sq"]
    if moments and all((zero / p.name / "step.pt").is_file() for p in params):
        facts.step = [_step(zero / g[0].name / "step.pt") if g else None for g in ms.groups]
        for g in ms.groups:
            for p in g[1:]:
                if _step(zero / p.name / "step.pt") != facts.step[p.group]:
                    raise DeepSpeedImportError(
                        f"expected every parameter of group {p.group} at step "
                        f"{facts.step[p.group]} (its first parameter's)",
                        path=zero / p.name / "step.pt",
                        tensor=p.name,
                    )
    sink.open_group()
    write_rank0_extras(sink, ms, naming, facts.step if moments else [None] * len(ms.groups))
    aliases: dict[str, list[str]] = {}
    for alias, src in ms.shared.items():
        aliases.setdefault(src, []).append(alias)
    for p in params:
        fqn = naming.fqn(p.name)
        weight = _tensor(zero / p.name / _FILES["fp32"], p).float()
        for name in [p.name, *aliases.get(p.name, [])]:
            sink.put(model_name(naming.fqn(name)), weight)
        del weight
        if moments:
            for key in ("exp_avg", "exp_avg_sq"):
                sink.put(optim_name(fqn, key), _tensor(zero / p.name / _FILES[key], p))
    return facts, moments
