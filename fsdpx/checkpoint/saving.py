"""Saving: collect state, write this rank's file, vote, commit (see [Note: atomic commit]
in fsdpx/checkpoint/commit.py), optionally in the background.

Two entry points: `save(...)`, a synchronous function for people with their own loop,
and `Checkpointer`, which the engine holds (asynchronous saves, retention, its own
process group so background collectives never interleave with training's).

[Note: pipeline checkpoints] Under pipeline parallelism each rank holds only its stages'
parameters (under the full model's names) and its optimizer covers only those. Saving
is then `partial`: DTensor pieces are written as always (one writer per replicated
piece of each stage's mesh), plain tensors (buffers, Adam's `step`) by one rank per stage
(`plain_writer`: coordinate 0 on every non-pp mesh axis; a buffer present on several
stages is written by each, and the format allows such overlapping, equal pieces), and
rank 0 merges every rank's optimizer description into the MANIFEST. Loading with
`partial=True` reads only the names this rank holds and checks, in the vote, that the
ranks together hold every model tensor of the checkpoint. The result is an ordinary
checkpoint: it loads without pipeline parallelism, at any world size.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from checkpoint_tools.format import CheckpointError, RankWriter, write_manifest
from checkpoint_tools.format.root import check_tag, read_latest, write_latest
from fsdpx.checkpoint import commit, node_local, shared_dir
from fsdpx.checkpoint.async_save import BackgroundWriter
from fsdpx.checkpoint.external import (
    ExternalState,
    external_state_owner,
    external_state_view,
)
from fsdpx.checkpoint.loading import LoadResult, load
from fsdpx.checkpoint.state import (
    Piece,
    collect_pieces,
    merge_optimizer_meta,
    rng_state,
    snapshot,
    to_plain,
)
from fsdpx.config import Config
from fsdpx.distributed import failure_guard
from fsdpx.ops.shuffle import checkpoint_kernels

STATE_VERSION = 1
log = logging.getLogger("fsdpx.checkpoint")


@dataclass(frozen=True)
class SaveOptions:
    """How a save writes (the engine fills these from Config.checkpoint)."""

    compression: Literal["zstd", "none"] = "zstd"
    level: int = 1
    keep_last: int = 0
    """Keep this many newest checkpoints under the root (0: all); never removes the one
    `latest` names or the one just written."""
    save_latest: bool = True
    """Point `<root>/latest` at the new checkpoint (DeepSpeed's save_latest)."""
    threads: int = 1
    """Threads that shuffle, compress and checksum chunks in parallel; the files are
    byte-identical for any count."""
    node_local: bool = False
    """Each node writes its ranks' files on its own storage and commits them there
    ([Note: node-local checkpoints] in node_local.py); False: one shared directory."""


@dataclass(frozen=True)
class Committed:
    """A committed save, as `Checkpointer.save`'s `on_commit` hears of it (on rank 0).

    [Note: checkpoint events] The engine turns it into the telemetry event
    `checkpoint_saved`. Only rank 0 hears of it: it writes the MANIFEST and commits, so it
    alone knows that the checkpoint exists and its size, and one event per save (not one
    per rank) is what a monitor should show. An asynchronous save is reported when its
    background commit finishes, from the writer thread.
    """

    path: Path
    tag: str
    bytes: int
    """Size on disk: the data and index files of every rank."""
    duration_s: float
    """From the save call to the commit (asynchronous: the background write included)."""
    background: bool
    """Whether it was written in the background (checkpoint.async_save)."""


@dataclass
class _Plan:
    """Everything one save writes, collected in the foreground."""

    root: Path
    tag: str
    pieces: list[Piece] = field(default_factory=list)
    state: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] = field(default_factory=dict)
    partial: bool = False
    """This rank holds part of the model ([Note: pipeline checkpoints])."""


def _plan(
    directory: str | Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    lr_scheduler: Any,
    loss_scaler: Any,
    engine_state: dict[str, int] | None,
    client_state: dict[str, Any] | None,
    layout: dict[str, Any] | None,
    tag: str | None,
    rank: int,
    plain_writer: bool | None = None,
    partial: bool = False,
    masters: dict[int, Any] | None = None,
    every_held: bool = False,
) -> _Plan:
    if tag is None:
        if engine_state is None or "global_steps" not in engine_state:
            raise ValueError(
                "tag=None names the checkpoint 'global_step<N>' from engine_state"
                "['global_steps'], which was not given; pass tag='...' or engine_state"
            )
        tag = f"global_step{engine_state['global_steps']}"
    check_tag(tag)
    if client_state is not None and not isinstance(client_state, dict):
        raise ValueError(f"client_state must be a dict; got {type(client_state).__name__}")
    pieces, optim_meta = collect_pieces(model, optimizer, rank, plain_writer, masters, every_held)
    state = {
        "version": STATE_VERSION,
        "tag": tag,
        "step": (engine_state or {}).get("global_steps"),
        "engine": to_plain(engine_state or {}, "engine_state"),
        "optimizer": optim_meta,
        "lr_scheduler": (
            None
            if lr_scheduler is None
            else to_plain(lr_scheduler.state_dict(), "lr_scheduler.state_dict()")
        ),
        "loss_scaler": (
            None if loss_scaler is None else to_plain(loss_scaler.state_dict(), "loss scaler")
        ),
        "client_state": to_plain(client_state or {}, "client_state"),
        "layout": to_plain(layout or {}, "layout"),
    }
    return _Plan(Path(directory), tag, pieces, state, rng_state(), partial)


