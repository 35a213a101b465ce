"""Per-rank bodies of tests/test_offload.py (module level, so spawned ranks import them).

Every run trains the same model from the same seed on the same global batches; what a
run leaves behind is compared in the test process, through its checkpoint (read with
checkpoint_tools, so the comparison does not depend on the optimizer class) and through
the gathered parameters of engine.module.
"""

from __future__ import annotations

import gc
import os
import signal
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import fsdpx
import fsdpx.optim
from fsdpx.demo.gpt import GPT, GPTConfig, shard_batch
from tests.parity import TINY, global_batches

# Wider than tests/parity.py's TINY (same vocabulary and sequence length, so its batches
# fit): ~107k parameters, ~54k per rank at 2 ranks, so with buffer_mb=1 the NVMe store
# streams each rank's shard in more than one chunk.
MODEL = GPTConfig(
    vocab_size=TINY.vocab_size,
    block_size=TINY.block_size,
    n_layer=2,
    n_head=2,
    n_embd=64,
    bias=False,
)
STEPS = 5
LR = 1e-2
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.1

MODES = ("same", "torch", "cpu", "nvme")
"""same: no offload, optimizer=fsdpx.optim.AdamW (the offload step's implementation);
torch: no offload, torch.optim.AdamW from the config; cpu / nvme: offload_optimizer."""


def make_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(MODEL)


def same_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The non-offloaded reference optimizer: the implementation the offloaded step uses."""
    return fsdpx.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)


def config(
    stage: int,
    *,
    gas: int = 1,
    clip: float = 0.0,
    optimizer: str = "none",
    param: str = "none",
    nvme_path: str | None = None,
    buffer_mb: int = 1,
    pin_memory: bool | None = False,
    **extra: Any,
) -> dict[str, Any]:
    """A config dict: ZeRO `stage`, AdamW(LR, weight decay 0.1), optimizer offload to
    `optimizer` ("none" / "cpu" / "nvme"), parameter offload to `param` with
    `pin_memory` (None: left to the default)."""
    zero: dict[str, Any] = {"stage": stage}
    if optimizer != "none":
        off: dict[str, Any] = {"device": optimizer}
        if optimizer == "nvme":
            off.update(nvme_path=nvme_path, buffer_mb=buffer_mb)
        zero["offload_optimizer"] = off
    if param != "none":
        zero["offload_param"] = {"device": param}
        if pin_memory is not None:
            zero["offload_param"]["pin_memory"] = pin_memory
    return {
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "zero": zero,
        "optimizer": {"type": "adamw", "lr": LR, "weight_decay": WEIGHT_DECAY},
        **extra,
    }


def as_config(cfg: dict[str, Any] | fsdpx.Config) -> fsdpx.Config:
    """A config dict (Config.from_dict) or a Config built otherwise (e.g. from_deepspeed)."""
    return cfg if isinstance(cfg, fsdpx.Config) else fsdpx.Config.from_dict(cfg)


def build(
    cfg_dict: dict[str, Any] | fsdpx.Config, *, same: bool = False, seed: int = 0
) -> fsdpx.Engine:
    opt = same_adamw if same else None
    return fsdpx.shard(make_model(seed), as_config(cfg_dict), optimizer=opt)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def gathered(engine: fsdpx.Engine) -> dict[str, torch.Tensor]:
    """engine.module's parameters as full fp32 tensors (collective)."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu().clone()
        for n, p in engine.module.named_parameters()
    }


