"""DeepSpeed ZeRO stage 0 checkpoints: no ZeRO files, the whole optimizer in the model
states file (layouts: checkpoint_tools/DEEPSPEED.md).

[Note: stage 0 layout]
Without ZeRO, DeepSpeed's engine saves only `mp_rank_00_model_states.pt` (rank 0; the
ranks hold identical replicas): `module` is the model's state dict in its training
dtype, `param_shapes` is None, and `optimizer` is the optimizer's own state dict:
- fp32: torch's (`{"state": {i: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups"}`)
  over the module's parameters themselves: `module` holds the fp32 masters.
- fp16/bf16 with a torch or other unfused optimizer (DeepSpeed's FP16_UnfusedOptimizer):
  `fp32_groups` (per group, one fp32 master per parameter), `optimizer_state_dict`
  (torch's, over those masters) and the loss-scaler fields `dynamic_loss_scale`,
  `cur_scale`, `cur_iter` (+ `last_overflow_iter`, `scale_factor`, `scale_window` when
  dynamic). Its optimizer took one zero-gradient step at construction to create its
  state, so `step` is one more than the engine's global_steps; it is kept as saved,
  which is what the optimizer continues from.
- fp16 with FusedAdam (FP16_Optimizer, DeepSpeed's default Adam on a GPU):
  `fp32_groups_flat`, one flat master per group, and FusedAdam's state over those flat
  tensors; cut into per-parameter pieces and read as the unfused layout (stage0_flat.py,
  [Note: stage 0 flat groups]).

[Note: stage 0 fp16 moment units]
DeepSpeed 0.19.8's engine.backward scales the loss only for its ZeRO optimizers, while
FP16_UnfusedOptimizer.step still divides every gradient by `cur_scale`
(deepspeedai/DeepSpeed#8393): a stage 0 fp16 run trains on gradient / cur_scale, and its
Adam moments are in those units (the fixture's are ~100x smaller than the same run's at
ZeRO-2). Adam's update hardly depends on the units, so that run trains normally, but
fsdpx continues it with true gradients: moments left as saved would be swamped by the
first new gradient and the next steps would not be DeepSpeed's (measured: weights off by
2 lr after 3 steps). For DeepSpeed versions known to have the bug (UNSCALED_FP16_LOSS,
checked against this version's source and fixture) the import multiplies `exp_avg` by
cur_scale and `exp_avg_sq` by cur_scale**2 (exact for a static scale; with a dynamic one
the moments mix steps taken at earlier, smaller scales, and the current scale is the
best single factor) and says so in its report; for other versions it imports them as
saved and says that instead.
The optimizer numbers its parameters 0, 1, ... across its param groups; nothing in the
file names them. [Note: stage 0 parameter order] below recovers the names.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoint_tools.deepspeed.convert import HYPER, MOMENTS, GroupFacts
from checkpoint_tools.deepspeed.model_states import ModelStates, Naming, config_dtype
from checkpoint_tools.deepspeed.sink import Sink
from checkpoint_tools.deepspeed.stage0_flat import unflatten
from checkpoint_tools.deepspeed.training_state import plain
from checkpoint_tools.deepspeed.zero import Param
from checkpoint_tools.format import model_name, optim_name
from checkpoint_tools.format.errors import DeepSpeedImportError

Shape = tuple[int, ...]

UNSCALED_FP16_LOSS = frozenset({"0.19.8"})
"""DeepSpeed versions whose stage 0 fp16 runs train on gradient / cur_scale ([Note: stage
0 fp16 moment units]); only versions whose source and real checkpoints were checked."""


@dataclass
class Stage0:
    ms: ModelStates
    """groups: the optimizer's param groups, in its order, under module names."""
    base: dict[str, Any]
    """torch's optimizer state dict (`state`, `param_groups`)."""
    masters: list[list[torch.Tensor]]
    """fp32 masters per group, in the optimizer's order."""
    index: dict[str, int]
    """parameter name -> the optimizer's number for it."""
    scaler: dict[str, Any] | None
    """fp16: the saved loss-scaler fields."""


def _fail(msg: str, path: Path, key: str) -> DeepSpeedImportError:
    return DeepSpeedImportError(msg, path=path, tensor=key)


def _tensor_dict(d: Any, path: Path, key: str) -> dict[str, torch.Tensor]:
    if not isinstance(d, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in d.items()
    ):
        raise _fail("expected a state dict of named tensors", path, key)
    return d


