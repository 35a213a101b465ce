"""Loading: every rank reads exactly its own rectangles (see [Note: pieces] in state.py),
so a checkpoint loads onto another world size, ZeRO stage or mesh.

Each rank works alone (no collective while reading), then all ranks vote once: if any
rank failed, every rank raises the same error (type and message of the lowest failing
rank), so no rank is left waiting in a collective while another has raised.

Under pipeline parallelism (`partial=True`) each rank reads only the tensors its stages
hold; the vote then checks that the ranks together hold every model tensor of the
checkpoint (see [Note: pipeline checkpoints] in saving.py).
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from checkpoint_tools.format import (
    MODEL_PREFIX,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointReader,
    optim_name,
    rank_optim_prefix,
)
from checkpoint_tools.format.root import committed, resolve
from fsdpx.checkpoint import commit
from fsdpx.checkpoint import node_local as node_local_save
from fsdpx.checkpoint.external import (
    ExternalState,
    external_state_owner,
    external_state_view,
)
from fsdpx.checkpoint.state import (
    model_tensors,
    param_names,
    rectangle,
    restore_param_groups,
    set_rng_state,
    with_masters,
)
from fsdpx.checkpoint.vote_errors import error_report, rebuild_error
from fsdpx.dtensor import to_local
from fsdpx.ops.shuffle import checkpoint_kernels

log = logging.getLogger("fsdpx")


@dataclass(frozen=True)
class LoadResult:
    """What load() restored."""

    path: Path
    """The checkpoint directory that was loaded."""
    client_state: dict[str, Any]
    """The client_state given to save (rank 0's)."""
    engine_state: dict[str, int] = field(default_factory=dict)
    """Step counters given to save ({} with load_module_only)."""
    bytes: int = 0
    """The checkpoint's size on disk: the data and index files of every rank (what the
    engine's `checkpoint_loaded` telemetry event reports, [Note: checkpoint events])."""


def older_that_verifies(path: Path) -> str:
    """A sentence naming the newest checkpoint committed before `path` that verifies."""
    ckpts = committed(path.parent)
    names = [d.name for d in ckpts]
    older = ckpts[: names.index(path.name)] if path.name in names else ckpts
    for d in reversed(older):
        try:
            CheckpointReader(d, kernels=checkpoint_kernels()).verify()
        except (CheckpointError, OSError):
            continue
        return f" The newest older checkpoint that verifies is {str(d)!r} (tag={d.name!r})."
    return f" No older checkpoint under {str(path.parent)!r} verifies."


class _Loader:
    """One rank's part of a load; `touched` says whether live state was overwritten."""

    def __init__(self, reader: CheckpointReader, path: Path, partial: bool = False) -> None:
        self.reader = reader
        self.path = path
        self.partial = partial
        self.touched = False
        self.held: list[str] = []
        """The model tensors (state-dict keys) this rank loaded."""
        self.saved_model: set[str] = set()
        """The checkpoint's model tensors (state-dict keys)."""

    def read_into(self, name: str, target: torch.Tensor) -> None:
        shape, offsets = rectangle(target)
        local = to_local(target).detach()
        if local.numel() == 0:
            return
        if (
            local.device.type == "cpu"
            and tuple(local.shape) == tuple(shape)
            and local.is_contiguous()
            and local.dtype == self.reader.info(name).dtype
        ):
            # [Note: decoding into the destination]: no copy; the chunks decode on the
            # reader's threads while later tensors are queued, load() waits for them all.
            self.touched = True  # written in place: a failure leaves it partly overwritten
            self.reader.read_into(name, local, offsets, wait=False)
            return
        data = self.reader.read(name, offsets, shape)
        self.touched = True
        with torch.no_grad():
            local.copy_(data)

    def check_shape(self, name: str, target: torch.Tensor) -> None:
        saved = tuple(self.reader.info(name).shape)
        if saved != tuple(target.shape):
            raise ValueError(
                f"tensor {name!r} has shape {saved} in {str(self.path)!r} but {tuple(target.shape)} "
                "here; load into the same model architecture"
            )

    def model(self, model: nn.Module, masters: dict[int, Any] | None = None) -> None:
        tensors = with_masters(model, model_tensors(model), masters or {})
        saved = {n[len(MODEL_PREFIX) :] for n in self.reader.names() if n.startswith(MODEL_PREFIX)}
        missing, unexpected = sorted(set(tensors) - saved), sorted(saved - set(tensors))
        self.held, self.saved_model = sorted(tensors), saved
        if self.partial:
            # Other ranks hold the rest (pipeline stages): checked in load()'s vote.
            unexpected = []
        if missing or unexpected:
            raise ValueError(
                f"the model does not match checkpoint {str(self.path)!r}: missing from the "
                f"checkpoint {missing[:5]}{'...' if len(missing) > 5 else ''}, not in the "
                f"model {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
            )
        for key, t in tensors.items():
            self.check_shape(MODEL_PREFIX + key, t)
        for key, t in tensors.items():
            self.read_into(MODEL_PREFIX + key, t)

    def optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        saved = self.reader.state.get("optimizer")
        if saved is None:
            raise ValueError(
                f"checkpoint {str(self.path)!r} holds no optimizer state; load it with "
                "load_optimizer_states=False (or load_module_only=True)"
            )
        names = param_names(model)
        current = [[names.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups]
        # State is matched by parameter name, so only group membership matters (the
        # order of a pipeline-merged group depends on the stage layout); a rank holding
        # part of the model (partial) holds part of each group.
        fits = len(current) == len(saved["param_groups"]) and all(
            set(c) <= set(g["params"]) if self.partial else set(c) == set(g["params"])
            for c, g in zip(current, saved["param_groups"], strict=False)
        )
        if not fits:
            raise ValueError(
                f"the optimizer's param groups ({[len(g) for g in current]} parameters) do "
                f"not match checkpoint {str(self.path)!r}'s "
                f"({[len(g['params']) for g in saved['param_groups']]}); build the "
                "optimizer with the same param groups, in the same order"
            )
        by_name = {names[id(p)]: p for g in optimizer.param_groups for p in g["params"]}
        fused = {
            names[id(p)]: bool(g.get("fused") or g.get("capturable"))
            for g in optimizer.param_groups
            for p in g["params"]
        }
        for fqn, p in by_name.items():
            keys = saved["tensor_keys"].get(fqn, [])
            for key in keys:
                cur = optimizer.state.get(p, {}).get(key)
                if isinstance(cur, torch.Tensor):
                    self.check_shape(optim_name(fqn, key), cur)
        for fqn, p in by_name.items():
            state: dict[str, Any] = {}
            for key in saved["tensor_keys"].get(fqn, []):
                cur = optimizer.state.get(p, {}).get(key)
                state[key] = self._optim_tensor(optim_name(fqn, key), p, cur, fused[fqn])
            state.update(saved["extra"].get(fqn, {}))
            self.touched = True
            if state:
                optimizer.state[p] = state
            else:
                optimizer.state.pop(p, None)
        restore_param_groups(optimizer, saved["param_groups"])

    def rank_local(self, optimizer: torch.optim.Optimizer, rank: int, size: int) -> None:
        """Hand the optimizer this rank's own state ([Note: per-rank optimizer state] in
        fsdpx/checkpoint/state.py); nothing when the world size changed."""
        load = getattr(optimizer, "load_rank_local_state", None)
        if not callable(load):
            return
        found: dict[str, torch.Tensor] = {}
        saved = self.reader.world_size
        if saved == size:
            prefix = rank_optim_prefix(rank)
            for name in self.reader.names():
                if name.startswith(prefix):
                    found[name[len(prefix) :]] = self.reader.read(name)
        elif rank == 0 and any(n.startswith(rank_optim_prefix(0)) for n in self.reader.names()):
            # [Note: per-rank optimizer state at another world size] in state.py
            log.warning(
                "checkpoint %r was saved by %d ranks, this job has %d: the per-rank error "
                "feedback of %s's 1-bit compression cannot be resharded (each rank's buffer "
                "holds what its own compression lost, in chunks laid out for %d ranks), so it "
                "restarts at zero, as DeepSpeed resets it on every load. Everything else "
                "(parameters, momentum, variance, schedule) is restored exactly; the next "
                "compressed exchanges go uncompensated for what was pending. Resume on %d "
                "ranks to continue exactly",
                str(self.path),
                saved,
                size,
                type(optimizer).__name__,
                saved,
                saved,
            )
        self.touched = True
        load(found)

    def _optim_tensor(
        self, name: str, p: torch.Tensor, cur: torch.Tensor | None, on_device: bool
    ) -> torch.Tensor:
        if cur is not None:
            self.read_into(name, cur)
            return cur
        shape = tuple(self.reader.info(name).shape)
        if shape == tuple(p.shape) and isinstance(p, DTensor):
            # A state like the parameter (exp_avg): the parameter's placements.
            local_shape, offsets = rectangle(p)
            if all(local_shape):
                local = self.reader.read(name, offsets, local_shape)
            else:  # this rank's shard is empty (fewer rows than ranks)
                local = torch.empty(local_shape, dtype=self.reader.info(name).dtype)
            local = local.to(p.to_local().device)
            return DTensor.from_local(
                local,
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        full = self.reader.read(name)
        # torch keeps a scalar `step` on the CPU unless the optimizer is fused/capturable.
        device = to_local(p).device if (full.dim() > 0 or on_device) else torch.device("cpu")
        return full.to(device)


def _apply(
    loader: _Loader,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any,
    loss_scaler: Any,
    *,
    load_optimizer_states: bool,
    load_lr_scheduler_states: bool,
    load_module_only: bool,
    rank: int,
    size: int,
    masters: dict[int, Any] | None = None,
) -> tuple[LoadResult, dict[str, Any] | None]:
    """This rank's whole load, without collectives; returns the result and the RNG state
    to restore once every rank succeeded."""
    path, state = loader.path, loader.reader.state
    loader.model(model, masters)
    client_state = dict(state.get("client_state") or {})
    if load_module_only:
        return LoadResult(path, client_state, {}), None
    if optimizer is not None and load_optimizer_states:
        loader.optimizer(model, optimizer)
        loader.rank_local(optimizer, rank, size)
    if lr_scheduler is not None and load_lr_scheduler_states:
        if state.get("lr_scheduler") is None:
            raise ValueError(
                f"checkpoint {str(path)!r} holds no lr scheduler state; load with "
                "load_lr_scheduler_states=False"
            )
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    if loss_scaler is not None and state.get("loss_scaler") is not None:
        loss_scaler.load_state_dict(state["loss_scaler"])
    saved_rng = state.get("rng") or []
    rng = None
    if loader.reader.world_size == size and rank < len(saved_rng):
        rng = saved_rng[rank]
    elif saved_rng and rank == 0:
        warnings.warn(
            f"random generator states not restored: {str(path)!r} was saved by "
            f"{loader.reader.world_size} ranks, this job has {size}",
            stacklevel=3,
        )
    return LoadResult(path, client_state, dict(state.get("engine") or {})), rng


def load(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    tag: str | None = None,
    lr_scheduler: Any = None,
    loss_scaler: Any = None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    group: dist.ProcessGroup | None = None,
    partial: bool = False,
    threads: int = 1,
    node_local: bool = False,
) -> LoadResult:
    """Load a checkpoint written by fsdpx.checkpoint.save (any world size or layout).

    Every rank of `group` calls it. Checksums of every chunk read are verified.

    Args:
        directory: the checkpoint root; tag: its directory name (None: what `latest` names).
        model: the (sharded or plain) module to load into, in place.
        optimizer, lr_scheduler, loss_scaler: restored when given (and asked for).
        load_module_only: only the model's tensors (no optimizer, scheduler, scaler,
            counters or RNG states).
        group: the process group to agree over (CPU tensors; None: the default group).
        partial: each rank holds part of the model (pipeline stages) and reads only that;
            the ranks together must hold every model tensor of the checkpoint.
        threads: threads per rank that read and decode chunks in parallel
            (`checkpoint.threads`; the engine passes it).
        node_local: each rank reads `directory` on its own node, which holds only its
            node's ranks' files (`checkpoint.node_local`; [Note: node-local checkpoints]
            in node_local.py); every rank must find the same save.
    Returns:
        LoadResult(path, client_state, engine_state).
    Raises:
        CheckpointNotFoundError: no `latest` (or no such tag); CheckpointFormatError: a
        bad `latest` (symlink, oversized, not a tag); DeepSpeedCheckpointError: a
        DeepSpeed checkpoint folder; CheckpointCorruptError: a checksum failed (names
        file, tensor and offset, and an older checkpoint that verifies); ValueError: a
        bad tag, or the model or optimizer does not match the checkpoint. The directory
        is resolved by checkpoint_tools.format.root.resolve (FORMAT.md §2.1). Every rank
        raises the same error.

    Example::

        result = fsdpx.checkpoint.load("ckpts", model, opt)
        epoch = result.client_state["epoch"]
    """
    rank, size = commit.world(group)
    loader: _Loader | None = None
    path: Path | None = None
    result: LoadResult | None = None
    rng: dict[str, Any] | None = None
    report: dict[str, Any] = {"ok": True}
    error: Exception | None = None
    reader: CheckpointReader | None = None
    try:
        path = resolve(directory, tag)
        reader = CheckpointReader(
            path,
            kernels=checkpoint_kernels(),
            threads=threads,
            present_only=node_local,
            prefer_rank=rank,
        )
    except Exception as exc:
        error = exc
    if node_local:
        node_local_save.agree_on_save(str(directory), path, reader, error, group)
    try:
        if error is not None:
            raise error
        assert reader is not None and path is not None
        # An offloaded optimizer takes the parameters into its fp32 masters (and NVMe
        # state straight into its swap file); after_load then updates the device copies.
        owner = external_state_owner(model, optimizer)
        with reader, external_state_view(owner) as masters:
            loader = _Loader(reader, path, partial)
            try:
                result, rng = _apply(
                    loader,
                    model,
                    optimizer,
                    lr_scheduler,
                    loss_scaler,
                    load_optimizer_states=load_optimizer_states,
                    load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only,
                    rank=rank,
                    size=size,
                    masters=masters,
                )
            except BaseException:
                # No in-place read may still write once the view closes (NVMe state may
                # be its swap file): close() waits for them, keeping this error.
                reader.close()
                raise
            reader.wait()  # every in-place read done (and checked) before anything uses it
        if isinstance(owner, ExternalState):
            owner.after_load()
        stored = sum(rf.data_size + rf.index_size for rf in reader.rank_files)
        result = dataclasses.replace(result, bytes=stored)
    except Exception as exc:
        error = exc
        message = str(exc)
        if isinstance(exc, CheckpointCorruptError) and path is not None:
            message += older_that_verifies(path)
        if loader is not None and loader.touched:
            message += (
                " The model/optimizer state is partly overwritten: load another checkpoint "
                "before training on."
            )
        report = error_report(exc, message)
    if partial and report["ok"] and loader is not None:
        report["held"] = loader.held
    reports = commit.all_gather_obj(report, group)
    failed = [(r, rep) for r, rep in enumerate(reports) if not rep["ok"]]
    if failed:
        r, rep = failed[0]
        if size > 1:
            rep = {**rep, "message": f"{rep['message']} (rank {r} of {size})"}
        raise rebuild_error(rep, r) from error
    assert result is not None and loader is not None
    if partial:
        # The same on every rank: each computes it from the same reports.
        absent = sorted(loader.saved_model - {k for rep in reports for k in rep["held"]})
        if absent:
            raise ValueError(
                f"the model does not match checkpoint {str(loader.path)!r}: no rank holds "
                f"{absent[:5]}{'...' if len(absent) > 5 else ''} (the pipeline stages "
                "together must hold every model tensor of the checkpoint); load into the "
                "same model architecture. The model/optimizer state is partly overwritten: "
                "load another checkpoint before training on."
            )
    if rng is not None:
        # Last, after every collective: nothing may draw from the restored generators.
        set_rng_state(rng)
    return result
