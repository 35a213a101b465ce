"""fsdpx.deepspeed: the home of DeepSpeed compatibility.

A DeepSpeed script will import this package as ``import fsdpx.deepspeed as deepspeed``, so
its public names are exactly DeepSpeed's own (DESIGN.md, Round 2 additions). Provided
so far: ``initialize``, ``PipelineModule``, ``add_config_arguments``, ``init_distributed``,
``DeepSpeedEngine``, ``get_accelerator`` and the submodules ``comm``, ``accelerator``,
``utils``, ``checkpointing``, ``moe`` (``moe.layer.MoE``), ``ops`` (``ops.adam``, ``ops.lamb``), ``runtime`` (``runtime.utils``,
``runtime.dataloader``, ``runtime.lr_schedules``), ``zero`` (``zero.Init``,
``zero.GatheredParameters``), ``pipe`` (``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec``). DeepSpeed names not
listed here are absent, not stubbed (README, "Porting from DeepSpeed").

The DeepSpeed *config* translation lives here under private names, imported directly by
its callers (``Config.from_deepspeed``, ``fsdpx config explain``):

    _json.py      reads a ds_config file (comments and trailing commas included)
    _keys.py      the key table: every DeepSpeed key mapped, ignored or refused
    _config.py    translates a ds_config dict into fsdpx.Config through that table
    _explain.py   prints the translation table (``fsdpx config explain``)

and the engine under private names too:

    _initialize.py  initialize, add_config_arguments, init_distributed
    _engine.py      DeepSpeedEngine, the adapter over the native Engine
    _data.py        the DataLoader built from training_data; RepeatingLoader
    _save16.py      save_16bit_model
    _gathered.py    zero.GatheredParameters on FSDP2's sharded parameters
    _partition.py   PipelineModule's partition methods
    _pipe_config.py the config a PipelineModule gets (stages, split points, schedule)

[Note: lazy deepspeed package] ``_config`` imports ``fsdpx.config``, and
``fsdpx.config`` imports ``_config`` inside ``Config.from_deepspeed``. If this file
imported its submodules eagerly, importing any of them would first run this file and
form a cycle through ``fsdpx.config``. Public names are therefore resolved on first use
(PEP 562 ``__getattr__``) from ``_EXPORTS``, and this file imports nothing from fsdpx.
"""

# Imports under private aliases and no `from __future__ import annotations`: every public
# name of this module is a DeepSpeed name, so `dir(deepspeed)` shows nothing of fsdpx's own.
import importlib as _importlib
from typing import Any as _Any

# public name (a DeepSpeed name) -> module that defines it (a submodule is itself the value)
_EXPORTS: dict[str, str] = {
    "DeepSpeedEngine": "fsdpx.deepspeed._engine",
    "PipelineModule": "fsdpx.deepspeed.pipe",
    "accelerator": "fsdpx.deepspeed.accelerator",
    "add_config_arguments": "fsdpx.deepspeed._initialize",
    "checkpointing": "fsdpx.deepspeed.checkpointing",
    "comm": "fsdpx.deepspeed.comm",
    "get_accelerator": "fsdpx.deepspeed.accelerator",
    "init_distributed": "fsdpx.deepspeed._initialize",
    "initialize": "fsdpx.deepspeed._initialize",
    "moe": "fsdpx.deepspeed.moe",
    "ops": "fsdpx.deepspeed.ops",
    "pipe": "fsdpx.deepspeed.pipe",
    "runtime": "fsdpx.deepspeed.runtime",
    "utils": "fsdpx.deepspeed.utils",
    "zero": "fsdpx.deepspeed.zero",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> _Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdpx.deepspeed' has no attribute {name!r}")
    loaded = _importlib.import_module(module)
    value = loaded if module == f"{__name__}.{name}" else getattr(loaded, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
