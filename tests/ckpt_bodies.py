"""Per-rank bodies of the checkpoint tests (module level, so spawned ranks import them).

Bodies return plain data (floats, CPU tensors); assertions live in the test modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdpx
from fsdpx.checkpoint.state import model_tensors, param_names
from fsdpx.demo.gpt import GPT, shard_batch
from fsdpx.parallel_dims import ParallelDims
from tests import tp_bodies
from tests.parity import TINY

# Dropout makes every forward draw from the RNG: resuming equal needs the RNG restored.
DROPOUT_GPT = dataclasses.replace(TINY, dropout=0.1)


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(DROPOUT_GPT)


class OddNet(nn.Module):
    """Sizes not divisible by 4 (13, 5, 3 rows: uneven and empty shards) and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.norm = nn.LayerNorm(13)
        self.mid = nn.Linear(13, 5)
        self.out = nn.Linear(5, 3)
        self.register_buffer("seen", torch.zeros(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return self.out(torch.relu(self.mid(self.norm(self.inp(x)))))


def odd_net(seed: int = 0) -> OddNet:
    torch.manual_seed(seed)
    return OddNet()


def full_state(engine: fsdpx.Engine) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint holds, gathered to full tensors (collective)."""

    def full(t: Any) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):  # a scalar state value (0/1 Adam's schedule)
            return torch.tensor(t)
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()

    out = {f"model/{k}": full(v) for k, v in model_tensors(engine.module).items()}
    names = param_names(engine.module)
    for group in engine.optimizer.param_groups:
        for p in group["params"]:
            for key, value in engine.optimizer.state.get(p, {}).items():
                out[f"optim/{names[id(p)]}/{key}"] = full(value)
    return out


def _rank_batch() -> tuple[torch.Tensor, torch.Tensor]:
    # Drawn from the global RNG on purpose: a resumed run must have it restored.
    x = torch.randint(0, DROPOUT_GPT.vocab_size, (2, DROPOUT_GPT.block_size))
    y = torch.randint(0, DROPOUT_GPT.vocab_size, (2, DROPOUT_GPT.block_size))
    return x, y


def _train(engine: fsdpx.Engine, optimizer_steps: int) -> list[float]:
    losses = []
    for _ in range(optimizer_steps * engine.gradient_accumulation_steps):
        loss = engine(*_rank_batch())
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _summary(engine: fsdpx.Engine) -> dict[str, Any]:
    return {
        "state": full_state(engine),
        "global_steps": engine.global_steps,
        "micro_steps": engine.micro_steps,
        "skipped_steps": engine.skipped_steps,
        "loss_scale": engine.loss_scale,
        "scaler": engine.loss_scaler.state_dict(),
        "lr": engine.get_lr(),
        "sched": None if engine.lr_scheduler is None else engine.lr_scheduler.state_dict(),
    }


def resume_first_body(
    rank: int, world_size: int, cases: dict[str, dict[str, Any]], root: str, steps: int, at: int
) -> dict[str, Any]:
    """Per case: an uninterrupted run of `steps` optimizer steps, and a run that saves at
    step `at` and goes on to `steps` (so the save must not disturb training)."""
    out = {}
    for name, cfg_dict in cases.items():
        cfg = fsdpx.Config.from_dict(cfg_dict)
        engine = fsdpx.shard(gpt(), cfg)
        torch.manual_seed(100 + rank)
        full_losses = _train(engine, steps)
        reference = _summary(engine)

        engine = fsdpx.shard(gpt(), cfg)
        torch.manual_seed(100 + rank)
        first = _train(engine, at)
        path = engine.save_checkpoint(Path(root) / name, client_state={"case": name, "at": at})
        rest = _train(engine, steps - at)  # async: runs while the background write does
        engine.wait_for_checkpoint()
        out[name] = {
            "full_losses": full_losses,
            "reference": reference,
            "saving_losses": first + rest,
            "saving_final": _summary(engine),
            "path": str(path),
        }
    return out


def resume_second_body(
    rank: int, world_size: int, cases: dict[str, dict[str, Any]], root: str, steps: int, at: int
) -> dict[str, Any]:
    """Per case, in fresh processes: another init and seed, load, train to `steps`."""
    out = {}
    for name, cfg_dict in cases.items():
        engine = fsdpx.shard(gpt(seed=7), fsdpx.Config.from_dict(cfg_dict))
        torch.manual_seed(12345)
        path, client_state = engine.load_checkpoint(Path(root) / name)
        loaded = _summary(engine)
        losses = _train(engine, steps - at)
        out[name] = {
            "path": str(path),
            "client_state": client_state,
            "loaded": loaded,
            "losses": losses,
            "final": _summary(engine),
        }
    return out


# --- resharding -------------------------------------------------------------------------


def _odd_train(engine: fsdpx.Engine, steps: int, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    rank, world = dist.get_rank(), dist.get_world_size()
    for _ in range(steps):
        x = torch.randn(8, 7, generator=g)
        per = 8 // world
        out = engine(x[rank * per : (rank + 1) * per])
        engine.backward(out.pow(2).mean())
        engine.step()


@contextlib.contextmanager
def index_files_read() -> Any:
    """Record the index files this process reads (the names, in order)."""
    import checkpoint_tools.format.reader as reader_mod

    real = reader_mod.read_whole
    seen: list[str] = []

    def spy(directory: Path, name: str, limit: int) -> bytes:
        if name.endswith(".index"):
            seen.append(name)
        return real(directory, name, limit)

    reader_mod.read_whole = spy  # type: ignore[assignment]
    try:
        yield seen
    finally:
        reader_mod.read_whole = real  # type: ignore[assignment]


def reshard_save_body(
    rank: int, world_size: int, cfg_dict: dict[str, Any], root: str, steps: int
) -> dict[str, Any]:
    engine = fsdpx.shard(odd_net(), fsdpx.Config.from_dict(cfg_dict))
    _odd_train(engine, steps)
    engine.save_checkpoint(root, client_state={"world": world_size})
    saved = _summary(engine)
    # Same world size, fresh engine without optimizer state: the states are created with
    # the parameters' placements, including the empty shards of 5- and 3-row tensors.
    fresh = fsdpx.shard(odd_net(seed=11), fsdpx.Config.from_dict(cfg_dict))
    with index_files_read() as indexes:  # [Note: tensor table]: its own index only
        fresh.load_checkpoint(root)
    # HSDP (2 replicas x 2 shards): each replicated piece must be written exactly once.
    hsdp = fsdpx.shard(odd_net(), fsdpx.Config.from_dict({**cfg_dict, "mesh": {"dp_replicate": 2}}))
    _odd_train(hsdp, steps)
    hsdp.save_checkpoint(Path(root) / "hsdp", tag="hsdp")
    return {**saved, "reloaded": _summary(fresh), "hsdp": _summary(hsdp), "indexes": indexes}


def reshard_load_body(
    rank: int, world_size: int, cases: dict[str, dict[str, Any]], root: str
) -> dict[str, Any]:
    """Load the same checkpoint under each config; then one more step (must not fail)."""
    out = {}
    for name, cfg_dict in cases.items():
        engine = fsdpx.shard(odd_net(seed=11), fsdpx.Config.from_dict(cfg_dict))
        _, client_state = engine.load_checkpoint(root)
        loaded = _summary(engine)
        _odd_train(engine, 1, seed=4)
        out[name] = {"loaded": loaded, "client_state": client_state, "after": _summary(engine)}
    return out


# --- crash consistency ------------------------------------------------------------------
# Each trial forks two fresh ranks from an orchestrator that has torch imported but has run
# no torch op (so forking is cheap and safe). Both ranks save global_step1, train, and
# start saving global_step2; one of them SIGKILLs itself at a random point of that save:
# at the k-th file-system operation of the save path ("op"), or after a random delay
# ("delay"). The orchestrator then checks what is on disk.

CRASH_CFG = {"zero": {"stage": 3}, "optimizer": {"lr": 1e-2}}
_FS_OPS = ("fsync", "rename", "replace", "mkdir", "rmdir", "unlink")


def _count_fs_ops(on_op: Any) -> None:
    """Route the os calls the save path makes through on_op() first (this process only:
    the rank was forked for this trial and exits when it ends)."""
    import os

    for name in _FS_OPS:
        real = getattr(os, name)

        def wrapped(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            on_op()
            return _real(*args, **kwargs)

        setattr(os, name, wrapped)
    from fsdpx.checkpoint import saving as save_mod

    real_add = save_mod.RankWriter.add

    def add(self: Any, *args: Any, **kwargs: Any) -> None:
        on_op()
        real_add(self, *args, **kwargs)

    save_mod.RankWriter.add = add  # type: ignore[method-assign]


def _crash_rank(rank: int, trial: dict[str, Any]) -> None:
    import datetime
    import os
    import random
    import signal
    import threading
    import time

    code = 0
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(trial["store"], 2)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30)
        )
        counter = {"n": 0, "kill_at": None}

        def on_op() -> None:
            counter["n"] += 1
            if counter["kill_at"] is not None and counter["n"] >= counter["kill_at"]:
                os.kill(os.getpid(), signal.SIGKILL)

        _count_fs_ops(on_op)
        engine = fsdpx.shard(gpt(), fsdpx.Config.from_dict(CRASH_CFG))
        torch.manual_seed(100 + rank)
        root = Path(trial["root"])
        expected = {}
        for step in (1, 2):
            _train(engine, 1)
            expected[f"global_step{step}"] = full_state(engine)
            if step == 1:
                root.mkdir(parents=True, exist_ok=True)  # both saves: the same os calls
                engine._checkpointer.group()  # made once, on first use: keep it out of t0
                t0, counter["n"] = time.monotonic(), 0
                engine.save_checkpoint(root)
                ops, seconds = counter["n"], time.monotonic() - t0
        if rank == 0:
            torch.save(expected, trial["expected"])
        dist.barrier()
        rng = random.Random(trial["seed"])
        if rank == trial["victim"]:
            if trial["mode"] in ("op", "commit"):
                first = max(ops - 10, 1) if trial["mode"] == "commit" else 1
                counter["n"], counter["kill_at"] = 0, rng.randint(first, max(ops, 1))
            else:
                delay = rng.uniform(0.0, 1.2 * seconds)
                threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        engine.save_checkpoint(root)
    except Exception:
        code = 1  # the survivor fails when its peer dies: expected
        if os.environ.get("FSDPX_TEST_DEBUG"):
            import traceback

            traceback.print_exc()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    os._exit(code)


def crash_trials(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Run every trial (two forked ranks each) and report what each left on disk."""
    import multiprocessing as mp
    import os

    ctx = mp.get_context("fork")
    for trial in trials:
        procs = [ctx.Process(target=_crash_rank, args=(r, trial)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(90)
            if p.is_alive():
                p.kill()
                p.join()
        trial["exitcodes"] = [p.exitcode for p in procs]
    # Only now run torch ops here (reading, comparing): no more forks follow.
    from checkpoint_tools.format import CheckpointReader
    from checkpoint_tools.format.root import committed, read_latest

    for trial in trials:
        root = Path(trial["root"])
        trial["latest"] = read_latest(root)
        trial["dirs"] = sorted(os.listdir(root))
        trial["problems"] = []
        expected = torch.load(trial["expected"]) if os.path.exists(trial["expected"]) else {}
        for d in committed(root):
            try:
                with CheckpointReader(d) as reader:
                    reader.verify(deep=True)
                    want = expected.get(d.name)
                    if want is None:
                        trial["problems"].append(f"{d.name}: no expected state")
                        continue
                    for name, value in want.items():
                        if not torch.equal(reader.read(name), value):
                            trial["problems"].append(f"{d.name}: {name} differs")
            except Exception as exc:
                trial["problems"].append(f"{d.name}: {type(exc).__name__}: {exc}")
    return trials


def load_latest_body(rank: int, world_size: int, trials: list[dict[str, Any]]) -> list[bool]:
    """Load each trial's `latest` into a fresh engine; True where it equals what was saved."""
    out = []
    for trial in trials:
        engine = fsdpx.shard(gpt(seed=5), fsdpx.Config.from_dict(CRASH_CFG))
        path, _ = engine.load_checkpoint(trial["root"])
        want = torch.load(trial["expected"])[Path(path).name]
        got = full_state(engine)
        out.append(got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want))
    return out


def crash_main(trials: list[dict[str, Any]], out: str) -> None:
    """Entry point of the spawned orchestrator process (see crash_trials)."""
    import os

    code = 0
    try:
        torch.save(crash_trials(trials), out)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


# --- one rank fails: every rank raises ----------------------------------------------------


def one_rank_fails_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Rank 1 alone fails while saving, then while loading; report what each rank raised
    and what is on disk."""
    from fsdpx.checkpoint import loading as load_mod
    from fsdpx.checkpoint import saving as save_mod

    engine = fsdpx.shard(odd_net(), fsdpx.Config.from_dict({"zero": {"stage": 3}}))
    _odd_train(engine, 1)
    engine.save_checkpoint(root, tag="good")
    out: dict[str, Any] = {}

    def broken_add(self: Any, *args: Any, **kwargs: Any) -> None:
        raise OSError("disk full (injected on rank 1)")

    real_add = save_mod.RankWriter.add
    if rank == 1:
        save_mod.RankWriter.add = broken_add
    try:
        engine.save_checkpoint(root, tag="bad")
    except Exception as exc:
        out["save"] = (type(exc).__name__, str(exc))
    finally:
        save_mod.RankWriter.add = real_add
    dist.barrier()
    out["dirs"] = sorted(p.name for p in Path(root).iterdir())

    real_read = load_mod.CheckpointReader.read
    real_read_into = load_mod.CheckpointReader.read_into

    def broken_read(self: Any, name: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise load_mod.CheckpointCorruptError(
            "chunk checksum mismatch (injected on rank 1)", path="x.data", tensor=name, offset=7
        )

    if rank == 1:  # read_into: CPU shards decode in place
        load_mod.CheckpointReader.read = broken_read
        load_mod.CheckpointReader.read_into = broken_read  # type: ignore[assignment]
    try:
        engine.load_checkpoint(root)
    except Exception as exc:
        out["load"] = (type(exc).__name__, str(exc), getattr(exc, "offset", None))
    finally:
        load_mod.CheckpointReader.read = real_read
        load_mod.CheckpointReader.read_into = real_read_into  # type: ignore[method-assign]

    return out


def unshared_dir_body(rank: int, world_size: int, base: str) -> dict[str, Any]:
    """Each rank saves to its own directory (a node-local disk mounted at one path on
    every machine, simulated): every rank gets the same clear error, nothing is written."""
    engine = fsdpx.shard(odd_net(), fsdpx.Config.from_dict({"zero": {"stage": 3}}))
    _odd_train(engine, 1)
    mine = Path(base) / f"node{rank}"
    out: dict[str, Any] = {}
    try:
        engine.save_checkpoint(mine, tag="step1")
    except Exception as exc:
        out["save"] = (type(exc).__name__, str(exc))
    dist.barrier()
    out["left"] = sorted(str(p.relative_to(base)) for p in Path(base).rglob("*"))
    return out


# --- dp x tp --------------------------------------------------------------------------------


def gpt_save_body(rank: int, world_size: int, cfg_dict: dict[str, Any], root: str) -> Any:
    """Train a dropout-free GPT two steps and save it; return its full state."""
    engine = fsdpx.shard(gpt_plain(), fsdpx.Config.from_dict(cfg_dict))
    torch.manual_seed(100 + rank)
    _train(engine, 2)
    engine.save_checkpoint(root)
    return _summary(engine)


def gpt_load_body(rank: int, world_size: int, cfg_dict: dict[str, Any], root: str) -> Any:
    engine = fsdpx.shard(gpt_plain(seed=9), fsdpx.Config.from_dict(cfg_dict))
    engine.load_checkpoint(root)
    placements = {n: str(p.placements) for n, p in engine.module.named_parameters()}
    return {**_summary(engine), "placements": placements}


def gpt_plain(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


# --- pipeline parallelism -------------------------------------------------------------------
# tests/test_ckpt_pp.py. The 4-block GPT of the pipeline tests, with dropout so that
# every rank's RNG state matters.

PP_GPT = dataclasses.replace(tp_bodies.MODEL, dropout=0.1)


def pp_gpt(seed: int = 0, **changes: Any) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(PP_GPT, **changes))


def _pp_train(engine: fsdpx.Engine, batches: list[list[tuple[torch.Tensor, ...]]]) -> list[float]:
    """One train_batch per step; each data-parallel rank takes its share of the batch."""
    dp_mesh = ParallelDims.dp_mesh(engine.mesh)
    dp_rank, dp = dp_mesh.get_local_rank(), dp_mesh.size()
    losses = []
    for micro in batches:
        data = [(shard_batch(x, dp_rank, dp), shard_batch(y, dp_rank, dp)) for x, y in micro]
        losses.append(float(engine.train_batch(iter(data))))
    return losses


def pp_resume_first_body(
    rank: int, world_size: int, cfg_dict: dict[str, Any], root: str, steps: int, at: int
) -> dict[str, Any]:
    """An uninterrupted pipelined run of `steps` steps, and one that saves at `at`."""
    cfg = fsdpx.Config.from_dict(cfg_dict)
    batches = tp_bodies.global_batches(steps, cfg.gradient_accumulation_steps)
    engine = fsdpx.shard(pp_gpt(), cfg, loss_fn=tp_bodies.lm_loss)
    torch.manual_seed(100 + rank)
    full_losses = _pp_train(engine, batches)
    reference = _summary(engine)
    engine = fsdpx.shard(pp_gpt(), cfg, loss_fn=tp_bodies.lm_loss)
    torch.manual_seed(100 + rank)
    first = _pp_train(engine, batches[:at])
    path = engine.save_checkpoint(root, client_state={"at": at})
    rest = _pp_train(engine, batches[at:])
    return {
        "full_losses": full_losses,
        "reference": reference,
        "saving_losses": first + rest,
        "path": str(path),
    }


def pp_resume_second_body(
    rank: int, world_size: int, cfg_dict: dict[str, Any], root: str, steps: int, at: int
) -> dict[str, Any]:
    """In fresh processes: another init and seed, load, train to `steps`."""
    cfg = fsdpx.Config.from_dict(cfg_dict)
    batches = tp_bodies.global_batches(steps, cfg.gradient_accumulation_steps)
    engine = fsdpx.shard(pp_gpt(seed=7), cfg, loss_fn=tp_bodies.lm_loss)
    torch.manual_seed(12345)
    path, client_state = engine.load_checkpoint(root)
    loaded_steps = engine.global_steps
    losses = _pp_train(engine, batches[at:])
    return {
        "path": str(path),
        "client_state": client_state,
        "loaded_steps": loaded_steps,
        "losses": losses,
        "final": _summary(engine),
    }


def pp_save_body(rank: int, world_size: int, cfg_dict: dict[str, Any], root: str) -> Any:
    """Train a pipelined GPT 2 steps and save it; then the load-mismatch error."""
    cfg = fsdpx.Config.from_dict(cfg_dict)
    engine = fsdpx.shard(pp_gpt(), cfg, loss_fn=tp_bodies.lm_loss)
    _pp_train(engine, tp_bodies.global_batches(2, cfg.gradient_accumulation_steps))
    engine.save_checkpoint(root)
    saved = _summary(engine)
    # Two blocks where the checkpoint has four: every rank holds names that exist in the
    # checkpoint, but no rank holds blocks 2 and 3.
    small = fsdpx.shard(pp_gpt(n_layer=2), cfg, loss_fn=tp_bodies.lm_loss)
    try:
        small.load_checkpoint(root)
    except ValueError as exc:
        saved["mismatch"] = str(exc)
    return saved


def plain_load_body(rank: int, world_size: int, cfg_dict: dict[str, Any], root: str) -> Any:
    """Load (any checkpoint) into a GPT of PP_GPT's shape without pipeline parallelism."""
    engine = fsdpx.shard(pp_gpt(seed=9), fsdpx.Config.from_dict(cfg_dict))
    engine.load_checkpoint(root)
    return _summary(engine)