def _plan_root(plan: _Plan | BaseException) -> Path:
    return plan.root if isinstance(plan, _Plan) else Path("?")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _write_rank_file(plan: _Plan, temp: Path, rank: int, options: SaveOptions) -> dict[str, Any]:
    temp.mkdir(parents=True, exist_ok=True)
    writer = RankWriter(
        temp,
        rank,
        compression=options.compression,
        level=options.level,
        threads=options.threads,
        kernels=checkpoint_kernels(),  # [Note: codec injection]
        # [Note: deferred pieces]: the encode window spans tensors, so the threads do not
        # drain at every tensor's end. Safe: nothing changes the pieces before close()
        # (a synchronous save blocks training; an async one writes its snapshot).
        defer=True,
    )
    try:
        for p in plan.pieces:
            # A few tensors at a time in host memory (only those with chunks in flight;
            # no copy for CPU tensors and snapshots).
            writer.add(p.name, p.tensor.cpu(), global_shape=p.global_shape, offsets=p.offsets)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _write_and_commit(
    plan: _Plan | BaseException,
    options: SaveOptions,
    group: dist.ProcessGroup | None,
    on_commit: Callable[[Path, int], None] | None = None,
) -> Path:
    """Steps 1-3 of [Note: atomic commit]; every rank calls it, with its plan or the error
    that kept it from making one (so peers vote instead of waiting). Rank 0 then calls
    `on_commit(path, bytes on disk)` ([Note: checkpoint events])."""
    if options.node_local:
        return node_local.write_and_commit(
            plan, options, group, on_commit, _write_rank_file, _housekeeping
        )
    rank, size = commit.world(group)
    error: BaseException | None = plan if isinstance(plan, BaseException) else None
    nonce = commit.new_nonce() if rank == 0 else None
    if nonce is not None and size > 1 and isinstance(plan, _Plan):
        try:  # before the nonce goes out ([Note: shared checkpoint directory])
            shared_dir.announce(commit.temp_dir(plan.root, plan.tag, nonce))
        except OSError as exc:
            error = exc
    nonce = commit.broadcast_obj(nonce, group)
    shared = True
    info: dict[str, Any] | None = None
    temp = final = None
    if isinstance(plan, _Plan):
        temp = commit.temp_dir(plan.root, plan.tag, nonce)
        final = plan.root / plan.tag
        if rank != 0:
            shared = shared_dir.sees(temp)
        if shared and error is None:
            try:
                info = _write_rank_file(plan, temp, rank, options)
            except Exception as exc:
                error = exc
    rng = plan.rng if isinstance(plan, _Plan) else {}
    # Partial (pipeline) saves: rank 0 needs every rank's optimizer description.
    optim = plan.state["optimizer"] if isinstance(plan, _Plan) and plan.partial else None
    # [Note: tensor table] Only rank 0 needs every rank's piece list (for the MANIFEST):
    # it goes by a gather after the vote, not in the vote every rank receives.
    pieces = info.pop("pieces") if info is not None else []
    vote = {
        "ok": error is None,
        "error": None if error is None else _describe(error),
        "shared": shared,
        "host": shared_dir.where(),
    }
    reports = commit.all_gather_obj({**vote, "info": info, "rng": rng, "optim": optim}, group)
    failed = [(r, rep["error"]) for r, rep in enumerate(reports) if not rep["ok"]]
    unshared = None if failed else shared_dir.unshared_message(_plan_root(plan), reports)
    if failed or unshared is not None:
        if rank == 0 and temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        if unshared is not None:
            raise CheckpointError(unshared)
        if error is not None:
            raise error
        r, what = failed[0]
        raise CheckpointError(
            f"rank {r} failed to save its part of the checkpoint ({what}); nothing was "
            f"committed and 'latest' is unchanged. The traceback is in rank {r}'s output."
        )
    assert isinstance(plan, _Plan) and temp is not None and final is not None
    every_pieces = commit.gather_obj(pieces, group)
    commit_error: BaseException | None = None
    if rank == 0:
        assert every_pieces is not None
        for rep, rank_pieces in zip(reports, every_pieces, strict=True):
            rep["info"]["pieces"] = rank_pieces
        try:
            state = {**plan.state, "rng": [rep["rng"] for rep in reports]}
            if plan.partial:
                state["optimizer"] = merge_optimizer_meta([rep["optim"] for rep in reports])
            write_manifest(
                temp, world_size=size, rank_files=[rep["info"] for rep in reports], state=state
            )
            commit.commit_dir(temp, final)
            if options.save_latest:
                write_latest(plan.root, plan.tag)
        except Exception as exc:
            commit_error = exc
            shutil.rmtree(temp, ignore_errors=True)
        else:
            _housekeeping(plan.root, plan.tag, options)
    outcome = commit.broadcast_obj(None if commit_error is None else _describe(commit_error), group)
    if commit_error is not None:
        raise commit_error
    if outcome is not None:
        raise CheckpointError(f"rank 0 failed to commit checkpoint {str(final)!r}: {outcome}")
    if on_commit is not None and rank == 0:
        on_commit(
            final, sum(rep["info"]["data_size"] + rep["info"]["index_size"] for rep in reports)
        )
    return final