def _parameters(
    module: dict[str, torch.Tensor], buffers: set[str]
) -> tuple[list[str], dict[str, str]]:
    """(parameter names in module order, alias -> parameter for tied weights).
    state_dict lists a tied parameter under every name, sharing one storage;
    named_parameters (what the optimizer got) lists it once, under its first name."""
    names: list[str] = []
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, Shape, Shape], str] = {}
    for n, t in module.items():
        if n in buffers:
            continue
        key = (
            t.untyped_storage().data_ptr(),
            int(t.storage_offset()),
            tuple(t.shape),
            tuple(t.stride()),
        )
        if t.numel() and key in seen:
            aliases[n] = seen[key]
        else:
            seen[key] = n
            names.append(n)
    return names, aliases


def match_order(
    names: list[str], shapes: dict[str, Shape], groups: list[list[Shape | None]], path: Path
) -> list[list[str]]:
    """[Note: stage 0 parameter order]
    A stage 0 file numbers the optimizer's parameters without naming them. The optimizer
    got them from the user's param groups, which are normally built by filtering the
    module's parameters (`model.parameters()`, or decay / no-decay lists from
    `named_parameters()`), so each group lists its parameters in module order. The
    importer therefore looks for the ways to deal the module's parameters, in order,
    into the groups so that every shape matches the optimizer's slot (`None`: a slot
    without state, any shape). Exactly one way: that is the naming. None: refused (the
    groups were built in another order, or the model does not match). Several (same-
    shaped parameters that could sit in either of two groups): refused rather than
    guessed, since a wrong guess would swap Adam moments silently. Forward dynamic
    programming over (next slot of each group), counting ways up to 2."""
    total = sum(len(g) for g in groups)
    if total != len(names):
        raise _fail(
            f"the optimizer holds {total} parameters in {len(groups)} group(s) but the model "
            f"('module') has {len(names)}: importing stage 0 checkpoints whose optimizer "
            "does not hold every parameter (frozen parameters) is not supported",
            path,
            "optimizer.param_groups",
        )
    Ptr = tuple[int, ...]
    # state -> (ways, previous state, group taken)
    layer: dict[Ptr, tuple[int, Ptr | None, int]] = {tuple(0 for _ in groups): (1, None, -1)}
    history: list[dict[Ptr, tuple[int, Ptr | None, int]]] = []
    for name in names:
        nxt: dict[Ptr, tuple[int, Ptr | None, int]] = {}
        for ptr, (ways, _, _) in layer.items():
            for g, slots in enumerate(groups):
                k = ptr[g]
                if k < len(slots) and slots[k] in (None, shapes[name]):
                    new = ptr[:g] + (k + 1,) + ptr[g + 1 :]
                    old = nxt.get(new)
                    nxt[new] = (min(2, ways + (old[0] if old else 0)), ptr, g)
        history.append(nxt)
        layer = nxt
    final = tuple(len(g) for g in groups)
    ways = layer.get(final, (0, None, -1))[0]
    if ways == 0:
        raise _fail(
            f"the optimizer's param groups (shapes per group: "
            f"{[[list(s) if s else '?' for s in g] for g in groups]}) cannot be matched to the "
            f"module's parameters taken in module order ({[list(shapes[n]) for n in names]}): "
            "the importer assumes each group lists its parameters in module order (groups "
            "built from model.parameters() / named_parameters()); this checkpoint's were "
            "built otherwise, or 'module' is from another model",
            path,
            "optimizer.param_groups",
        )
    if ways > 1:
        sizes = [len(g) for g in groups]
        shared = sorted({n for n in names if sum(shapes[n] in g or None in g for g in groups) > 1})
        raise _fail(
            f"the optimizer's {len(groups)} param groups ({sizes} parameters) can be matched "
            f"to the module's parameters in more than one way: same-shaped parameters "
            f"{shared[:8]} could sit in several groups, and a stage 0 file does not record "
            "which. Refusing rather than guessing (a wrong guess swaps Adam moments)",
            path,
            "optimizer.param_groups",
        )
    out: list[list[str]] = [[] for _ in groups]
    at: Ptr | None = final
    for name, step in zip(reversed(names), reversed(history), strict=True):
        assert at is not None
        _, at, g = step[at]
        out[g].append(name)
    return [list(reversed(g)) for g in out]


