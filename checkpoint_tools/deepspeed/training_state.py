"""DeepSpeed's non-tensor training state as the fsdpx checkpoint's `state` (FORMAT.md §4.3).

[Note: imported training state]
- Counters: DeepSpeed's `global_steps` counts optimizer-step boundaries, skipped fp16
  steps included, as fsdpx's engine does; `micro_steps` is not saved by DeepSpeed and is
  `global_steps * gradient_accumulation_steps` at a checkpoint (DeepSpeed saves only at
  boundaries). `global_samples` is kept in the engine state for reference.
- Scheduler: DeepSpeed's schedules save `{"last_batch_iteration": i}`; fsdpx's
  (fsdpx/schedulers.py) are torch LRSchedulers whose `last_epoch` counts step() calls,
  `i + 1` at the same point; `_step_count` is `last_epoch + 1` (torch's constructor step)
  and `_last_lr` the groups' current lr. torch's load_state_dict updates only these
  keys, so the schedule's configuration comes from the resuming job's config. A torch
  scheduler's own state dict (a client scheduler) is kept as it is when msgpack-able.
- Loss scaler: the pickled DeepSpeed scaler's attributes, as fsdpx's DynamicLossScaler
  (`cur_scale`, `cur_iter`, `last_overflow_iter`, `cur_hysteresis`: the same rules) or
  StaticLossScaler (`cur_scale`) state; none for fp32/bf16 runs (fsdpx has no scaler
  state there).
- client_state: DeepSpeed stores the user's client_state as extra top-level keys of the
  model states file. Values that are msgpack-able are kept; the others (tensors,
  objects) are dropped and listed in the import report and in `state["deepspeed"]`.
- RNG states: DeepSpeed does not save them; none are restored.
"""

from __future__ import annotations

from typing import Any

from checkpoint_tools.deepspeed.unpickle import Stand_in

# The keys DeepSpeed's engine itself writes into the model states file (engine.py
# _save_checkpoint / _save_zero_checkpoint); every other top-level key is client_state.
ENGINE_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "compiled_autograd",
        "autoep_layers",
        "checkpoint_parallel_dimensions",
    }
)

_SCALER_KEYS = {
    True: ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"),
    False: ("cur_scale",),
}


def plain(value: Any) -> Any:
    """`value` as msgpack-able data, or raise TypeError (tuples become lists)."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        if isinstance(value, int) and not -(2**63) <= value < 2**64:
            raise TypeError("integer does not fit in 64 bits")
        return value
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str | int) and not isinstance(k, bool) for k in value):
            raise TypeError("dict keys must be str or int")
        return {k: plain(v) for k, v in value.items()}
    raise TypeError(f"a {type(value).__name__}")


def counters(model_states: dict[str, Any], gas: int) -> dict[str, int]:
    steps = int(model_states.get("global_steps") or 0)
    out = {
        "global_steps": steps,
        "micro_steps": steps * gas,
        "skipped_steps": int(model_states.get("skipped_steps") or 0),
    }
    if model_states.get("global_samples") is not None:
        out["global_samples"] = int(model_states["global_samples"])
    return out


def scheduler(saved: Any, lrs: list[float]) -> dict[str, Any] | None:
    """fsdpx's scheduler state for DeepSpeed's saved `lr_scheduler` entry."""
    if saved is None:
        return None
    if isinstance(saved, dict) and set(saved) == {"last_batch_iteration"}:
        i = int(saved["last_batch_iteration"])
        return {"last_epoch": i + 1, "_step_count": i + 2, "_last_lr": list(lrs)}
    try:
        return plain(saved)  # a torch scheduler's own state dict
    except TypeError:
        return None


def loss_scaler(saved: Any, fp16: bool, config: dict[str, Any]) -> dict[str, Any] | None:
    """fsdpx's loss-scaler state for the pickled DeepSpeed scaler, or for the scaler
    fields a stage 0 fp16 optimizer saves (a dict; None unless fp16). Those fields omit
    `cur_hysteresis`: DeepSpeed resumes it at the config's `hysteresis`, and so does
    the import."""
    if not fp16:
        return None
    if isinstance(saved, Stand_in):
        state = saved.state
        dynamic = bool(state.get("dynamic", type(saved).__name__ == "DynamicLossScaler"))
    elif isinstance(saved, dict):
        dynamic = bool(saved.get("dynamic_loss_scale"))
        section = config.get("fp16")
        hysteresis = section.get("hysteresis", 2) if isinstance(section, dict) else 2
        state = {"cur_hysteresis": hysteresis, **saved}
    else:
        return None
    out: dict[str, Any] = {}
    for key in _SCALER_KEYS[dynamic]:
        if key not in state:
            return None
        out[key] = float(state[key]) if key == "cur_scale" else int(state[key])
    return out


def client_state(model_states: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(kept client_state, names of dropped keys)."""
    kept: dict[str, Any] = {}
    dropped = []
    for k, v in model_states.items():
        if k in ENGINE_KEYS:
            continue
        try:
            if not isinstance(k, str):
                raise TypeError("key")
            kept[k] = plain(v)
        except TypeError:
            dropped.append(str(k))
    return kept, sorted(dropped)