def train(engine: fsdpx.Engine, first: int, last: int) -> dict[str, list[Any]]:
    """Optimizer steps [first, last) of the fixed global batch sequence; per step the
    global mean loss, whether it was skipped, the loss scale in force and the gradient
    norm (None unless clipping)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps
    out: dict[str, list[Any]] = {"losses": [], "skipped": [], "scales": [], "norms": []}
    for micro in global_batches(last, gas)[first:last]:
        total = 0.0
        for x, y in micro:
            loss = engine(shard_batch(x, rank, world), shard_batch(y, rank, world))
            engine.backward(loss)
            result = engine.step()
            total += float(engine.all_reduce_mean(loss.detach().float()))
        assert result is not None
        out["losses"].append(total / gas)
        out["skipped"].append(result.skipped)
        out["scales"].append(result.loss_scale)
        out["norms"].append(result.grad_norm)
    return out


def save(engine: fsdpx.Engine, root: Path, tag: str) -> str:
    path = engine.save_checkpoint(root, tag=tag)
    engine.wait_for_checkpoint()
    return str(path)


def swap_files(nvme_path: str | Path) -> list[str]:
    return sorted(p.name for p in Path(nvme_path).glob("*.swap"))


def finish(engine: fsdpx.Engine) -> None:
    """Release an engine's swap files and hooks (engine.close, the contract's clean exit)."""
    engine.close()


# --- 1. parity: stages x offload modes; 4. parameter offload -----------------------------


def run_case(
    cfg_dict: dict[str, Any] | fsdpx.Config, root: Path, tag: str, *, same: bool = False
) -> dict[str, Any]:
    engine = build(cfg_dict, same=same)
    record: dict[str, Any] = train(engine, 0, STEPS)
    record["params"] = gathered(engine)
    record["dtypes"] = {n: local(p).dtype for n, p in engine.module.named_parameters()}
    record["optimizer"] = type(engine.optimizer).__name__
    record["ckpt"] = save(engine, root, tag)
    off = as_config(cfg_dict).zero.offload_optimizer
    nvme = off.nvme_path if off.device == "nvme" else None
    record["swap_while_open"] = swap_files(nvme) if nvme else []
    record["host_buffer_bytes"] = getattr(engine.optimizer, "host_buffer_bytes", None)
    dist.barrier()  # every rank has listed the files before any rank removes its own
    finish(engine)
    dist.barrier()
    record["swap_after_close"] = swap_files(nvme) if nvme else []
    return record


def parity_body(
    rank: int, world_size: int, cases: dict[str, dict[str, Any]], root: str
) -> dict[str, Any]:
    """cases: name -> {"cfg": config dict, "same": bool}; each trains STEPS steps from the
    same seed and saves the checkpoint <root>/<name>. A case that raises records
    {"error": traceback} so the others still run (every rank fails alike: an offload
    error is raised in the step on all of them)."""
    out: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            out[name] = run_case(case["cfg"], Path(root), name, same=case.get("same", False))
        except Exception:
            out[name] = {"error": traceback.format_exc()}
            gc.collect()  # a failed engine's swap files are released by its finalizer
    return out


# --- 3. checkpoint interop: save with one offload mode, load with another ----------------


def interop_body(rank: int, world_size: int, root: str, at: int) -> dict[str, Any]:
    """Save at step `at` with nvme and with cpu offload, then load each into engines of
    other modes (built from another seed) and train to STEPS; every run saves its end."""
    base = Path(root)
    out: dict[str, Any] = {}
    (base / "swap-save").mkdir(exist_ok=True)
    nvme_cfg = config(3, optimizer="nvme", nvme_path=str(base / "swap-save"))
    engine = build(nvme_cfg)
    train(engine, 0, at)
    out["saved_params"] = gathered(engine)
    out["nvme_at"] = save(engine, base / "ckpt", "nvme_at")
    train(engine, at, STEPS)  # the uninterrupted run
    out["nvme_end"] = save(engine, base / "ckpt", "nvme_end")
    finish(engine)
    engine = build(config(3, optimizer="cpu"))
    train(engine, 0, at)
    out["cpu_at"] = save(engine, base / "ckpt", "cpu_at")
    finish(engine)
    loads = {
        "nvme_to_same": ("nvme_at", config(3), True),
        "nvme_to_cpu": ("nvme_at", config(3, optimizer="cpu"), False),
        "nvme_to_nvme": ("nvme_at", nvme_cfg, False),
        "cpu_to_nvme": ("cpu_at", nvme_cfg, False),
    }
    for name, (src, cfg_dict, same) in loads.items():
        engine = build(cfg_dict, same=same, seed=7)
        engine.load_checkpoint(base / "ckpt", tag=src)
        out[f"{name}_steps"] = engine.global_steps
        train(engine, at, STEPS)
        out[name] = save(engine, base / "ckpt", name)
        finish(engine)
    return out


# --- 5. errors ---------------------------------------------------------------------------


def errors_body(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case builds an engine and must fail; returns name -> (type name, message)."""
    out: dict[str, Any] = {}
    for name, case in cases.items():
        opt = None
        if case.get("optimizer") == "user":
            opt = same_adamw
        try:
            engine = fsdpx.shard(make_model(), fsdpx.Config.from_dict(case["cfg"]), optimizer=opt)
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc))
        else:
            finish(engine)
            out[name] = ("no error", "")
    return out


