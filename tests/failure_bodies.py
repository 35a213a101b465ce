"""Rank bodies for tests/test_rank_failure.py: a short ZeRO-3 training run in which one rank
fails on purpose. Importable by spawned ranks."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import fsdpx
from fsdpx.demo.gpt import shard_batch
from fsdpx.distributed import failure_guard, first_failure, set_process_group_timeouts
from tests.parity import global_batches, make_model

FAIL_RANK = 1
FAIL_STEP = 2
STEPS = 6
HOW = ("raise", "exit", "sigkill", "linger")


def _fail(how: str, marks: Path) -> None:
    (marks / "failed_at").write_text(repr(time.time()))
    if how == "exit":
        os._exit(3)
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise ValueError(f"bad batch at step {FAIL_STEP} on rank {FAIL_RANK}")


def _arm(model: nn.Module, how: str, marks: Path) -> list[int]:
    """Hook the failure into the second block: in its forward, or (sigkill) in the backward
    through its output. Returns the step counter the training loop advances."""
    step = [0]
    block = model.get_submodule("blocks.1")

    def pre_forward(module: nn.Module, args: Any) -> None:
        if step[0] == FAIL_STEP and how != "sigkill":
            _fail(how, marks)

    def post_forward(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        if step[0] == FAIL_STEP and how == "sigkill" and out.requires_grad:
            out.register_hook(lambda grad: _fail(how, marks))

    block.register_forward_pre_hook(pre_forward)
    block.register_forward_hook(post_forward)
    return step


def train_and_fail(
    rank: int, world_size: int, how: str, marks: str, timeout_s: float, linger_s: float = 0.0
) -> list[float]:
    """Train with Config(timeout_s=timeout_s); rank FAIL_RANK fails at step FAIL_STEP.

    how: "raise" (the block's forward raises ValueError inside engine.forward), "exit"
    (os._exit(3) in the forward), "sigkill" (SIGKILL inside engine.backward), "linger"
    (ValueError as for "raise", then the process sleeps linger_s before it exits).
    The failing rank writes time.time() to <marks>/failed_at first.
    """
    assert how in HOW, how
    # [Note: short timeouts on a loaded machine] With timeout_s=5 every collective of the
    # healthy steps must also meet within 5 s: on a shared machine (CI, load ~30 on 2 cores)
    # one rank can reach shard()'s first collective, or a step's first all-gather, more than
    # 5 s after the other and the run times out before anyone fails (seen twice). A barrier
    # on a group of its own (a new group keeps torch's 30-minute default: shard() shortens
    # only the default group and the mesh's groups) lines the ranks up before shard() and
    # before each step; the short timeout then covers only a step's own work, which both
    # ranks do side by side.
    line_up = dist.new_group(backend="gloo")
    dist.barrier(group=line_up)
    cfg = fsdpx.Config.from_dict({"zero": {"stage": 3}, "timeout_s": timeout_s})
    engine = fsdpx.shard(make_model(), cfg)
    step = _arm(engine.module, how, Path(marks)) if rank == FAIL_RANK else [0]
    losses = []
    try:
        for i, micro in enumerate(global_batches(STEPS, 1)):
            step[0] = i
            dist.barrier(group=line_up)
            x, y = micro[0]
            loss = engine(shard_batch(x, rank, world_size), shard_batch(y, rank, world_size))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    except ValueError:
        if how == "linger":
            time.sleep(linger_s)  # alive, connections open: peers can only time out
        raise
    return losses


def own_error_body(rank: int, world_size: int) -> dict[str, Any]:
    """This rank's own errors pass through failure_guard unchanged and are recorded, the
    first one only; a local gloo misuse error is this rank's own error too."""
    out: dict[str, Any] = {}
    dist.barrier()
    if rank == FAIL_RANK:
        error = ValueError("bad input on rank 1")
        try:
            with failure_guard():
                raise error
        except ValueError as caught:
            out["same_object"] = caught is error
        try:
            with failure_guard():
                dist.broadcast(torch.zeros(2), src=world_size + 1)  # invalid root: local
        except RuntimeError as caught:
            out["local_gloo_type"] = type(caught).__name__
    dist.barrier()
    out["after_first"] = first_failure()
    if rank == 0:
        try:
            with failure_guard():
                raise TypeError("a later error on rank 0")
        except TypeError:
            pass
    dist.barrier()
    out["after_second"] = first_failure()
    # A group made by new_group gets torch's 30-minute default whatever the default
    # group's timeout; set_process_group_timeouts fixes that for a mesh's groups.
    group = dist.new_group(list(range(world_size)))
    mesh = torch.distributed.device_mesh.DeviceMesh.from_group(group, "cpu")
    out["new_group_timeout"] = _timeout_s(group)
    set_process_group_timeouts(4.0, mesh)
    out["timeouts_after"] = (_timeout_s(group), _timeout_s(dist.group.WORLD))
    return out


def _timeout_s(group: Any) -> float:
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def world_one_check() -> None:
    """Run in a fresh process without torchrun's environment: the one-rank HashStore group,
    reuse of an existing group, and this rank's own error recorded and re-raised unchanged."""
    from fsdpx.distributed import init_distributed

    info = init_distributed(fsdpx.Config(timeout_s=7))
    group = dist.group.WORLD
    assert (info.rank, info.world_size) == (0, 1), info
    assert _timeout_s(group) == 7.0, _timeout_s(group)
    init_distributed(fsdpx.Config(timeout_s=3))  # reuses the group, applies the timeout
    assert dist.group.WORLD is group and _timeout_s(group) == 3.0, _timeout_s(group)
    error = KeyError("missing key")
    try:
        with failure_guard():
            raise error
    except KeyError as caught:
        assert caught is error
    assert first_failure() == (0, "KeyError: 'missing key'"), first_failure()
    try:
        with failure_guard():
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")
    except fsdpx.RankFailureError as caught:
        assert caught.failed_rank is None
        assert "This rank failed earlier with KeyError: 'missing key'" in str(caught), caught
    dist.destroy_process_group()
    print("world-one ok")


def killed_peer_body(rank: int, world_size: int, marks: str) -> None:
    """Rank FAIL_RANK is SIGKILLed between two collectives (no model: fast); the other
    ranks' all_reduce then fails and each raises RankFailureError."""
    from fsdpx.distributed import init_distributed

    init_distributed(fsdpx.Config(timeout_s=60))  # reuses the group; announces this process
    dist.barrier()
    if rank == FAIL_RANK:
        _fail("sigkill", Path(marks))
    with failure_guard():
        dist.all_reduce(torch.ones(4))  # rank FAIL_RANK never joins: its sockets close


def killed_with_telemetry(rank: int, world_size: int, relay: str, marks: str) -> None:
    """train_and_fail's SIGKILL run with telemetry on. Rank FAIL_RANK dies only once its
    first records reached the relay (so the monitor knows it); the survivor hands its
    RankFailureError to sys.excepthook, as an uncaught error would (exception + exit)."""
    telemetry = {"enabled": True, "relay": relay, "start_relay": False, "poll_interval_s": 0.05}
    cfg = fsdpx.Config.from_dict({"zero": {"stage": 3}, "timeout_s": 60, "telemetry": telemetry})
    engine = fsdpx.shard(make_model(), cfg)
    pub = engine.telemetry
    assert pub is not None
    step = _arm(engine.module, "sigkill", Path(marks)) if rank == FAIL_RANK else [0]
    try:
        for i, micro in enumerate(global_batches(STEPS, 1)):
            step[0] = i
            if rank == FAIL_RANK and i == FAIL_STEP:
                _wait_for(lambda: pub.stats.records_sent >= FAIL_STEP)
            x, y = micro[0]
            loss = engine(shard_batch(x, rank, world_size), shard_batch(y, rank, world_size))
            engine.backward(loss)
            engine.step()
    except fsdpx.RankFailureError as exc:
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise


def _wait_for(ready: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert time.monotonic() < deadline, "state not reached"
        time.sleep(0.01)