def parse_stage0(raw: dict[str, Any], path: Path) -> Stage0:
    """The stage 0 model states file `raw` (param_shapes None, `optimizer` a dict)."""
    opt = raw.get("optimizer")
    if not isinstance(opt, dict):
        raise _fail(
            "expected the optimizer's state dict under 'optimizer' (a ZeRO stage 0 "
            f"checkpoint); found {type(opt).__name__}: the run had no optimizer, or saved "
            "without it, and there is no optimizer state to import",
            path,
            "optimizer",
        )
    module = _tensor_dict(raw.get("module"), path, "module")
    buffer_names = raw.get("buffer_names") or []
    if not isinstance(buffer_names, list) or not set(buffer_names) <= set(module):
        raise _fail("expected the names of buffers in 'module'", path, "buffer_names")
    found = raw.get("ds_config")
    config: dict[str, Any] = found if isinstance(found, dict) else {}
    dtype = config_dtype(config)
    flat = "fp32_groups_flat" in opt
    low = "fp32_groups" in opt or flat
    base = opt.get("optimizer_state_dict") if low else opt
    key = "optimizer.optimizer_state_dict" if low else "optimizer"
    if not isinstance(base, dict) or not isinstance(base.get("param_groups"), list):
        raise _fail("expected torch's optimizer state dict with 'param_groups'", path, key)
    if not isinstance(base.get("state"), dict):
        raise _fail("expected torch's optimizer state dict with 'state'", path, key)
    if (dtype != "fp32") != low:
        raise _fail(
            f"a {dtype} run's stage 0 optimizer state "
            + ("without fp32 masters ('fp32_groups')" if dtype != "fp32" else "with 'fp32_groups'")
            + ": the ds_config and the optimizer state disagree",
            path,
            key,
        )
    buffers = set(map(str, buffer_names))
    names, aliases = _parameters(module, buffers)
    shapes = {n: tuple(module[n].shape) for n in names}
    if flat:  # [Note: stage 0 flat groups]: from here on, the unfused layout
        flat_masters, base = unflatten(opt, base, module, names, path)
    numbers: list[list[int]] = []
    for g, grp in enumerate(base["param_groups"]):
        ids = grp.get("params") if isinstance(grp, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise _fail("expected a list of parameter numbers", path, f"{key}.param_groups[{g}]")
        numbers.append(ids)
    flat_ids = [i for g in numbers for i in g]
    if sorted(flat_ids) != list(range(len(flat_ids))):
        raise _fail(
            f"expected the parameter numbers 0..{len(flat_ids) - 1}, each once; found {flat_ids}",
            path,
            f"{key}.param_groups",
        )
    if flat:
        masters = flat_masters
        slot_shapes: list[list[Shape | None]] = [[tuple(t.shape) for t in m] for m in masters]
    elif low:
        masters = opt["fp32_groups"]
        if not isinstance(masters, list) or [
            len(m) if isinstance(m, list) else -1 for m in masters
        ] != [len(g) for g in numbers]:
            raise _fail(
                f"expected one fp32 master per parameter of each group ({[len(g) for g in numbers]})",
                path,
                "optimizer.fp32_groups",
            )
        slot_shapes = [[tuple(t.shape) for t in m] for m in masters]
    else:
        masters = []
        slot_shapes = []
        for ids in numbers:
            s = [base["state"].get(i, {}).get("exp_avg") for i in ids]
            slot_shapes.append([tuple(t.shape) if isinstance(t, torch.Tensor) else None for t in s])
    order = match_order(names, shapes, slot_shapes, path)
    if not low:
        masters = [[module[n] for n in grp] for grp in order]
    for g, (grp, ms_) in enumerate(zip(order, masters, strict=True)):
        for n, m in zip(grp, ms_, strict=True):
            if (
                not isinstance(m, torch.Tensor)
                or not m.is_floating_point()
                or tuple(m.shape) != shapes[n]
            ):
                raise _fail(
                    f"expected parameter {n!r}'s fp32 master of shape {list(shapes[n])}",
                    path,
                    f"optimizer.fp32_groups[{g}]" if low else f"module.{n}",
                )
    groups = [[Param(n, shapes[n], g) for n in grp] for g, grp in enumerate(order)]
    index = {
        n: i for grp, ids in zip(order, numbers, strict=True) for n, i in zip(grp, ids, strict=True)
    }
    scaler = {
        k: v
        for k, v in opt.items()
        if k not in ("optimizer_state_dict", "fp32_groups", "fp32_groups_flat")
    }
    ms = ModelStates(
        raw,
        groups,
        {str(n): module[n] for n in buffer_names},
        aliases,
        config,
        dtype,
    )
    return Stage0(ms, base, masters, index, scaler if low and dtype == "fp16" else None)


def moment_factor(st: Stage0, notes: list[str]) -> float:
    """What the Adam moments are multiplied by ([Note: stage 0 fp16 moment units]), with
    the report's note on it."""
    if st.scaler is None:
        return 1.0
    version = str(st.ms.raw.get("ds_version"))
    scale = st.scaler.get("cur_scale")
    if not isinstance(scale, int | float) or scale <= 0:
        return 1.0
    if version not in UNSCALED_FP16_LOSS:
        notes.append(
            f"stage 0 fp16: Adam moments imported as saved. DeepSpeed {version} is not "
            f"among the versions checked for deepspeedai/DeepSpeed#8393 "
            f"({sorted(UNSCALED_FP16_LOSS)}), which train stage 0 fp16 on gradient / loss "
            "scale; if it has that bug, its moments are loss-scale times too small"
        )
        return 1.0
    notes.append(
        f"stage 0 fp16: DeepSpeed {version} trained on gradient / loss scale "
        f"(deepspeedai/DeepSpeed#8393); Adam moments multiplied by the loss scale {scale:g} "
        f"(exp_avg) and its square (exp_avg_sq) to continue on true gradients"
        + ("" if not st.scaler.get("dynamic_loss_scale") else " (dynamic scale: approximate)")
    )
    return float(scale)


def convert(
    st: Stage0, naming: Naming, sink: Sink, path: Path, notes: list[str]
) -> tuple[GroupFacts, dict[str, Any]]:
    """Write the stage 0 checkpoint (one file: a model replica and its optimizer) as one
    group of rank files; returns the optimizer facts and the optimizer's meta (per
    parameter keys: a parameter the optimizer never stepped has no state)."""
    state, pgroups = st.base["state"], st.base["param_groups"]
    sink.open_group()
    for name, t in st.ms.buffers.items():
        sink.put(model_name(naming.fqn(name)), t.float() if t.is_floating_point() else t)
    aliases: dict[str, list[str]] = {}
    for alias, src in st.ms.shared.items():
        aliases.setdefault(src, []).append(alias)
    tensor_keys: dict[str, list[str]] = {}
    steps: list[float | None] = []
    factor = moment_factor(st, notes)
    for g, params in enumerate(st.ms.groups):
        if pgroups[g].get("amsgrad"):
            raise _fail(
                "the optimizer uses AMSGrad, whose max_exp_avg_sq state the importer does "
                "not carry over",
                path,
                f"optimizer param_groups[{g}]",
            )
        steps.append(None)
        for p, master in zip(params, st.masters[g], strict=True):
            fqn = naming.fqn(p.name)
            for name in [p.name, *aliases.get(p.name, [])]:
                sink.put(model_name(naming.fqn(name)), master.float())
            s = state.get(st.index[p.name]) or {}
            keys = []
            for key in MOMENTS:
                if key in s:
                    t = s[key]
                    if not isinstance(t, torch.Tensor) or tuple(t.shape) != p.shape:
                        raise _fail(
                            f"expected {key} of parameter {p.name!r} with its shape "
                            f"{list(p.shape)}; found {getattr(t, 'shape', type(t).__name__)}",
                            path,
                            f"optimizer state[{st.index[p.name]}][{key!r}]",
                        )
                    power = 2 if key == "exp_avg_sq" else 1
                    sink.put(optim_name(fqn, key), t * factor**power if factor != 1 else t)
                    keys.append(key)
            if "step" in s:
                step = float(torch.as_tensor(s["step"]).item())
                sink.put(optim_name(fqn, "step"), torch.tensor(step, dtype=torch.float32))
                keys.insert(0, "step")
                steps[g] = step if steps[g] is None else steps[g]
            if keys:
                tensor_keys[fqn] = keys
    hyper = [{k: plain(v) for k, v in grp.items() if k in HYPER} for grp in pgroups]
    meta = {
        "param_groups": [
            {**hyper[g], "params": [naming.fqn(p.name) for p in params]}
            for g, params in enumerate(st.ms.groups)
        ],
        "tensor_keys": tensor_keys,
        "extra": {},
    }
    return GroupFacts(hyper, steps, st.scaler), meta
