"""`fsdpx-ckpt import-deepspeed`: a DeepSpeed checkpoint as an ordinary fsdpx checkpoint.

Streams ([Note: flat ranges as pieces]): reads one DeepSpeed file at a time (memory-
mapped) and writes each rank's runs of every parameter straight from views of its flat
partitions, so memory holds at most one partition file's pages plus the writer's window
of in-flight chunks ([Note: deferred pieces]), never the model. Names: the user's module names DeepSpeed recorded, which are the fqns
`fsdpx.shard` of the same model uses ([Note: imported names]).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from checkpoint_tools.deepspeed import training_state as ts
from checkpoint_tools.deepspeed.folder import Files, find_files
from checkpoint_tools.deepspeed.model_states import ModelStates, Naming, parse_model_states
from checkpoint_tools.deepspeed.pages import Releaser
from checkpoint_tools.deepspeed.rectangles import max_pieces
from checkpoint_tools.deepspeed.sink import Sink
from checkpoint_tools.deepspeed.unpickle import Stand_in, load
from checkpoint_tools.deepspeed.zero import Param, Run, runs_zero3, runs_zero12
from checkpoint_tools.format import model_name, optim_name
from checkpoint_tools.format.errors import DeepSpeedImportError

# Adam hyperparameters carried into the fsdpx optimizer's param groups; the rest of a
# DeepSpeed group (foreach, fused, capturable, ...) is a kernel choice of that run.
HYPER = ("lr", "betas", "eps", "weight_decay", "initial_lr")
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass
class ImportReport:
    """What an import read and wrote."""

    source: Path
    output: Path
    kind: str
    """"ZeRO-0" .. "ZeRO-3" or "universal"."""
    world_size: int
    dtype: str
    params: int
    global_steps: int
    dropped: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [
            f"imported {self.source} ({self.kind}, {self.world_size} rank(s), {self.dtype}, "
            f"{self.params} parameters, step {self.global_steps}) -> {self.output}",
        ]
        out += [f"note: {n}" for n in self.notes]
        if self.dropped:
            out.append(f"dropped (not msgpack-able): client_state keys {self.dropped}")
        return out


def get_key(d: Any, key: str, path: Path, kind: type | tuple[type, ...] = object) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise DeepSpeedImportError(
            f"expected the key {key!r}; it is missing", path=path, tensor=key
        )
    if not isinstance(d[key], kind):
        raise DeepSpeedImportError(
            f"expected {key!r} to be {kind}; found {type(d[key]).__name__}", path=path, tensor=key
        )
    return d[key]


def _flat(t: Any, path: Path, key: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or not t.is_floating_point():
        raise DeepSpeedImportError(
            f"expected a 1-D floating-point tensor; found {getattr(t, 'shape', type(t).__name__)}",
            path=path,
            tensor=key,
        )
    return t


def _stage(osd: dict[str, Any], path: Path) -> int:
    z = get_key(osd, "zero_stage", path)
    value = z.args[0] if isinstance(z, Stand_in) and z.args else z
    if not isinstance(value, int) or not 0 <= value <= 3:
        raise DeepSpeedImportError(
            f"expected a ZeRO stage 0-3; found {z!r}", path=path, tensor="zero_stage"
        )
    return int(value)


@dataclass
class GroupFacts:
    """Per-group optimizer facts gathered from rank 0's file."""

    hyper: list[dict[str, Any]] = field(default_factory=list)
    step: list[float | None] = field(default_factory=list)
    loss_scaler: Any = None