def _housekeeping(root: Path, tag: str, options: SaveOptions) -> None:
    """Best effort after a commit: remove temp dirs of interrupted saves, apply keep_last."""
    try:
        commit.remove_stale_temps(root)
        protect = {tag}
        latest = read_latest(root)  # a damaged `latest` raises: then nothing is removed
        if latest:
            protect.add(latest)
        commit.apply_retention(root, options.keep_last, protect=protect)
    except (OSError, CheckpointError) as exc:
        warnings.warn(
            f"checkpoint {tag!r} is committed, but cleaning up {root} failed: {exc}",
            stacklevel=3,
        )


def save(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    tag: str | None = None,
    lr_scheduler: Any = None,
    loss_scaler: Any = None,
    engine_state: dict[str, int] | None = None,
    client_state: dict[str, Any] | None = None,
    options: SaveOptions | None = None,
    group: dist.ProcessGroup | None = None,
    plain_writer: bool | None = None,
    partial: bool = False,
) -> Path:
    """Save a (sharded or plain) model and its training state as `<directory>/<tag>`.

    Every rank of `group` calls it. Synchronous; for background saves use `Checkpointer`.

    Args:
        directory: the checkpoint root (holds one directory per tag and `latest`).
        model: an FSDP2/DTensor-sharded or plain module.
        optimizer: its optimizer (state saved as "optim/<param fqn>/<key>"), or None.
        tag: the checkpoint's directory name; None: "global_step<engine_state's
            global_steps>".
        lr_scheduler, loss_scaler: objects with state_dict()/load_state_dict() holding
            msgpack-able values, or None.
        engine_state: step counters ({"global_steps": ..., ...}), returned by load.
        client_state: your own msgpack-able values (epoch, data-loader position, ...);
            rank 0's is saved.
        options: compression, retention, whether to update `latest`.
        group: the process group to agree over (CPU tensors; None: the default group).
        plain_writer: whether this rank writes plain (non-DTensor) tensors; None: rank 0
            of `group`. Under pipeline parallelism: one rank per stage.
        partial: each rank holds only part of the model (pipeline stages); rank 0 then
            merges the ranks' optimizer descriptions ([Note: pipeline checkpoints]).
    Returns:
        The committed checkpoint's path, on every rank.

    Example::

        fsdpx.checkpoint.save("ckpts", model, opt, tag="step100", client_state={"epoch": 2})
    """
    rank, _ = commit.world(group)
    options = options or SaveOptions()
    with external_state_view(external_state_owner(model, optimizer)) as masters:
        try:
            plan: _Plan | BaseException = _plan(
                directory,
                model=model,
                optimizer=optimizer,
                lr_scheduler=lr_scheduler,
                loss_scaler=loss_scaler,
                engine_state=engine_state,
                client_state=client_state,
                layout=None,
                tag=tag,
                rank=rank,
                plain_writer=plain_writer,
                partial=partial,
                masters=masters,
                every_held=options.node_local,
            )
        except Exception as exc:
            plan = exc
        return _write_and_commit(plan, options, group)


def _save_synchronously(owner: object) -> bool:
    """Whether the optimizer's state must be saved synchronously even with async_save
    (NVMe offload: a snapshot would copy all of it into host memory and keep the buffers,
    which is what NVMe offload exists to avoid; [Note: external optimizer state])."""
    return isinstance(owner, ExternalState) and owner.save_synchronously()


