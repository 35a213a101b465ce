"""`deepspeed.initialize`, `add_config_arguments` and `init_distributed` on fsdpx.

`initialize` reads the DeepSpeed config (a dict, a path, or `args.deepspeed_config`),
translates it with `Config.from_deepspeed`, shards the model with `fsdpx.shard` (which
gives every rank rank 0's initial weights, as DeepSpeed's broadcast does) and wraps the
native engine in `DeepSpeedEngine`. What the script built before the call — parameter
groups, an optimizer, a scheduler — is carried onto the sharded parameters by name
([Note: parameters across sharding] in fsdpx/param_groups.py).

Optimizer choice follows DeepSpeed: an `optimizer=` argument (instance or callable)
overrides the config's "optimizer" section; with neither there is no optimizer, which
DeepSpeed allows only for engines that never train — here it is an error, since the
native engine always steps one. The scheduler likewise: `lr_scheduler=` (instance or
callable `optimizer -> scheduler`) overrides the "scheduler" section.

A `deepspeed.pipe.PipelineModule` runs through fsdpx's pipeline parallelism: the config
gets its stage count, split points and schedule from the module (_pipe_config.py).
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fsdpx.config import Config
from fsdpx.deepspeed._engine import DeepSpeedEngine
from fsdpx.deepspeed._json import load_deepspeed_config
from fsdpx.deepspeed._moe import with_model_ep
from fsdpx.deepspeed._pipe_config import (
    pipeline_config,
    pipeline_ds_config,
    pipeline_loss_fn,
)
from fsdpx.deepspeed.pipe import PipelineModule
from fsdpx.param_groups import optimizer_groups, rebind_optimizer_, resolve_groups
from fsdpx.sharding import shard

log = logging.getLogger("fsdpx.deepspeed")


def initialize(
    args: Any = None,
    model: nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: str | Path | Mapping[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | Path | Mapping[str, Any] | None = None,
) -> tuple[DeepSpeedEngine, torch.optim.Optimizer, Any, Any]:
    """DeepSpeed's `initialize`: returns (engine, optimizer, training_dataloader,
    lr_scheduler); the data loader is None without training_data.

    Example (a DeepSpeed script, unchanged but for the import)::

        import fsdpx.deepspeed as deepspeed
        engine, optimizer, loader, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), training_data=dataset,
            config="ds_config.json")
        for x, y in loader:
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
    """
    if model is None:
        raise ValueError("deepspeed.initialize needs model=")
    if mpu is not None:
        raise ValueError(
            "mpu= (a Megatron model-parallel unit) is not supported: fsdpx builds its own "
            "mesh; set tensor_parallel.autotp_size / pipeline.stages in the config instead"
        )
    if mesh_param is not None:
        raise ValueError(
            "mesh_param= is not supported: set the data/sequence/tensor sizes in the config"
        )
    _show_info_logs()
    ds_config = _read_config(args, config, config_params)
    loss_fn = None
    if isinstance(model, PipelineModule):
        ds_config = pipeline_ds_config(model, ds_config)
        cfg = pipeline_config(model, Config.from_deepspeed(ds_config))
        loss_fn = pipeline_loss_fn(model)
    else:
        cfg = Config.from_deepspeed(ds_config)
    cfg = with_model_ep(model, cfg)  # DeepSpeed's ep_size lives in MoE(...), not the config
    opt_arg, sched_arg = _optimizer_and_scheduler(model, ds_config, cfg, optimizer, lr_scheduler)
    groups = model_parameters
    if isinstance(optimizer, torch.optim.Optimizer) or model_parameters is None:
        groups = None  # an instance keeps its own groups; None: every trainable parameter
    engine = shard(
        model,
        cfg,
        optimizer=opt_arg,
        lr_scheduler=sched_arg,
        loss_fn=loss_fn,
        param_groups=groups,
    )
    ds_engine = DeepSpeedEngine(
        engine, ds_config=ds_config, training_data=training_data, collate_fn=collate_fn
    )
    return ds_engine, engine.optimizer, ds_engine.training_dataloader, engine.lr_scheduler


def _show_info_logs() -> None:
    """DeepSpeed prints its INFO lines (config summary, progress) through a handler of its
    own; do the same for the "fsdpx" logger, but only when the application configured no
    logging itself (its configuration then decides)."""
    fsdpx_log = logging.getLogger("fsdpx")
    if fsdpx_log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(name)s] %(message)s"))
    fsdpx_log.addHandler(handler)
    fsdpx_log.setLevel(logging.INFO)
    fsdpx_log.propagate = False


def _read_config(args: Any, config: Any, config_params: Any) -> dict[str, Any]:
    if config is None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None and config is not None:
        raise ValueError(
            "DeepSpeed config given twice: args.deepspeed_config and config=; pass one "
            "(DeepSpeed raises here too)"
        )
    config = config if config is not None else from_args
    if config is None:
        raise ValueError(
            "no DeepSpeed config: pass config= (a dict or a JSON path) or args with "
            "--deepspeed_config (see deepspeed.add_config_arguments)"
        )
    if not isinstance(config, Mapping | str | os.PathLike):
        raise ValueError(f"config must be a dict or a path; got {type(config).__name__}")
    return load_deepspeed_config(config if isinstance(config, Mapping) else Path(config))[0]


def _optimizer_and_scheduler(
    model: nn.Module,
    ds_config: Mapping[str, Any],
    cfg: Config,
    optimizer: Any,
    lr_scheduler: Any,
) -> tuple[Callable[[list[Any]], torch.optim.Optimizer] | None, Any]:
    """shard()'s optimizer and scheduler arguments for DeepSpeed's (see module docstring)."""
    partial = cfg.mesh.pp > 1 or cfg.pipeline.stages_per_rank > 1
    offloaded = (
        cfg.zero.offload_optimizer.device != "none" or cfg.zero.offload_param.device != "none"
    )
    opt_arg: Callable[[list[Any]], torch.optim.Optimizer] | None
    if isinstance(optimizer, torch.optim.Optimizer):
        instance = optimizer
        if offloaded:
            raise ValueError(
                "an optimizer instance with ZeRO-Offload: the offloaded step runs fsdpx's "
                'fused host Adam; set the "optimizer" section of the config instead'
            )
        named = optimizer_groups(model, instance)

        def rebind(params: list[Any]) -> torch.optim.Optimizer:
            rebind_optimizer_(instance, resolve_groups(model, named, partial=partial))
            return instance

        opt_arg = rebind

    elif optimizer is not None:
        if not callable(optimizer):
            raise ValueError(
                f"optimizer must be a torch.optim.Optimizer or a callable params -> "
                f"optimizer; got {type(optimizer).__name__}"
            )
        opt_arg = optimizer  # shard calls it with model_parameters' groups, sharded

    elif "optimizer" in ds_config:
        opt_arg = None  # shard builds it from the config, in model_parameters' groups
    else:
        raise ValueError(
            'no optimizer: the DeepSpeed config has no "optimizer" section and initialize() '
            "got no optimizer=. DeepSpeed has no default optimizer either (its engine could "
            'not train); pass optimizer= or add an "optimizer" section'
        )

    if lr_scheduler is None:
        return opt_arg, None
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        return opt_arg, lr_scheduler
    sched = lr_scheduler
    if getattr(sched, "optimizer", None) is not optimizer:
        raise ValueError(
            f"the lr_scheduler passed to initialize ({type(sched).__name__}) wraps an optimizer "
            "other than optimizer=: fsdpx keeps the optimizer instance you pass and rebinds "
            "it to the sharded parameters, so a scheduler must wrap that instance (or pass a "
            "callable `optimizer -> scheduler`)"
        )
    return opt_arg, lambda opt: sched


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's `--deepspeed`, `--deepspeed_config` (and the deprecated
    `--deepscale`, `--deepscale_config`) arguments, plus `--local_rank`, which the
    `deepspeed` launcher passes and torchrun does not."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file."
    )
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    if not any(a.dest == "local_rank" for a in parser._actions):
        group.add_argument(
            "--local_rank",
            "--local-rank",
            type=int,
            default=int(os.environ.get("LOCAL_RANK", -1)),
            help="local rank passed by the launcher (torchrun sets LOCAL_RANK instead)",
        )
    return parser


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = 29500,
    verbose: bool = True,
    timeout: timedelta | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Start the default process group (DeepSpeed's `deepspeed.init_distributed`).

    Reads the launcher's environment (torchrun: RANK, WORLD_SIZE, MASTER_ADDR, ...). A
    second call is a no-op, as in DeepSpeed. MPI discovery (launching with mpirun) is
    not supported: launch with torchrun.
    """
    import torch.distributed as dist

    if dist.is_initialized() or dist_init_required is False:
        return
    env_rank, env_world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    rank = rank if rank >= 0 else int(env_rank) if env_rank is not None else -1
    world_size = world_size if world_size > 0 else int(env_world) if env_world else -1
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        # fsdpx also runs CPU collectives (the checkpoint vote, fp16 overflow flags on host
        # tensors): nccl for CUDA tensors plus gloo for CPU ones, as fsdpx.init_distributed.
        backend = "cuda:nccl,cpu:gloo"
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if rank < 0 and world_size <= 0:
        # No launcher (plain `python script.py`): one rank. DeepSpeed would look for MPI
        # here; fsdpx does not discover MPI ranks (launch with torchrun for more).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return
    if rank < 0 or world_size <= 0:
        raise RuntimeError(
            f"init_distributed: rank {rank} and world size {world_size} must both be given "
            "(torchrun sets RANK and WORLD_SIZE)"
        )
    if init_method is None:
        # torchrun sets MASTER_ADDR/MASTER_PORT; without them, DeepSpeed's default port.
        have_env = "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
        init_method = "env://" if have_env else f"tcp://127.0.0.1:{distributed_port}"
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, **kwargs
    )
    if verbose:
        log.info(
            "initialized torch.distributed (%s): rank %d of %d",
            backend,
            dist.get_rank(),
            dist.get_world_size(),
        )