def _rank_part(
    osd: dict[str, Any], stage: int, ngroups: int, path: Path
) -> tuple[
    list[torch.Tensor], list[dict[str, torch.Tensor]], list[dict[str, Any]], list[Any], list[int]
]:
    """(fp32 flats, moments per group, hyperparameters per group, steps, group paddings)."""
    if stage <= 2:
        flats = get_key(osd, "single_partition_of_fp32_groups", path, list)
        base = get_key(osd, "base_optimizer_state", path)
        if isinstance(base, list):
            raise DeepSpeedImportError(
                "this checkpoint was saved with zero_optimization.elastic_checkpoint, whose "
                "optimizer state layout the importer does not read; save it without",
                path=path,
                tensor="base_optimizer_state",
            )
        pads = get_key(osd, "group_paddings", path, list)
    else:
        flats = get_key(osd, "fp32_flat_groups", path, list)
        base = get_key(osd, "optimizer_state_dict", path, dict)
        pads = [0] * len(flats)
    state = get_key(base, "state", path, dict)
    groups = get_key(base, "param_groups", path, list)
    if not (len(flats) == len(groups) == len(pads) == ngroups):
        raise DeepSpeedImportError(
            f"expected {ngroups} parameter groups (param_shapes); the optimizer file has "
            f"{len(flats)} flat groups, {len(groups)} optimizer groups and {len(pads)} paddings",
            path=path,
            tensor="param_groups",
        )
    flats = [_flat(t, path, f"fp32 flat group {g}") for g, t in enumerate(flats)]
    moments, steps = [], []
    for g in range(ngroups):
        s = state.get(g, {})
        moments.append({k: _flat(s[k], path, f"state[{g}][{k!r}]") for k in MOMENTS if k in s})
        step = s.get("step", groups[g].get("step") if isinstance(groups[g], dict) else None)
        steps.append(
            float(step.item() if isinstance(step, torch.Tensor) else step)
            if step is not None
            else None
        )
        if isinstance(groups[g], dict) and groups[g].get("amsgrad"):
            raise DeepSpeedImportError(
                "the optimizer uses AMSGrad, whose max_exp_avg_sq state the importer does "
                "not carry over",
                path=path,
                tensor=f"param_groups[{g}]",
            )
    hyper = [{k: ts.plain(v) for k, v in grp.items() if k in HYPER} for grp in groups]
    return flats, moments, hyper, steps, [int(p) for p in pads]


def _write_runs(
    sink: Sink,
    runs: list[Run],
    flats: list[torch.Tensor],
    moments: list[dict[str, torch.Tensor]],
    naming: Naming,
    aliases: dict[str, list[str]],
    path: Path,
) -> None:
    for run in runs:
        fqn = naming.fqn(run.param.name)
        end = run.local + run.length
        for key, vec in [("fp32", flats[run.group])] + sorted(moments[run.group].items()):
            if end > vec.numel():
                raise DeepSpeedImportError(
                    f"parameter {run.param.name!r} needs elements [{run.local}, {end}) of "
                    f"this rank's flat group {run.group}, which has {vec.numel()}: the "
                    "shapes do not add up",
                    path=path,
                    tensor=f"{key} group {run.group}",
                )
            view = vec[run.local : end]
            names = (
                [model_name(n) for n in [fqn, *aliases.get(fqn, [])]]
                if key == "fp32"
                else [optim_name(fqn, key)]
            )
            release_once = Releaser(view, len(names))
            for name in names:
                data = view.float() if key == "fp32" else view
                sink.put_run(name, data, run.start, run.param.shape, release_once)


