"""DeepSpeed stage 0 fp16 checkpoints saved by FP16_Optimizer (DeepSpeed's default Adam on a
GPU, FusedAdam): one flat fp32 master per param group, and the inner optimizer's state over
those flat tensors ([Note: stage 0 layout] in stage0.py).

[Note: stage 0 flat groups]
FP16_Optimizer flattens each param group's parameters, in the group's order, into one fp32
tensor (`fp32_groups_flat[g]`), and FusedAdam keeps one `exp_avg` / `exp_avg_sq` of that
flat size per group (state number g) plus a `step`. Nothing in the file says which
parameters a group holds, only how many elements it has. Groups are built by filtering the
module's parameters in module order (as [Note: stage 0 parameter order] assumes), so the
importer deals the module's parameters, in order, into the groups so that every group's
element count comes out exact. Sizes alone are often ambiguous (the fixture model's
decay / no-decay groups, 130 and 42 elements, can also be dealt as fc1.weight + three
13-element vectors and fc2.weight + fc2.bias), but the file holds a second witness:
FP16_Optimizer copies each flat master into the fp16 parameters after every step, so a
parameter's slice of its group's master, cast to fp16, equals the parameter in `module`
bit for bit. A parameter may only sit where its slice matches. Exactly one way names
every slice; none or several are refused, as for the unfused layout (several: same-sized
parameters with equal values that could sit in two groups, where a guess could swap
their Adam moments). The flat tensors and moments are then
cut into per-parameter views and handed on in the unfused layout (one master per parameter,
torch's per-parameter optimizer state), so the rest of the import is shared.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.format.errors import DeepSpeedImportError

Shape = tuple[int, ...]
MAX_STATES = 200_000
"""Partial dealings tracked at once; beyond it the search is refused rather than slow."""


def _fail(msg: str, path: Path, key: str) -> DeepSpeedImportError:
    return DeepSpeedImportError(msg, path=path, tensor=key)


def match_flat(
    names: list[str],
    shapes: dict[str, Shape],
    sizes: list[int],
    path: Path,
    fits: Callable[[str, int, int], bool] | None = None,
) -> list[list[str]]:
    """The module's parameters (in module order) dealt into groups of `sizes` elements
    ([Note: stage 0 flat groups]); `fits(name, group, offset)`: whether the parameter may
    sit at that offset of that group. Forward dynamic programming over the elements filled
    per group, counting ways up to 2."""
    numel = {n: math.prod(shapes[n]) for n in names}
    if sum(numel.values()) != sum(sizes):
        raise _fail(
            f"the flat fp32 master groups hold {sum(sizes)} elements ({sizes} per group) but "
            f"the model's ('module') parameters have {sum(numel.values())}: the optimizer "
            "does not hold every parameter (frozen parameters), or 'module' is from another "
            "model",
            path,
            "optimizer.fp32_groups_flat",
        )
    Fill = tuple[int, ...]
    layer: dict[Fill, tuple[int, Fill | None, int]] = {tuple(0 for _ in sizes): (1, None, -1)}
    history: list[dict[Fill, tuple[int, Fill | None, int]]] = []
    for name in names:
        nxt: dict[Fill, tuple[int, Fill | None, int]] = {}
        for fill, (ways, _, _) in layer.items():
            for g, size in enumerate(sizes):
                if fill[g] + numel[name] <= size and (fits is None or fits(name, g, fill[g])):
                    new = fill[:g] + (fill[g] + numel[name],) + fill[g + 1 :]
                    old = nxt.get(new)
                    nxt[new] = (min(2, ways + (old[0] if old else 0)), fill, g)
        if len(nxt) > MAX_STATES:
            raise _fail(
                f"matching {len(names)} parameters to {len(sizes)} flat groups has more than "
                f"{MAX_STATES} partial solutions; refusing rather than searching on",
                path,
                "optimizer.fp32_groups_flat",
            )
        history.append(nxt)
        layer = nxt
    final = tuple(sizes)
    ways = layer.get(final, (0, None, -1))[0]
    if ways != 1:
        what = (
            "cannot be matched to the module's parameters taken in module order"
            if ways == 0
            else "can be matched to the module's parameters in more than one way (same-sized "
            "parameters with equal values could sit in several groups, and the file does not "
            "record which; refusing rather than guessing, since a wrong guess swaps Adam "
            "moments)"
        )
        raise _fail(
            f"the flat fp32 master groups ({sizes} elements) {what}: the importer assumes each "
            "group lists its parameters in module order (groups built from "
            "model.parameters() / named_parameters()) and that each parameter in 'module' is "
            "its master's slice cast to the parameter's dtype",
            path,
            "optimizer.fp32_groups_flat",
        )
    out: list[list[str]] = [[] for _ in sizes]
    at: Fill | None = final
    for name, step in zip(reversed(names), reversed(history), strict=True):
        assert at is not None
        _, at, g = step[at]
        out[g].append(name)
    return [list(reversed(g)) for g in out]


def _cut(flat: torch.Tensor, names: list[str], shapes: dict[str, Shape]) -> list[torch.Tensor]:
    sizes = [math.prod(shapes[n]) for n in names]
    return [p.view(shapes[n]) for p, n in zip(flat.split(sizes), names, strict=True)]


def unflatten(
    opt: dict[str, Any],
    base: dict[str, Any],
    module: dict[str, torch.Tensor],
    names: list[str],
    path: Path,
) -> tuple[list[list[torch.Tensor]], dict[str, Any]]:
    """(fp32 masters per group, per parameter; torch's per-parameter optimizer state dict,
    numbering the parameters 0, 1, ... group by group in module order) from the flat
    layout."""
    flats = opt["fp32_groups_flat"]
    groups = base["param_groups"]
    if (
        not isinstance(flats, list)
        or len(flats) != len(groups)
        or not all(isinstance(f, torch.Tensor) and f.dim() == 1 for f in flats)
    ):
        raise _fail(
            f"expected one flat (1-D) fp32 master per param group ({len(groups)})",
            path,
            "optimizer.fp32_groups_flat",
        )
    for g, grp in enumerate(groups):
        if grp.get("params") != [g]:
            raise _fail(
                f"expected param group {g} to hold its one flat master (params [{g}]); found "
                f"{grp.get('params')}",
                path,
                f"optimizer.optimizer_state_dict.param_groups[{g}]",
            )
    shapes = {n: tuple(module[n].shape) for n in names}

    def fits(name: str, g: int, offset: int) -> bool:
        p = module[name].reshape(-1)
        return torch.equal(flats[g][offset : offset + p.numel()].to(p.dtype), p)

    order = match_flat(names, shapes, [f.numel() for f in flats], path, fits)
    masters = [_cut(f, grp, shapes) for f, grp in zip(flats, order, strict=True)]
    state: dict[int, dict[str, Any]] = {}
    pgroups: list[dict[str, Any]] = []
    i = 0
    for g, grp in enumerate(order):
        saved = base["state"].get(g) or {}
        pieces: dict[str, list[torch.Tensor]] = {}
        for key in ("exp_avg", "exp_avg_sq"):
            t = saved.get(key)
            if t is None:
                continue
            if not isinstance(t, torch.Tensor) or t.numel() != flats[g].numel():
                raise _fail(
                    f"expected {key} of flat group {g} with {flats[g].numel()} elements; found "
                    f"{getattr(t, 'shape', type(t).__name__)}",
                    path,
                    f"optimizer.optimizer_state_dict.state[{g}][{key!r}]",
                )
            pieces[key] = _cut(t.reshape(-1), grp, shapes)
        ids = []
        for k in range(len(grp)):
            s: dict[str, Any] = {key: v[k] for key, v in pieces.items()}
            if "step" in saved:
                s["step"] = saved["step"]
            if s:
                state[i] = s
            ids.append(i)
            i += 1
        pgroups.append({**groups[g], "params": ids})
    return masters, {"state": state, "param_groups": pgroups}