# --- 6. faults: disk full, kill -9 ----------------------------------------------------------


def disk_full_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Train 2 steps with nvme offload and checkpoint; then cap this process's file size
    below the swap file's (RLIMIT_FSIZE, SIGXFSZ ignored: writes past the cap fail with
    EFBIG instead of killing the process), so the next step's write-back fails; report the
    error; lift the cap and load the checkpoint into fresh engines (nvme and none)."""
    import resource

    base = Path(root)
    swap_dir = base / "swap"
    engine = build(config(3, optimizer="nvme", nvme_path=str(swap_dir)))
    train(engine, 0, 2)
    want = gathered(engine)
    save(engine, base / "ckpt", "good")
    (swap,) = [p for p in swap_dir.glob("*.swap") if p.name.endswith(f"rank{rank}.swap")]
    size = swap.stat().st_size
    out: dict[str, Any] = {"swap_size": size}
    # The second half of the swap file is past the cap: the step cannot write its chunks
    # back there. Nothing else this process writes during the step comes near the cap.
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2 // 4096 * 4096, old[1]))
    try:
        train(engine, 2, 3)
        out["error"] = ("no error", "")
    except Exception as exc:
        out["error"] = (type(exc).__name__, str(exc))
        out["cause"] = repr(exc.__cause__) if exc.__cause__ is not None else None
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, previous)
    finish(engine)
    dist.barrier()
    for name, cfg_dict, same in (
        ("nvme", config(3, optimizer="nvme", nvme_path=str(swap_dir)), False),
        ("same", config(3), True),
    ):
        fresh = build(cfg_dict, same=same, seed=7)
        fresh.load_checkpoint(base / "ckpt", tag="good")
        got = gathered(fresh)
        out[f"loaded_{name}"] = all(torch.equal(got[k], want[k]) for k in want)
        out[f"trained_{name}"] = train(fresh, 2, 3)["losses"]
        finish(fresh)
    return out


KILL_RANK = 1
_KEEP_ALIVE: list[Any] = []
KILL_AT = 3  # optimizer step (0-based) during which KILL_RANK is SIGKILLed
SAVED_AT = 2  # the checkpoint before it: after steps 0 and 1


def kill_body(rank: int, world_size: int, root: str) -> None:
    """Train with nvme offload, checkpoint after SAVED_AT steps; at step KILL_AT rank
    KILL_RANK SIGKILLs itself inside the NVMe store's streaming update, after the first
    chunk has been updated (so the swap file is half written). The survivor fails."""
    from fsdpx.offload import nvme

    base = Path(root)
    engine = build(config(3, optimizer="nvme", nvme_path=str(base / "swap")))
    # The survivor leaves its swap file like a crashed process: were the engine collected
    # as the failure unwinds, the store's finalizer would remove it before the harness's
    # os._exit, and the restart would not meet an old file on that rank.
    _KEEP_ALIVE.append(engine)
    train(engine, 0, SAVED_AT)
    save(engine, base / "ckpt", "saved")
    train(engine, SAVED_AT, KILL_AT)
    if rank == KILL_RANK:
        real_stream = nvme.NvmeStore.stream

        def stream(self: Any, chunks: Any, update: Any, *args: Any, **kwargs: Any) -> None:
            calls = [0]

            def killing_update(c: int, n: int, bufs: Any) -> Any:
                if calls[0] == 1:
                    (base / "killed").write_text(f"chunk {c}\n")
                    os.kill(os.getpid(), signal.SIGKILL)
                calls[0] += 1
                return update(c, n, bufs)

            real_stream(self, chunks, killing_update, *args, **kwargs)

        nvme.NvmeStore.stream = stream  # type: ignore[method-assign]
    train(engine, KILL_AT, STEPS)
    raise AssertionError("training went on past the kill")


def restart_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """After kill_body: restart with the same nvme_path (the killed run's swap files are
    still there), load the checkpoint, train to STEPS; then an uninterrupted run."""
    base = Path(root)
    out: dict[str, Any] = {"leftover": swap_files(base / "swap")}
    dist.barrier()  # both ranks look before either engine touches the files
    engine = build(config(3, optimizer="nvme", nvme_path=str(base / "swap")), seed=7)
    path, _ = engine.load_checkpoint(base / "ckpt")
    out["loaded"] = Path(path).name
    out["resumed"] = train(engine, SAVED_AT, STEPS)["losses"]
    out["resumed_ckpt"] = save(engine, base / "ckpt", "resumed")
    finish(engine)
    engine = build(config(3, optimizer="nvme", nvme_path=str(base / "swap-ref")))
    out["uninterrupted"] = train(engine, 0, STEPS)["losses"]
    out["uninterrupted_ckpt"] = save(engine, base / "ckpt", "uninterrupted")
    finish(engine)
    return out


# --- 7. NVMe host-memory bound ------------------------------------------------------------


class Wide(nn.Module):
    """4 x Linear(1024, 1024): ~4.2M parameters, 50 MB of fp32 master + Adam state."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def rss_bytes() -> int:
    return _status_bytes("VmRSS")


