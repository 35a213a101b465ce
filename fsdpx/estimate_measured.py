"""Measured memory estimate: fsdpx's real sharding of the model, run for any world size in
this one process with a fake process group and fake tensors, tracked by torch's
FSDPMemTracker (torch.distributed._tools.fsdp2_mem_tracker).

Nothing is allocated and nothing is communicated: the fake process group answers every
collective at once, FakeTensorMode gives tensors shapes without storage, and the tracker
counts the bytes each category (sharded/unsharded parameters and gradients, optimizer
state, activations, temporaries, collective buffers) would hold on rank 0.

[Note: why not fsdpx.shard] fsdpx.shard builds its DeviceMesh itself, and DeviceMesh reads
its rank layout with `tolist()`, which fails on a fake tensor. So the mesh is built here
before fake mode starts, and the model is sharded by the recipe shard() calls
(fsdpx.parallelize.parallelize) with `materialize=False`: the meta tensors become fake ones
inside fake mode instead. The blocks run eagerly (cfg.compile is not applied).
tests/test_estimate.py checks that the model states measured here equal those of a real
fsdpx.shard run.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdpx.config import Config
from fsdpx.optimizers import OPTIMIZERS

ModelArg = nn.Module | Callable[[], nn.Module]


@dataclass(frozen=True)
class MeasuredMemory:
    """Bytes on rank 0 from one fake run (two optimizer steps)."""

    world_size: int
    params: int
    """Sharded parameters (the fp32 master)."""
    grads: int
    """Sharded gradients after the second backward (unsharded ones are counted too)."""
    optimizer: int
    """Optimizer state."""
    peak: int
    """Peak over both steps, every category together."""
    peak_by_category: dict[str, int]
    """FSDPMemTracker's categories at the peak (activations, unsharded params, ...)."""

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def activations(self) -> int:
        return self.peak_by_category.get("Activation", 0)


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` on the meta device without copying any tensor data: deepcopy is
    told, through its memo, that every parameter and buffer is its meta twin."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def measure_memory(
    model: ModelArg,
    cfg: Config | None = None,
    world_size: int = 1,
    sample_inputs: tuple[Any, ...] = (),
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> MeasuredMemory:
    """Run two training steps of `model` sharded as `cfg` says on fake rank 0 of
    `world_size`, and measure what it would hold.

    Args:
        model: the model (copied onto meta without its data; the original is untouched)
            or a function building it (called under torch.device("meta")).
        cfg: the config (stage, mesh, precision, activation checkpointing, optimizer).
        world_size: ranks to simulate; any size.
        sample_inputs: one micro-batch of this rank's forward arguments (real or meta
            tensors; only shapes and dtypes matter).
        loss_fn: turns the model output into a scalar; default: the output itself when it
            is a scalar, else its sum.
    Returns:
        MeasuredMemory. Needs a process without a default process group (it creates and
        destroys a fake one); tensor and pipeline parallelism are not simulated.

    Example::

        m = measure_memory(lambda: GPT(GPTConfig()), cfg, 64, (idx, targets))
        print(m.peak / 2**30, "GiB peak per rank")
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdpx.blocks import find_blocks
    from fsdpx.parallel_dims import ParallelDims
    from fsdpx.parallelize import parallelize
    from fsdpx.zero import dims_for_stage

    cfg = cfg or Config()
    if dist.is_initialized():
        raise ValueError(
            "measure_memory needs a process without a default process group (it simulates "
            "the ranks with a fake one); run it before init_distributed, or in a separate "
            "process such as `fsdpx estimate`"
        )
    dims = dims_for_stage(ParallelDims.from_config(cfg.mesh, world_size), cfg.zero)
    if dims.tp > 1 or dims.pp > 1:
        raise NotImplementedError(
            f"mesh.tp={dims.tp}, mesh.pp={dims.pp}: the measured estimate covers data "
            "parallelism only; use tp=1 and pp=1"
        )
    if isinstance(model, nn.Module):
        work = _meta_copy(model)
    else:
        with torch.device("meta"):
            work = model()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        mesh = dims.build_mesh("cpu")  # outside fake mode: see [Note: why not fsdpx.shard]
        root = parallelize(
            work,
            find_blocks(work, cfg.zero.block_classes),
            cfg=dataclasses.replace(cfg, compile=False),
            dims=dims,
            mesh=mesh,
            device=torch.device("cpu"),
            materialize=False,
        ).module
        # allow_non_fake_inputs: the meta parameters become fake CPU tensors in to_empty.
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            work.to_empty(device="cpu")
            params = [p for p in work.parameters() if p.requires_grad]
            # The registry's builder is torch's own optimizer: fsdpx's fused CPU Adam reads
            # step counters with .item(), which fake tensors cannot answer; its state has
            # torch's layout (0-dim fp32 `step`, `exp_avg`, `exp_avg_sq`), so the bytes
            # counted are the same.
            opt = OPTIMIZERS[cfg.optimizer.type].build(params, cfg.optimizer)
            inputs = tuple(
                mode.from_tensor(torch.empty_like(t, device="cpu"))
                if isinstance(t, torch.Tensor)
                else t
                for t in sample_inputs
            )
            tracker = FSDPMemTracker(root, opt)
            tracker.track_inputs(inputs)
            with tracker:
                for step in range(2):
                    out = work(*inputs)
                    loss = loss_fn(out) if loss_fn else out if out.ndim == 0 else out.sum()
                    loss.backward()
                    if step == 1:
                        states = _category_bytes(tracker.get_tracker_snapshot("current"))
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    # Per-module stats allow one iteration; the global peak is kept.
                    tracker.reset_mod_stats()
            peak = _category_bytes(tracker.get_tracker_snapshot("peak"))
    finally:
        dist.destroy_process_group()
    return MeasuredMemory(
        world_size=world_size,
        params=states.get("Sharded Param", 0),
        grads=states.get("Sharded Grad", 0) + states.get("Unsharded Grad", 0),
        optimizer=states.get("OptState", 0),
        peak=peak.get("Total", 0),
        peak_by_category=peak,
    )


def _category_bytes(snapshot: dict[torch.device, dict[Any, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = key if isinstance(key, str) else str(key.value)
            out[name] = out.get(name, 0) + value
    return out