class Checkpointer:
    """Saves and loads for one training job (held by the engine).

    Keeps at most one asynchronous save in flight; a new save, a load, `wait()` and
    `close()` (and interpreter exit) wait for it and raise its error if it failed.
    Asynchronous saves keep their host snapshot buffers (one copy of this rank's state)
    for the next save, until `close()`.
    Collectives run on a gloo group of its own, made on first use (every rank is inside
    save/load then), so a background save never interleaves with training's collectives.

    Example::

        ckpt = Checkpointer(SaveOptions(keep_last=3), async_save=True)
        ckpt.save("ckpts", model=model, optimizer=opt, tag="step100")
        ...  # training continues while the files are written
        ckpt.wait()
    """

    def __init__(
        self, options: SaveOptions, *, async_save: bool = False, timeout_s: float = 1800.0
    ) -> None:
        self.options = options
        self.async_save = async_save
        self.timeout_s = timeout_s
        self._writer = BackgroundWriter()
        self._pg: dist.ProcessGroup | None = None
        self._pg_made = False
        self._staging: dict[str, torch.Tensor] = {}

    @classmethod
    def from_config(cls, cfg: Config) -> Checkpointer:
        """The checkpointer for `cfg.checkpoint`, with `cfg.timeout_s` on its collectives."""
        c = cfg.checkpoint
        threads = c.threads or min(4, os.cpu_count() or 1)
        options = SaveOptions(
            c.compression, c.zstd_level, c.keep_last, threads=threads, node_local=c.node_local
        )
        return cls(options, async_save=c.async_save, timeout_s=cfg.timeout_s)

    def group(self) -> dist.ProcessGroup | None:
        """The checkpoint process group (None at world size 1 or without a default group)."""
        if not self._pg_made:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                self._pg = dist.new_group(
                    backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s)
                )
            self._pg_made = True
        return self._pg

    def save(
        self,
        directory: str | Path,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        loss_scaler: Any = None,
        engine_state: dict[str, int] | None = None,
        client_state: dict[str, Any] | None = None,
        layout: dict[str, Any] | None = None,
        tag: str | None = None,
        save_latest: bool = True,
        plain_writer: bool | None = None,
        partial: bool = False,
        on_commit: Callable[[Committed], None] | None = None,
    ) -> Path:
        """Like `save()`. With async_save, returns once the state is copied to host memory;
        the checkpoint appears at the returned path when the background write commits.
        `on_commit` is called on rank 0 once the checkpoint is committed (from the writer
        thread for a background save; [Note: checkpoint events]); an error it raises is
        logged, never raised: the checkpoint is committed by then."""
        self.wait()
        started = time.perf_counter()
        group = self.group()
        rank, _ = commit.world(group)
        options = dataclasses.replace(self.options, save_latest=save_latest)
        # An offloaded optimizer's state is readable only inside its view (NVMe: mapped
        # from the swap file), so the pieces are written or snapshotted before it closes.
        owner = external_state_owner(model, optimizer)
        write_now = not self.async_save or _save_synchronously(owner)

        def report_commit(path: Path, nbytes: int) -> None:
            if on_commit is None:
                return
            took = time.perf_counter() - started
            try:
                on_commit(Committed(path, path.name, nbytes, took, background=not write_now))
            except Exception:
                log.exception("checkpoint %s is committed, but reporting it failed", path)

        with external_state_view(owner) as masters:
            try:
                plan = _plan(
                    directory,
                    model=model,
                    optimizer=optimizer,
                    lr_scheduler=lr_scheduler,
                    loss_scaler=loss_scaler,
                    engine_state=engine_state,
                    client_state=client_state,
                    layout=layout,
                    tag=tag,
                    rank=rank,
                    plain_writer=plain_writer,
                    partial=partial,
                    masters=masters,
                    every_held=options.node_local,
                )
            except Exception as exc:
                # Vote in the foreground so every rank fails now, not at the next wait.
                return _write_and_commit(exc, options, group)
            if write_now:
                return _write_and_commit(plan, options, group, report_commit)
            plan.pieces = snapshot(plan.pieces, self._staging)

        def job() -> Path:
            with failure_guard():
                return _write_and_commit(plan, options, group, report_commit)

        self._writer.submit(job)
        return plan.root / plan.tag

    def load(self, directory: str | Path, **kwargs: Any) -> LoadResult:
        """fsdpx.checkpoint.load(directory, **kwargs) on this checkpointer's group, after
        waiting for the save in flight (which may be the very checkpoint asked for)."""
        self.wait()
        kwargs.setdefault("threads", self.options.threads)
        kwargs.setdefault("node_local", self.options.node_local)
        return load(directory, group=self.group(), **kwargs)

    def wait(self) -> Path | None:
        """Wait for the asynchronous save in flight; its path (None if none was in flight),
        or its error."""
        return self._writer.wait()

    def close(self) -> Path | None:
        """wait(), stop waiting at interpreter exit, and free the host staging buffers."""
        try:
            return self._writer.close()
        finally:
            self._staging.clear()