def _load_native_code() -> None:
    """Map the native ops (adam_step, aio) and start an I/O pool once, so that their code
    pages are in every run's baseline and do not count as the swapper's memory."""
    import tempfile

    from fsdpx.ops.aio import AioPool, aligned_empty

    p = torch.zeros(1024, requires_grad=True)
    p.grad = torch.ones(1024)
    fsdpx.optim.AdamW([p]).step()
    buf = aligned_empty((1 << 20,))
    with tempfile.TemporaryDirectory() as d, AioPool(threads=4, chunk_bytes=1 << 20) as pool:
        pool.write(str(Path(d) / "probe"), buf)
        pool.wait_all()
        pool.read(str(Path(d) / "probe"), buf)
        pool.wait_all()


def rss_body(rank: int, world_size: int, cfg_dict: dict[str, Any], steps: int) -> dict[str, Any]:
    """World size 1: train Wide under `cfg_dict`; VmRSS before and after sharding, after 2
    warm-up steps, after `steps` more, and the peak during those."""
    _load_native_code()
    torch.manual_seed(0)
    model = Wide()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 1024, generator=g)
    rss: dict[str, int] = {"before_shard": rss_bytes()}
    engine = fsdpx.shard(model, fsdpx.Config.from_dict(cfg_dict))
    rss["after_shard"] = rss_bytes()

    def step() -> None:
        engine.backward(engine(x).pow(2).mean())
        engine.step()

    for _ in range(2):
        step()
    rss["after_warmup"] = rss_bytes()
    # Reset the high-water mark to the current RSS (Linux clear_refs "5"), so VmHWM after
    # the steps is the peak inside them, streaming buffers included.
    Path("/proc/self/clear_refs").write_text("5")
    for _ in range(steps):
        step()
    rss["after_steps"] = rss_bytes()
    rss["peak_steps"] = _status_bytes("VmHWM")
    numel = sum(p.numel() for p in engine.module.parameters())
    out = {
        "rss": rss,
        "numel": numel,
        "host_buffer_bytes": getattr(engine.optimizer, "host_buffer_bytes", None),
    }
    finish(engine)
    return out


def outside_state_body(rank: int, world_size: int, nvme_path: str) -> dict[str, Any]:
    """NVMe offload, then moments put into optimizer.state from outside: the step's error."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    cfg = fsdpx.Config.from_dict(
        {"zero": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}}}
    )
    engine = fsdpx.shard(model, cfg)
    try:
        engine.backward(engine(torch.randn(4, 8)).sum())
        engine.step()
        p = next(iter(engine.module.parameters()))
        engine.optimizer.state[p]["exp_avg"] = torch.zeros(p.shape)
        engine.backward(engine(torch.randn(4, 8)).sum())
        try:
            engine.step()
        except RuntimeError as exc:
            return {"error": str(exc)}
        return {"error": None}
    finally:
        engine.close()


def placement_body(
    rank: int, world_size: int, offload: str, dtype: str, nvme_path: str
) -> dict[str, Any]:
    """fsdpx.estimate_memory's placement next to what an offloaded engine really holds."""
    from fsdpx.estimate import estimate_memory
    from tests import ds_bodies

    off = {"device": offload, "nvme_path": nvme_path, "buffer_mb": 1}
    cfg = fsdpx.Config.from_dict(
        {"zero": {"stage": 3, "offload_optimizer": off}, "precision": {"param_dtype": dtype}}
    )
    with torch.device("meta"):
        meta = GPT(ds_bodies.EST_MODEL)
    est = estimate_memory(meta, cfg, world_size)
    torch.manual_seed(0)
    engine = fsdpx.shard(GPT(ds_bodies.EST_MODEL), cfg)
    try:
        x = torch.randint(0, ds_bodies.EST_MODEL.vocab_size, (2, 8))
        engine.backward(engine(x, x))
        params = list(engine.module.parameters())
        opt = engine.optimizer
        held = opt.host_tensors()
        return {
            "est_device": est.device_model_states,
            "est_host": est.host_bytes,
            "est_nvme": est.nvme_bytes,
            "device": sum(local(p).nbytes + local(p.grad).nbytes for p in params),
            "steps": 4 * len(params),
            "host_tensors": sum(t.nbytes for t in held),
            "host_buffers": opt.host_buffer_bytes,
            "total_numel": opt.total_numel,
            "file_bytes": opt.swap_file_bytes,
        }
    finally:
        engine.close()


class ReusedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class ReusingModel(nn.Module):
    """One block called twice in a forward (a shared layer): FSDP reduces its gradient
    once per call, so a copy after the first reduction would be partial."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = ReusedBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(self.block(h) + self.block(2 * h)).pow(2).mean()


def reused_block_body(rank: int, world_size: int, stage: int) -> dict[str, dict[str, Any]]:
    """A reused block, gradient accumulation 2: params after 3 steps, offload cpu vs the
    same optimizer without offload."""
    out: dict[str, dict[str, Any]] = {}
    for mode in ("same", "cpu"):
        torch.manual_seed(0)
        zero: dict[str, Any] = {"stage": stage, "block_classes": ["ReusedBlock"]}
        if mode == "cpu":
            zero["offload_optimizer"] = {"device": "cpu"}
        cfg = fsdpx.Config.from_dict(
            {
                "zero": zero,
                "gradient_accumulation_steps": 2,
                "optimizer": {"type": "adamw", "lr": LR, "weight_decay": 0.1},
            }
        )
        opt = (
            (lambda ps: fsdpx.optim.AdamW(ps, lr=LR, weight_decay=0.1)) if mode == "same" else None
        )
        engine = fsdpx.shard(ReusingModel(), cfg, optimizer=opt)
        g = torch.Generator().manual_seed(1)
        for _ in range(3 * 2):
            x = torch.randn(4 * world_size, 8, generator=g)[rank * 4 : (rank + 1) * 4]
            engine.backward(engine(x))
            engine.step()
        out[mode] = gathered(engine)
        engine.close()
    return out


def model_only_body(rank: int, world_size: int, root: str, mode: str) -> dict[str, Any]:
    """fsdpx.checkpoint.save / load given only the model (no optimizer): with offload they
    must still go through the fp32 masters. Returns params after loading and one more step,
    for `mode` and for the same optimizer without offload."""
    from fsdpx.checkpoint import load as load_ckpt
    from fsdpx.checkpoint import save as save_ckpt

    nvme = str(Path(root) / "nvme")
    Path(nvme).mkdir(exist_ok=True)
    cfg = config(3, optimizer=mode, nvme_path=nvme, precision={"param_dtype": "bf16"})
    first = build(cfg)
    train(first, 0, 2)
    save_ckpt(Path(root) / "ckpt", first.module, tag="t")
    masters = {n: t.clone() for n, t in gathered(first).items()}
    finish(first)
    out: dict[str, Any] = {}
    for name, same in (("offload", False), ("same", True)):
        engine = build(
            config(3, **({} if same else {"optimizer": mode, "nvme_path": nvme})), same=same
        )
        load_ckpt(Path(root) / "ckpt", engine.module, tag="t")
        train(engine, 2, 3)
        out[name] = gathered(engine)
        finish(engine)
    out["saved_bf16"] = masters
    return out


def failed_shard_body(rank: int, world_size: int, nvme_path: str) -> dict[str, Any]:
    """fsdpx.shard failing after the NVMe optimizer exists (a scheduler factory raising),
    then a retry on the same path in the same process."""
    cfg = fsdpx.Config.from_dict(config(3, optimizer="nvme", nvme_path=nvme_path))

    def bad_scheduler(opt: torch.optim.Optimizer) -> Any:
        raise RuntimeError("scheduler factory failed")

    try:
        fsdpx.shard(make_model(), cfg, lr_scheduler=bad_scheduler)
    except RuntimeError as exc:
        first = str(exc)
    left = swap_files(nvme_path)
    engine = fsdpx.shard(make_model(), cfg)
    train(engine, 0, 1)
    finish(engine)
    return {"first": first, "left_after_failure": left}