def _zero(files: Files, ms: ModelStates, naming: Naming, sink: Sink) -> tuple[int, GroupFacts]:
    world = len(files.optim_states)
    info = GroupFacts()
    stage = -1
    sizes0: list[int] = []
    aliases: dict[str, list[str]] = {}
    for alias, src in ms.shared.items():
        aliases.setdefault(naming.fqn(src), []).append(naming.fqn(alias))
    for r, path in enumerate(files.optim_states):
        top = load(path)
        osd = get_key(top, "optimizer_state_dict", path, dict)
        s = _stage(osd, path)
        if r == 0:
            stage = s
        elif s != stage:
            raise DeepSpeedImportError(
                f"expected ZeRO stage {stage} (rank 0's file); this file says {s}",
                path=path,
                tensor="zero_stage",
            )
        count = osd.get("partition_count")
        count = max(count) if isinstance(count, list) and count else count
        if count != world:
            raise DeepSpeedImportError(
                f"this file was written by one of {count} ranks, but the folder holds "
                f"{world} optimizer files: mismatched world sizes (files of two runs mixed?)",
                path=path,
                tensor="partition_count",
            )
        if (stage == 3) != (len(files.model_states) > 1):
            raise DeepSpeedImportError(
                f"ZeRO stage {stage} optimizer files next to "
                f"{[p.name for p in files.model_states]}: the model states files do not "
                "belong to this stage",
                path=path,
            )
        flats, moments, hyper, steps, pads = _rank_part(osd, stage, len(ms.groups), path)
        if stage <= 2:
            sizes = [
                (m["exp_avg"].numel() if "exp_avg" in m else f.numel() + p)
                for f, m, p in zip(flats, moments, pads, strict=True)
            ]
            if r == 0:
                sizes0 = sizes
            elif sizes != sizes0:
                raise DeepSpeedImportError(
                    f"expected partitions of {sizes0} elements (rank 0); this rank's are "
                    f"{sizes}: the shapes do not add up",
                    path=path,
                    tensor="single_partition_of_fp32_groups",
                )
            paddings = osd.get("param_alignment_paddings")
            runs = runs_zero12(ms.groups, paddings, sizes, r, world, path)
        else:
            runs = runs_zero3(ms.groups, [f.numel() for f in flats], r, world, path)
        for g, m in enumerate(moments):
            for k, v in m.items():
                if v.numel() != (sizes[g] if stage <= 2 else flats[g].numel()):
                    raise DeepSpeedImportError(
                        f"expected the Adam state to match the partition "
                        f"({flats[g].numel()} elements); found {v.numel()}",
                        path=path,
                        tensor=f"state[{g}][{k!r}]",
                    )
        sink.open_group()
        if r == 0:
            info = GroupFacts(hyper, steps, osd.get("loss_scaler"))
            write_rank0_extras(sink, ms, naming, steps)
        _write_runs(sink, runs, flats, moments, naming, aliases, path)
        del top, osd, flats, moments
    return stage, info


def write_rank0_extras(
    sink: Sink, ms: ModelStates, naming: Naming, steps: list[float | None]
) -> None:
    for name, t in ms.buffers.items():
        sink.put(model_name(naming.fqn(name)), t.float() if t.is_floating_point() else t)
    for g, params in enumerate(ms.groups):
        if steps[g] is None:
            continue
        for p in params:
            sink.put(
                optim_name(naming.fqn(p.name), "step"), torch.tensor(steps[g], dtype=torch.float32)
            )


def _optimizer_meta(
    groups: list[list[Param]], naming: Naming, info: GroupFacts, has_moments: bool
) -> dict[str, Any] | None:
    if not info.hyper:
        return None
    keys = (["step"] if info.step and info.step[0] is not None else []) + (
        list(MOMENTS) if has_moments else []
    )
    return {
        "param_groups": [
            {**info.hyper[g], "params": [naming.fqn(p.name) for p in params]}
            for g, params in enumerate(groups)
        ],
        "tensor_keys": {naming.fqn(p.name): keys for params in groups for p in params}
        if keys
        else {},
        "extra": {},
    }


def zero_free(raw: Any, files: Files) -> dict[str, Any]:
    """`raw`, the model states file of a folder without ZeRO optimizer files, when it is a
    stage 0 checkpoint ([Note: stage 0 layout]); else the error for the missing files."""
    if isinstance(raw, dict) and raw.get("param_shapes") is None and "optimizer" in raw:
        return raw
    raise DeepSpeedImportError(
        "expected DeepSpeed ZeRO optimizer files (*zero_pp_rank_R_mp_rank_00_optim_states"
        ".pt) next to this ZeRO model states file (it has param_shapes), or a universal "
        f"checkpoint's zero/ folder; found {sorted(p.name for p in files.directory.iterdir())[:10]}"
        ": an incomplete copy or an interrupted save",
        path=files.directory,
    )


