"""`deepspeed.zero`: `Init`, DeepSpeed's context for building a model too large for one
rank, mapped onto fsdpx's meta-device construction, and `GatheredParameters`, the context
that makes sharded parameters full for a while (fsdpx/deepspeed/_gathered.py, [Note:
GatheredParameters on FSDP2]).

[Note: zero.Init on the meta device]
DeepSpeed's `zero.Init` partitions each parameter as its module's `__init__` returns, so
no rank ever holds the whole model. fsdpx reaches the same end differently: inside
`Init` modules are built on the meta device (no memory at all), and `initialize` /
`fsdpx.shard` allocate each rank's shards only after sharding, initialising them with
each module's `reset_parameters()`, seeded identically on every rank (fsdpx/materialize.py).
The difference a script can see: values written in `__init__` (e.g. a
`self.apply(self._init_weights)`) act on meta tensors and are not kept; give such
modules a `reset_parameters()` or build the model outside `Init`.
"""

from types import TracebackType as _TracebackType
from typing import Any as _Any

import torch as _torch

from fsdpx.deepspeed._gathered import GatheredParameters


class Init:
    """Build the modules created inside on the meta device (see the module docstring).

    Example::

        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            model = MyModel()
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    """

    def __init__(
        self,
        module: _Any = None,
        data_parallel_group: _Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: _Any = None,
        config: _Any = None,
        enabled: bool = True,
        dtype: _torch.dtype | None = None,
        mpu: _Any = None,
        **options: _Any,
    ) -> None:
        if module is not None:
            raise ValueError(
                "zero.Init(module=...) partitions a model that is already built; with fsdpx "
                "pass that model to deepspeed.initialize, which shards it"
            )
        if remote_device not in (None, "none"):
            raise ValueError(
                f"zero.Init(remote_device={remote_device!r}): parameter placement comes from "
                'the config\'s "zero_optimization.offload_param" section in fsdpx'
            )
        if mpu is not None:
            raise ValueError("zero.Init(mpu=...) is not supported: fsdpx builds its own mesh")
        if dtype not in (None, _torch.float32):
            raise ValueError(
                f"zero.Init(dtype={dtype}): fsdpx keeps fp32 master weights and casts for "
                'compute from the config\'s "bf16"/"fp16" section; leave dtype unset'
            )
        self.enabled = enabled
        self._device = _torch.device("meta")

    def __enter__(self) -> "Init":
        if self.enabled:
            self._device.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: _TracebackType | None,
    ) -> None:
        if self.enabled:
            self._device.__exit__(exc_type, exc, tb)


__all__ = ["GatheredParameters", "Init"]
