"""`fsdpx.shard`: the entry that turns a model and a Config into an Engine.

It checks the arguments, starts the process group, builds the mesh, hands the model to
the parallelize recipe (fsdpx/parallelize.py: TP -> EP -> AC -> compile -> FSDP per part, then
materialisation), then builds the optimizer, scheduler, loss scaler and telemetry around
the sharded model and returns the Engine.

[Note: a module not named shard] The function is `fsdpx.shard`, resolved lazily by
fsdpx/__init__.py. A submodule `fsdpx/shard.py` would be bound as the package attribute
`fsdpx.shard` by Python's import system whenever anything imported it directly, shadowing
the function (`fsdpx.shard(model, cfg)` -> "'module' object is not callable"), so the
module has another name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdpx.blocks import find_blocks
from fsdpx.config import Config
from fsdpx.distributed import init_distributed, set_process_group_timeouts
from fsdpx.engine import Engine
from fsdpx.offload.build import build_offload
from fsdpx.offload.plan import check_offload
from fsdpx.optim import build_optimizer
from fsdpx.parallel_dims import ParallelDims
from fsdpx.parallelize import parallelize
from fsdpx.param_groups import name_groups, resolve_groups
from fsdpx.precision import build_loss_scaler
from fsdpx.schedulers import build_scheduler
from fsdpx.telemetry.start import start_telemetry
from fsdpx.zero import dims_for_stage

OptimizerArg = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None


def _exchanges_gradients(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` is one of the 1-bit optimizers, which `attach` to the model: they say so
    with a class attribute, so asking needs none of their modules (importing them would
    load them and the 1-bit all-reduce for every model, ~1 MiB of resident memory per rank;
    [Note: onebit on first use] in fsdpx/comm/__init__.py)."""
    return bool(getattr(type(opt), "exchanges_gradients", False))


def shard(
    model: nn.Module,
    cfg: Config | None = None,
    optimizer: OptimizerArg = None,
    lr_scheduler: Any = None,
    *,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    init_fn: Callable[[nn.Module], None] | None = None,
    param_groups: Any = None,
) -> Engine:
    """Shard `model` in place as `cfg` says and return the training engine.

    Args:
        model: the model, on CPU/CUDA or on the meta device (then materialised shard by
            shard and initialised with `init_fn`, else its `reset_parameters()`).
        cfg: the Config; defaults to Config() (ZeRO-3, fp32, AdamW).
        optimizer: None builds cfg.optimizer over the sharded parameters; a callable
            `params -> Optimizer` is called with them. An optimizer instance must already
            hold the sharded parameters, so it can only be made after sharding.
        lr_scheduler: None builds cfg.scheduler; else a callable `optimizer -> scheduler`,
            called with the engine's optimizer (a scheduler instance is rejected: it would
            wrap an optimizer the engine does not use).
        loss_fn: `loss_fn(outputs, targets)` used by engine.train_batch.
        init_fn: initialises a meta-built model after materialisation.
        param_groups: parameter groups as a torch optimizer takes them, over `model`'s
            parameters as passed (before sharding), e.g. `[{"params": decay}, {"params":
            norms, "weight_decay": 0.0}]`: the optimizer (built from cfg.optimizer, the
            offloaded one, or your callable) gets the sharded parameters in the same
            groups with the same options ([Note: parameters across sharding] in
            fsdpx/param_groups.py). None: one group of every parameter that requires grad.
    Returns:
        The Engine (engine.module is `model`, now sharded).

    Example::

        engine = fsdpx.shard(GPT(GPTConfig()), fsdpx.Config.from_file("zero2.json"))
    """
    cfg = cfg or Config()
    # Both checks come before anything is built: a failed call leaves `model` untouched.
    if isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            "an optimizer built before fsdpx.shard holds the unsharded parameters, which "
            "sharding replaces; pass optimizer=None (built from cfg.optimizer) or a callable "
            "such as `lambda params: torch.optim.AdamW(params, lr=1e-4)`"
        )
    if optimizer is not None and not callable(optimizer):
        raise ValueError(
            f"optimizer must be None (built from cfg.optimizer) or a callable "
            f"`params -> Optimizer`; got {optimizer!r}. To choose the optimizer by name, set "
            "cfg.optimizer.type"
        )
    if lr_scheduler is not None and (not callable(lr_scheduler) or hasattr(lr_scheduler, "step")):
        raise ValueError(
            f"lr_scheduler must be None (built from cfg.scheduler) or a callable "
            f"`optimizer -> scheduler`; got {type(lr_scheduler).__name__}. A scheduler made "
            "before fsdpx.shard wraps an optimizer the engine does not use: pass e.g. "
            "`lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=100)`"
        )
    offload = check_offload(cfg, optimizer)
    named_groups = name_groups(model, param_groups) if param_groups is not None else None
    info = init_distributed(cfg)
    dims = dims_for_stage(ParallelDims.from_config(cfg.mesh, info.world_size), cfg.zero)
    # Before the mesh (and its groups) exist: every rank raises the same error.
    hf_model = False
    if dims.sp > 1:  # [Note: MoE and sequence on first use] in fsdpx/parallelize.py
        from fsdpx.sequence.hf_model import is_hf_model
        from fsdpx.sequence.plan import check_sequence_config

        check_sequence_config(cfg, dims, loss_fn=loss_fn, model=model)
        hf_model = is_hf_model(model)

    mesh = dims.build_mesh(info.device.type)
    # Sub-mesh groups default to a 30-minute timeout; a dead peer must fail within ours.
    set_process_group_timeouts(
        cfg.timeout_s, mesh, ParallelDims.dp_mesh(mesh), ParallelDims.fsdp_mesh(mesh)
    )
    built = parallelize(
        model,
        find_blocks(model, cfg.zero.block_classes),
        cfg=cfg,
        dims=dims,
        mesh=mesh,
        device=info.device,
        loss_fn=loss_fn,
        init_fn=init_fn,
    )
    sharded = cast(FSDPModule, built.module)

    params = [p for p in cast(nn.Module, sharded).parameters() if p.requires_grad]
    groups: list[Any] = params
    if named_groups is not None:
        groups = resolve_groups(cast(nn.Module, sharded), named_groups, partial=dims.pp > 1)
    offloaded = build_offload(offload, groups, model, cfg.optimizer, info.rank)
    opt = offloaded.optimizer
    if opt is None:
        opt = optimizer(groups) if callable(optimizer) else build_optimizer(groups, cfg.optimizer)
    if _exchanges_gradients(opt):
        opt.attach(cast(nn.Module, sharded))  # type: ignore[attr-defined]
    try:
        sequence = None  # the plan for mesh.sp > 1
        if dims.sp > 1:
            from fsdpx.sequence.plan import build_sequence_plan

            sequence = build_sequence_plan(cfg, dims, mesh, hf_model=hf_model)
        sched = build_scheduler(opt, cfg.scheduler) if lr_scheduler is None else lr_scheduler(opt)
        return Engine(
            module=sharded,
            optimizer=opt,
            lr_scheduler=sched,
            cfg=cfg,
            dims=dims,
            mesh=mesh,
            loss_scaler=build_loss_scaler(cfg),
            device=info.device,
            loss_fn=loss_fn,
            pipeline=built.pipeline,
            telemetry=start_telemetry(cfg, info, model, opt),
            optimizer_step=offloaded.step,
            sequence=sequence,
        )
    except BaseException:
        # An offloaded optimizer holds a locked swap file and hooks: release them, or a
        # retry in this process finds the file "in use".
        close = getattr(opt, "close", None)
        if close is not None:
            close()
        raise
