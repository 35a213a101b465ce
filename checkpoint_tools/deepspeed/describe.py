"""`fsdpx-ckpt inspect DS_DIR` on a DeepSpeed checkpoint: what it is and what an import
keeps and drops, without converting it (reads the model states file and rank 0's
optimizer file, through the same restricted unpickler as the import; ZeRO stage 0 keeps
its optimizer in the model states file)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from checkpoint_tools.deepspeed import training_state as ts
from checkpoint_tools.deepspeed.convert import get_key, zero_free
from checkpoint_tools.deepspeed.folder import find_files
from checkpoint_tools.deepspeed.model_states import parse_model_states
from checkpoint_tools.deepspeed.stage0 import parse_stage0
from checkpoint_tools.deepspeed.unpickle import Stand_in, load


def describe(ds_dir: str | Path, tag: str | None = None) -> dict[str, Any]:
    """A JSON-able description of the DeepSpeed checkpoint at `ds_dir`."""
    files = find_files(Path(ds_dir), tag)
    raw = load(files.model_states[0])
    stage: Any
    if not files.universal and not files.optim_states:
        ms = parse_stage0(zero_free(raw, files), files.model_states[0]).ms
        stage = 0
    else:
        ms = parse_model_states(raw, files.model_states[0])
        first = (
            files.directory / "zero" / "optimizer_state.pt"
            if files.universal
            else files.optim_states[0]
        )
        top = load(first)
        osd = top if files.universal else get_key(top, "optimizer_state_dict", first, dict)
        stage = osd.get("zero_stage") if isinstance(osd, dict) else None
        stage = stage.args[0] if isinstance(stage, Stand_in) and stage.args else stage
    kept, dropped = ts.client_state(ms.raw)
    scheduler = ms.config.get("scheduler")
    params = [
        {"name": p.name, "shape": list(p.shape), "group": p.group} for g in ms.groups for p in g
    ]
    return {
        "deepspeed": str(files.directory),
        "kind": "universal" if files.universal else f"ZeRO-{stage}",
        "zero_stage": stage,
        "world_size": int(ms.raw.get("dp_world_size") or len(files.optim_states) or 1),
        "dtype": ms.dtype,
        "ds_version": str(ms.raw.get("ds_version")),
        "global_steps": int(ms.raw.get("global_steps") or 0),
        "param_groups": len(ms.groups),
        "parameters": params,
        "numel": sum(p.numel for g in ms.groups for p in g),
        "buffers": sorted(ms.buffers),
        "scheduler": scheduler.get("type") if isinstance(scheduler, dict) else None,
        "import_keeps": [
            "fp32 weights and buffers",
            "Adam exp_avg, exp_avg_sq, step",
            "param group hyperparameters",
            "global_steps, skipped_steps, global_samples",
            "lr scheduler position",
            *(["fp16 loss scaler"] if ms.dtype == "fp16" else []),
            *[f"client_state[{k!r}]" for k in sorted(kept)],
        ],
        "import_drops": [
            f"{ms.dtype} model copies (rebuilt from the fp32 weights)",
            "RNG states (DeepSpeed does not save them)",
            *[f"client_state[{k!r}] (not msgpack-able)" for k in dropped],
        ],
    }


def format_description(info: dict[str, Any]) -> str:
    lines = [
        f"DeepSpeed checkpoint {info['deepspeed']}",
        f"  {info['kind']}, {info['world_size']} rank(s), {info['dtype']}, DeepSpeed "
        f"{info['ds_version']}, step {info['global_steps']}, scheduler {info['scheduler']}",
        f"  {len(info['parameters'])} parameters ({info['numel']} elements) in "
        f"{info['param_groups']} group(s), buffers {info['buffers']}",
    ]
    lines += [f"    {p['name']:<40} {p['shape']} group {p['group']}" for p in info["parameters"]]
    lines.append("  import keeps: " + "; ".join(info["import_keeps"]))
    lines.append("  import drops: " + "; ".join(info["import_drops"]))
    lines.append("  convert with: fsdpx-ckpt import-deepspeed DS_DIR OUT_DIR")
    return "\n".join(lines)
