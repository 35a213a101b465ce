"""Extract every config key DeepSpeed accepts, as dotted paths, into a JSON file.

Run once, in a SEPARATE environment that has DeepSpeed installed (never fsdpx's own: fsdpx
and its tests must not import deepspeed)::

    python3 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch deepspeed==0.19.8
    DS_ACCELERATOR=cpu /tmp/dsvenv/bin/python scripts/extract_deepspeed_keys.py \
        tests/data/deepspeed_0.19.8_keys.json

The output is checked in; tests/test_deepspeed_keys_cover.py reads it and asserts that
fsdpx's DeepSpeed key table (fsdpx.deepspeed._keys.DS_KEYS) has a row for every key.

[Note: how the key list is derived]
DeepSpeed reads its JSON config in two ways, and the script follows both:

1. Constants read with ``get_scalar_param`` / ``dict.get`` / ``in`` / ``[]`` by
   ``DeepSpeedConfig`` (deepspeed/runtime/config.py, with the key names from
   runtime/constants.py and the other *constants.py modules). These are found by
   *tracing*: the config dict is replaced by a recording dict that logs every key looked
   up, with its dotted path, and every statement of ``DeepSpeedConfig._initialize_params``
   (and the config's other methods that read ``_param_dict``) is run against it. Reads
   that only happen inside a block (``data_efficiency.data_sampling.curriculum_learning.*``)
   or only when a feature is on are reached by probing: each key seen is tried as an
   empty block, and each ``enabled`` key as true; a probe that makes DeepSpeed raise is
   withdrawn. The loop runs until no probe adds a key.
2. Pydantic models (``DeepSpeedConfigModel``: ZeRO, offload, bf16/fp16, compile, hybrid
   engine, monitors, comms logger, tensor parallel, timers, ...). DeepSpeed builds them
   with ``Model(**block)``; the trace sees which block was unpacked right before each
   model's ``__init__``, which gives the model's mount path. Each mounted model is then
   walked: every field name and alias, recursing into fields whose type is a model.

``optimizer.params`` and ``scheduler.params`` are passed through to the optimizer and
scheduler constructors, so their keys are the constructor parameters of the classes
DeepSpeed's engine builds for each type (runtime/engine.py ``_configure_basic_optimizer``,
runtime/lr_schedules.py). Optimizer types DeepSpeed resolves by
``getattr(torch.optim, type)`` or from the external ``mup`` package are not listed (their
parameters are torch's or mup's, not DeepSpeed's).

Top-level keys DeepSpeed itself rejects as removed features are recorded separately
(``removed``), with DeepSpeed's message.
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import os
import sys
import textwrap
import typing
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402  (only in the separate environment)
import deepspeed.runtime.config as ds_config  # noqa: E402
from deepspeed.runtime.config_utils import DeepSpeedConfigModel  # noqa: E402
from pydantic import BaseModel  # noqa: E402

Path = tuple[str, ...]

# --- tracing -------------------------------------------------------------------------------

LOOKUPS: set[Path] = set()
"""Every (path + key) DeepSpeed looked up."""
UNPACKED: list[tuple[Path, frozenset[str]]] = []
"""(path, keys) of the recording dicts iterated (``**block``), most recent last."""
MOUNTS: dict[type, set[Path]] = {}
"""Pydantic model -> paths of the blocks it was built from."""


class RecDict(dict):  # type: ignore[type-arg]
    """A dict that records every key looked up in it, with its dotted path."""

    def __init__(self, data: dict[str, Any], path: Path) -> None:
        super().__init__({k: _wrap(v, path + (k,)) for k, v in data.items()})
        self.path = path
        self.unpacking: set[str] = set()
        """Keys being read by `**block`: the probe's own keys, not lookups by name."""

    def _rec(self, key: Any) -> None:
        if key in self.unpacking:
            self.unpacking.discard(key)
        elif isinstance(key, str):
            LOOKUPS.add(self.path + (key,))

    def __getitem__(self, key: Any) -> Any:
        self._rec(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._rec(key)
        return super().get(key, default)

    def __contains__(self, key: Any) -> bool:
        self._rec(key)
        return super().__contains__(key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._rec(key)
        return super().setdefault(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self._rec(key)
        return super().pop(key, *default)

    def keys(self) -> Any:
        UNPACKED.append((self.path, frozenset(dict.keys(self))))
        return RecKeys(self)

    def __iter__(self) -> Any:
        # Overriding __iter__ makes `**block` go through keys() (CPython's slow path).
        return iter(list(super().keys()))

    def __copy__(self) -> RecDict:
        return RecDict(dict(super().items()), self.path)


class RecKeys:
    """``block.keys()``: DeepSpeed tests ``KEY in block.keys()``, so membership records too."""

    def __init__(self, owner: RecDict) -> None:
        self.owner = owner

    def __contains__(self, key: Any) -> bool:
        if UNPACKED and UNPACKED[-1][0] == self.owner.path:
            UNPACKED.pop()  # a membership test, not a `**block`
        return self.owner.__contains__(key)

    def __iter__(self) -> Any:
        self.owner.unpacking = set(dict.keys(self.owner))
        return iter(list(self.owner.unpacking))

    def __len__(self) -> int:
        return dict.__len__(self.owner)


def _wrap(value: Any, path: Path) -> Any:
    return (
        RecDict(value, path)
        if isinstance(value, dict) and not isinstance(value, RecDict)
        else value
    )


_orig_init = DeepSpeedConfigModel.__init__


def _recording_init(self: Any, strict: bool = False, **data: Any) -> None:
    # The block a model is built from: the parent of its values' paths when they are
    # blocks themselves (DeepSpeedMonitorConfig(**{"tensorboard": block, ...})), else the
    # block unpacked last (Model(**block)) when it holds exactly these keys (a model built
    # from a dict DeepSpeed assembled itself is mounted nowhere).
    parents = {
        v.path[:-1] for k, v in data.items() if isinstance(v, RecDict) and v.path[-1:] == (k,)
    }
    if len(parents) == 1:
        MOUNTS.setdefault(type(self), set()).add(parents.pop())
    elif UNPACKED and UNPACKED[-1][0] and UNPACKED[-1][1] == frozenset(data):
        # (Never the root this way: DeepSpeed builds default models from `{}` right after
        # iterating the root's keys, and only the monitor models sit at the root.)
        MOUNTS.setdefault(type(self), set()).add(UNPACKED[-1][0])
    UNPACKED.clear()
    _orig_init(self, strict=strict, **data)


DeepSpeedConfigModel.__init__ = _recording_init  # type: ignore[method-assign]


def _statements(func: Any) -> list[ast.stmt]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    return fn.body


def _param_dict_methods() -> list[Any]:
    cls = ds_config.DeepSpeedConfig
    out = []
    for name, member in vars(cls).items():
        if name in ("__init__", "_initialize_params") or not inspect.isfunction(member):
            continue
        if "_param_dict" in inspect.getsource(member):
            out.append(member)
    return out


def _trace(probe: dict[str, Any]) -> int:
    """Read `probe` the way DeepSpeedConfig does; return how many statements raised."""
    cfg = ds_config.DeepSpeedConfig.__new__(ds_config.DeepSpeedConfig)
    cfg.global_rank, cfg.world_size = 0, 1
    root = RecDict(probe, ())
    cfg._param_dict = root
    # DeepSpeedConfig.__init__ reads "sequence_parallel_size" from the raw config.
    root.__contains__("sequence_parallel_size")
    scope = dict(vars(ds_config))
    scope.update(self=cfg, param_dict=root)
    failed = 0
    # Each statement on its own, so one that raises does not hide the reads after it.
    for stmt in _statements(ds_config.DeepSpeedConfig._initialize_params):
        code = compile(ast.Module(body=[stmt], type_ignores=[]), "<ds-config>", "exec")
        try:
            exec(code, scope)
        except Exception:
            failed += 1
        UNPACKED.clear()
    for method in _param_dict_methods():
        try:
            method(cfg)
        except Exception:
            failed += 1
        UNPACKED.clear()
    return failed


def _set(tree: dict[str, Any], path: Path, value: Any) -> None:
    node = tree
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def _probe_all() -> None:
    """Grow a probe config until tracing finds no new key (see the module's Note)."""
    probe: dict[str, Any] = {}
    failed = _trace(probe)
    tried: set[Path] = set()
    while True:
        todo = sorted(p for p in LOOKUPS if p not in tried)
        if not todo:
            return
        for path in todo:
            tried.add(path)
            # A non-empty block too: some readers return early on an empty one
            # (expert_parallel); {"enabled": False} changes nothing else. True last: some
            # keys have an old boolean form read differently (zero_optimization: true reads
            # the top-level allgather_size).
            values: list[Any] = (
                [True] if path[-1] in ("enabled", "enable") else [{}, {"enabled": False}, True]
            )
            for value in values:
                candidate = copy.deepcopy(probe)
                try:
                    _set(candidate, path, value)
                except (KeyError, TypeError):
                    break  # its parent is not a probed block
                # A probe that makes more statements raise is withdrawn; its reads up to
                # the raise are kept (they are real lookups).
                now = _trace(candidate)
                if now <= failed:
                    probe, failed = candidate, now
                # Alone too: some blocks are read only when another is absent (DeepSpeed
                # reads "bfloat16" only without "bf16").
                alone: dict[str, Any] = {}
                node = alone
                for p in path[:-1]:
                    node = node.setdefault(p, {})
                node[path[-1]] = value
                _trace(alone)


def _pipeline_keys() -> list[str]:
    """get_pipeline_config copies the "pipeline" block over a dict of defaults (no
    lookups to trace): its keys are the keys of that dict literal."""
    for node in ast.walk(ast.parse(inspect.getsource(ds_config.get_pipeline_config))):
        if isinstance(node, ast.Dict):
            return [
                k.value
                for k in node.keys
                if isinstance(k, ast.Constant) and isinstance(k.value, str)
            ]
    raise RuntimeError("get_pipeline_config has no defaults dict: update the extractor")


# --- pydantic models -----------------------------------------------------------------------


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _walk_model(model: type[BaseModel], path: Path, out: dict[str, dict[str, Any]]) -> None:
    for name, info in model.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        names = {name} | ({info.alias} if info.alias else set())
        for key in names:
            dotted = ".".join(path + (key,))
            entry = out.setdefault(dotted, {"source": f"{model.__module__}.{model.__name__}"})
            if key != name:
                entry["alias_of"] = name
            if extra.get("deprecated"):
                entry["deprecated"] = True
                if extra.get("new_param"):
                    entry["new_param"] = extra["new_param"]
            nested = _model_of(info.annotation)
            if nested is not None:
                entry["block"] = True
                _walk_model(nested, path + (key,), out)


# --- optimizer and scheduler parameters ----------------------------------------------------


def _params_of(cls: Any) -> list[str]:
    skip = {"self", "params", "model_params", "optimizer", "deepspeed"}
    sig = inspect.signature(cls.__init__)
    return [
        n
        for n, p in sig.parameters.items()
        if n not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def _optimizer_params() -> dict[str, list[str]]:
    """optimizer.params.<name> -> the DeepSpeed optimizer types that take it."""
    import torch
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.ops.lamb import FusedLamb
    from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

    # engine.py _configure_basic_optimizer: each type and the classes it may build, plus
    # the keys the engine itself pops before constructing (get_optimizer_configuration).
    classes: dict[str, list[Any]] = {
        "adam": [FusedAdam, DeepSpeedCPUAdam, torch.optim.Adam, torch.optim.AdamW],
        "adamw": [FusedAdam, DeepSpeedCPUAdam, torch.optim.Adam, torch.optim.AdamW],
        "adagrad": [DeepSpeedCPUAdagrad, torch.optim.Adagrad],
        "lamb": [FusedLamb],
        "lion": [FusedLion, DeepSpeedCPULion],
    }
    engine_keys = {
        "adam": ["adam_w_mode", "torch_adam", "fp32_optimizer_states", "foreach", "max_grad_norm"],
        "adamw": ["adam_w_mode", "torch_adam", "fp32_optimizer_states", "foreach", "max_grad_norm"],
    }
    out: dict[str, set[str]] = {}
    for opt_type, clss in classes.items():
        names = {n for c in clss for n in _params_of(c)} | set(engine_keys.get(opt_type, []))
        for n in names:
            out.setdefault(f"optimizer.params.{n}", set()).add(opt_type)
    return {k: sorted(v) for k, v in sorted(out.items())}


def _scheduler_params() -> dict[str, list[str]]:
    from deepspeed.runtime import lr_schedules

    out: dict[str, set[str]] = {}
    for name in lr_schedules.VALID_LR_SCHEDULES:
        cls = getattr(lr_schedules, name)
        for n in _params_of(cls):
            out.setdefault(f"scheduler.params.{n}", set()).add(name)
    return {k: sorted(v) for k, v in sorted(out.items())}


# --- main ----------------------------------------------------------------------------------


def extract() -> dict[str, Any]:
    _probe_all()
    keys: dict[str, dict[str, Any]] = {}
    blocks = {p[:i] for p in LOOKUPS for i in range(1, len(p))}
    for path in sorted(LOOKUPS):
        entry = keys.setdefault(".".join(path), {"source": "deepspeed.runtime.config (traced)"})
        if path in blocks:
            entry["block"] = True
    mounts = {}
    for model, paths in MOUNTS.items():
        for path in paths:
            mounts[".".join(path) or "<root>"] = f"{model.__module__}.{model.__name__}"
            _walk_model(model, path, keys)
            if path:
                keys.setdefault(".".join(path), {"source": "mount"})["block"] = True
    keys.setdefault("pipeline", {"source": "deepspeed.runtime.config.get_pipeline_config"})
    keys["pipeline"]["block"] = True
    for name in _pipeline_keys():
        keys[f"pipeline.{name}"] = {"source": "deepspeed.runtime.config.get_pipeline_config"}
    opt = _optimizer_params()
    for k, types_ in opt.items():
        keys.setdefault(k, {"source": "optimizer constructors"})["optimizer_types"] = types_
    for k, names in _scheduler_params().items():
        keys.setdefault(k, {"source": "deepspeed.runtime.lr_schedules"})["schedulers"] = names
    for k in ("optimizer.params", "scheduler.params"):
        keys.setdefault(k, {"source": "deepspeed.runtime.config (traced)"})["block"] = True
    removed = dict(ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS)
    removed.update(
        {f"zero_optimization.{k}": v for k, v in ds_config._REMOVED_ZERO_CONFIG_KEYS.items()}
    )
    return {
        "deepspeed_version": deepspeed.__version__,
        "extracted_by": "scripts/extract_deepspeed_keys.py",
        "pydantic_mounts": dict(sorted(mounts.items())),
        "keys": dict(sorted(keys.items())),
        "removed": dict(sorted(removed.items())),
    }


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "deepspeed_keys.json"
    data = extract()
    with open(out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=False)
        f.write("\n")
    print(f"{len(data['keys'])} keys from DeepSpeed {data['deepspeed_version']} -> {out}")


if __name__ == "__main__":
    main()