def import_deepspeed(
    ds_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    tag: str | None = None,
    renames: Sequence[tuple[str, str]] = (),
    compression: Literal["zstd", "none"] = "zstd",
    threads: int | None = None,
) -> ImportReport:
    """Convert the DeepSpeed checkpoint at `ds_dir` (root with `latest`, or a tag
    directory; ZeRO 0-3 or universal) into `out_dir/<tag>`, and point `out_dir/latest`
    at it. `renames`: (regex, replacement) pairs applied to every name with re.sub.
    `compression`, `threads`: as RankWriter's (threads None: up to 4, one per core).

    Raises:
        DeepSpeedImportError: refused pickle globals, missing or truncated files,
            mismatched world sizes, shapes that do not add up (names file and key).

    Example::

        import_deepspeed("ds_ckpts", "fsdpx_ckpts")
        engine.load_checkpoint("fsdpx_ckpts")
    """
    from checkpoint_tools.deepspeed import stage0, universal

    files = find_files(Path(ds_dir), tag)
    raw = load(files.model_states[0])
    st0 = None
    if not files.universal and not files.optim_states:
        st0 = stage0.parse_stage0(zero_free(raw, files), files.model_states[0])
        ms = st0.ms
    else:
        ms = parse_model_states(raw, files.model_states[0])
    naming = Naming(
        [p.name for g in ms.groups for p in g] + list(ms.buffers) + list(ms.shared), renames
    )
    ndim = max([len(p.shape) for g in ms.groups for p in g] + [0])
    slots = 1 if files.universal else max_pieces(ndim)
    threads = threads or min(4, os.cpu_count() or 1)
    sink = Sink(Path(out_dir), files.directory.name, slots, compression, threads)
    try:
        meta: dict[str, Any] | None
        if st0 is not None:
            info, meta = stage0.convert(st0, naming, sink, files.model_states[0], naming.notes)
            kind, world = "ZeRO-0", int(ms.raw.get("dp_world_size") or 1)
        elif files.universal:
            info, has_moments = universal.convert(files, ms, naming, sink)
            meta = _optimizer_meta(ms.groups, naming, info, has_moments)
            kind, world = "universal", 1
        else:
            stage, info = _zero(files, ms, naming, sink)
            meta = _optimizer_meta(ms.groups, naming, info, True)
            kind, world = f"ZeRO-{stage}", len(files.optim_states)
        kept, dropped = ts.client_state(ms.raw)
        gas = int(ms.config.get("gradient_accumulation_steps") or 1)
        lrs = [float(h.get("lr", 0.0)) for h in info.hyper]
        engine = ts.counters(ms.raw, gas)
        state = {
            "version": 1,
            "tag": sink.tag,
            "step": engine["global_steps"],
            "engine": engine,
            "optimizer": meta,
            "lr_scheduler": ts.scheduler(ms.raw.get("lr_scheduler"), lrs),
            "loss_scaler": ts.loss_scaler(info.loss_scaler, ms.dtype == "fp16", ms.config),
            "client_state": kept,
            "layout": {"zero_stage": int(kind[-1]) if kind.startswith("ZeRO") else None},
            "rng": [],
            "deepspeed": {
                "source": str(files.directory),
                "kind": kind,
                "world_size": world,
                "ds_version": str(ms.raw.get("ds_version")),
                "dropped_client_state": dropped,
            },
        }
        final = sink.commit(state)
    except BaseException:
        sink.abort()
        raise
    return ImportReport(
        files.directory,
        final,
        kind,
        world,
        ms.dtype,
        sum(len(g) for g in ms.groups),
        engine["global_steps"],
        dropped,
        naming.notes,
    )
