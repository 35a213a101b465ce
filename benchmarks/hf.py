"""Hugging Face path: sharded loading and Trainer step time, fsdpx against FSDP2 as
Hugging Face users run it, side by side in one run (2 gloo ranks on CPU, ZeRO-3).

Run from the repository root::

    .venv/bin/python benchmarks/hf.py                        # ~1.09 GB Llama, both parts
    .venv/bin/python benchmarks/hf.py --part load --repeats 3
    .venv/bin/python benchmarks/hf.py --tiny                 # smallest (tests/test_benchmarks_smoke.py)

Nothing is downloaded: the models are Llama-style configs with random weights, written by
plain `save_pretrained` into a temporary directory.

Part 1, loading (`--part load`)
-------------------------------
A Llama of `--layers` x `--hidden` (default 16 x 1024, MLP 2816, vocab 32000, untied:
271M parameters, 1.09 GB of fp32 safetensors in one file) is saved, then loaded on 2 ranks
under ZeRO-3 in fresh processes (`torchrun`), alternately (A B B A ...):

* **fsdpx**: `fsdpx.hf.from_pretrained(AutoModelForCausalLM, dir, Config())` (meta build,
  shard, each rank reads its shards' bytes);
* **fsdp2**: `AutoModelForCausalLM.from_pretrained(dir)` on every rank, then `fully_shard`
  on every decoder layer and on the root over a 1-D mesh of both ranks: the FSDP2 path
  Accelerate takes (`fsdp_version=2`, `cpu_ram_efficient_loading` off).

Per rank: **peak RSS growth**, the high-water mark (`VmHWM`, reset through
`/proc/self/clear_refs` right after `import torch, transformers`) minus the RSS at that
point, so the process group, `import fsdpx` (fsdpx side only), the model's code (transformers imports it
lazily: ~45 MiB for Llama, paid by both sides) and everything the load allocates count;
also printed, the growth above the process once all of that is imported (the load
alone); what the load freed again by its end (VmHWM minus VmRSS right after it: a
transient copy, such as the full model the FSDP2 side builds, shows here); for fsdpx the
RSS above the model code after the meta build and when the first tensor is read (the
model sharded, its shards allocated but untouched); and **wall time** from a barrier
before the call to a barrier after it (slowest rank).
Both sides then run one forward of the same tokens; the logits must agree (checked).
Printed: each run, the medians, and the ratios against the goals (RSS growth <= 0.6x the
model's bytes and <= 0.5x the fsdp2 side's, time <= 1.0x). The files are read from the
page cache by both sides (each run follows another), flushed to disk once after they are
written so that no write-back of them runs during the timed loads.

Part 2, Trainer step (`--part trainer`)
---------------------------------------
A smaller Llama (`--trainer-layers` x `--trainer-hidden`, default 4 x 512, vocab 8000) is
trained by `transformers.Trainer` on 2 ranks, alternately in fresh processes:

* **fsdpx**: `fsdpx.hf.Trainer(..., fsdpx_config={"zero_optimization": {"stage": 3}, ...})`;
* **fsdp2**: the stock `Trainer` with `fsdp=True, fsdp_config={"version": 2,
  "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True}`,
  i.e. Accelerate's FSDP plugin with `fsdp_version=2`.

Same data, seed, batch (`--batch` sequences of `--seq` tokens per rank), AdamW, fp32, no
accumulation, clipping at 1.0. A callback times each optimizer step (data, forward,
backward, step) from `on_step_begin` to `on_step_end`; the first `--warmup` steps are
dropped and a step's time is the slowest rank's. Printed: per-run medians, the median of
all steps per side and the ratio fsdpx / fsdp2 (goal <= 1.05), and both sides' last losses
(they train the same model on the same data; the numbers differ only by reduction order).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("fsdpx", "fsdp2")


def _order(repeats: int) -> list[str]:
    """A B B A A B ...: each side runs first as often as the other (warm caches, drift)."""
    out: list[str] = []
    for i in range(repeats):
        out += list(SIDES if i % 2 == 0 else reversed(SIDES))
    return out


def _launch(worker: str, side: str, args: argparse.Namespace, model_dir: str) -> list[Any]:
    """Run one worker on 2 ranks in fresh processes; every rank's JSON result."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(Path(__file__).resolve()),
            "--worker",
            worker,
            "--side",
            side,
            "--model-dir",
            model_dir,
            "--result-dir",
            out,
            "--steps",
            str(args.steps),
            "--batch",
            str(args.batch),
            "--seq",
            str(args.seq),
        ]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), LOCAL_WORLD_SIZE="2")
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{worker}/{side} failed ({proc.returncode}):\n{proc.stderr[-12000:]}")
        return [json.loads((Path(out) / f"{r}.json").read_text()) for r in range(2)]


def _llama_config(layers: int, hidden: int, inter: int, vocab: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )


def _save_model(config: Any, path: Path) -> int:
    """A random-weight model of `config` written by plain save_pretrained; its bytes."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Cheap deterministic weights (the default init of 271M parameters is slow on 2 cores).
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        model.model.rotary_emb.__init__(config)  # the buffer to_empty left uninitialised
    model.save_pretrained(path)
    # Flush the files now: the kernel writes dirty pages back ~30 s after they were written
    # (vm.dirty_expire_centisecs), i.e. during the timed runs, slowing whichever side runs
    # then. After fsync the pages stay in the page cache, clean, for both sides alike.
    for f in path.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --- the parent -------------------------------------------------------------------------


def _load_part(args: argparse.Namespace, tmp: Path) -> None:
    if args.tiny:
        config = _llama_config(2, 64, 128, 256)
    else:
        config = _llama_config(args.layers, args.hidden, args.intermediate, 32000)
    model_bytes = _save_model(config, tmp / "load")
    print(
        f"loading: Llama {config.num_hidden_layers} x {config.hidden_size}, "
        f"{model_bytes / 2**30:.3f} GiB fp32 ({model_bytes / 4 / 1e6:.0f}M params), "
        f"2 ranks ZeRO-3, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict[str, list[list[Any]]] = {s: [] for s in SIDES}
    for side in _order(args.repeats):
        ranks = _launch("load", side, args, str(tmp / "load"))
        results[side].append(ranks)
        rss = " ".join(f"{r['rss_growth'] / 2**20:.0f}" for r in ranks)
        code = " ".join(f"{(r['rss_growth'] - r['load_growth']) / 2**20:.0f}" for r in ranks)
        transient = " ".join(f"{r['transient'] / 2**20:.0f}" for r in ranks)
        wall = max(r["wall_s"] for r in ranks)
        print(
            f"  {side:5s} run: {wall:.2f} s, peak RSS growth per rank MiB {rss} "
            f"(of which before the load: imports, process group, model code {code}; "
            f"freed again by the end of the load: {transient})",
            flush=True,
        )
        for name in ranks[0]["stages"]:
            grown = " ".join(f"{r['stages'][name] / 2**20:.0f}" for r in ranks)
            print(f"        RSS above the model code, {name}: MiB {grown}", flush=True)
    logits = {s: results[s][0][0]["logits"] for s in SIDES}
    diff = max(abs(a - b) for a, b in zip(logits["fsdpx"], logits["fsdp2"], strict=True))
    if diff > 1e-4:
        raise SystemExit(f"the two sides loaded different weights: logits differ by {diff}")
    med = {
        s: {
            "rss": statistics.median(max(r["rss_growth"] for r in run) for run in results[s]),
            "load": statistics.median(max(r["load_growth"] for r in run) for run in results[s]),
            "wall": statistics.median(max(r["wall_s"] for r in run) for run in results[s]),
        }
        for s in SIDES
    }
    for s in SIDES:
        print(
            f"{s}: median wall {med[s]['wall']:.2f} s, median of the largest rank's "
            f"peak RSS growth {med[s]['rss'] / 2**20:.0f} MiB "
            f"({med[s]['rss'] / model_bytes:.3f}x the model); above the process after "
            f"importing the model's code: {med[s]['load'] / 2**20:.0f} MiB "
            f"({med[s]['load'] / model_bytes:.3f}x)"
        )
    print(
        f"ratio load: rss/model={med['fsdpx']['rss'] / model_bytes:.3f} (goal <= 0.6) "
        f"rss/fsdp2={med['fsdpx']['rss'] / med['fsdp2']['rss']:.3f} (goal <= 0.5) "
        f"time/fsdp2={med['fsdpx']['wall'] / med['fsdp2']['wall']:.3f} (goal <= 1.0) "
        f"logits max diff {diff:.1e}"
    )


def _trainer_part(args: argparse.Namespace, tmp: Path) -> None:
    if args.tiny:
        config = _llama_config(2, 64, 128, 256)
    else:
        config = _llama_config(args.trainer_layers, args.trainer_hidden, 4 * 344, 8000)
    _save_model(config, tmp / "train")
    n = sum(1 for _ in (tmp / "train").glob("*.safetensors"))
    print(
        f"trainer: Llama {config.num_hidden_layers} x {config.hidden_size} "
        f"(vocab {config.vocab_size}; {n} file), {args.batch} x {args.seq} tokens per rank, "
        f"{args.steps} steps ({args.warmup} warm-up), load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    steps: dict[str, list[float]] = {s: [] for s in SIDES}
    losses: dict[str, float] = {}
    for side in _order(args.repeats):
        ranks = _launch("trainer", side, args, str(tmp / "train"))
        per_step = [max(t) for t in zip(*(r["step_s"] for r in ranks), strict=True)]
        timed = per_step[args.warmup :]
        steps[side] += timed
        losses[side] = ranks[0]["last_loss"]
        print(
            f"  {side:5s} run: median step {statistics.median(timed) * 1e3:.1f} ms "
            f"over {len(timed)} steps, last loss {losses[side]:.5f}",
            flush=True,
        )
    med = {s: statistics.median(steps[s]) for s in SIDES}
    print(f"fsdpx: median step {med['fsdpx'] * 1e3:.1f} ms; fsdp2: {med['fsdp2'] * 1e3:.1f} ms")
    print(
        f"ratio trainer step fsdpx/fsdp2={med['fsdpx'] / med['fsdp2']:.3f} (goal <= 1.05) "
        f"last loss diff {abs(losses['fsdpx'] - losses['fsdp2']):.1e}"
    )


# --- the ranks --------------------------------------------------------------------------


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _load_worker(side: str, model_dir: str) -> dict[str, Any]:
    import time

    import torch
    import torch.distributed as dist
    import transformers  # the baseline is after this import

    # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status("VmRSS:")
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    if side == "fsdpx":  # the FSDP2 side does not pay for importing fsdpx
        import fsdpx
        import fsdpx.hf

    # The model's own code (transformers imports it lazily, ~45 MiB for Llama): both sides
    # load it; the growth above this point is the loading alone.
    config = transformers.AutoConfig.from_pretrained(model_dir)
    transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    code = _status("VmRSS:")
    stages: dict[str, int] = {}
    if side == "fsdpx":
        _mark_stages(stages)
    dist.barrier()
    start = time.perf_counter()
    if side == "fsdpx":
        engine = fsdpx.hf.from_pretrained(AutoModelForCausalLM, model_dir, fsdpx.Config())
        assert isinstance(engine, fsdpx.Engine)
        model: Any = engine.module
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    dist.barrier()
    wall = time.perf_counter() - start
    peak, after = _status("VmHWM:"), _status("VmRSS:")
    ids = torch.arange(8).reshape(1, 8) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, -1, :16].tolist()
    return {
        "rss_growth": peak - base,
        "load_growth": peak - code,
        "transient": peak - after,
        "stages": {k: v - code for k, v in stages.items()},
        "wall_s": wall,
        "logits": logits,
    }


def _mark_stages(stages: dict[str, int]) -> None:
    """Where the fsdpx side's RSS grows: VmRSS after the meta build and when the first
    tensor is read (the model is sharded and its shards allocated, untouched, by then).
    Wraps two private functions of fsdpx.hf.loading: a diagnostic, not an API."""
    import fsdpx.hf.loading as loading

    build, load_part = loading._build_on_meta, loading._load_part

    def built(*a: Any, **k: Any) -> Any:
        out = build(*a, **k)
        stages["built on meta"] = _status("VmRSS:")
        return out

    def reading(*a: Any, **k: Any) -> Any:
        stages.setdefault("sharded, before the reads", _status("VmRSS:"))
        return load_part(*a, **k)

    loading._build_on_meta = built  # type: ignore[assignment]
    loading._load_part = reading  # type: ignore[assignment]


def _cpu_fsdp2_trainer(base: Any) -> Any:
    """The stock Trainer, with Accelerate's FSDP plugin switched on for CPU processes.

    [Note: FSDP2 through Accelerate on CPU] Accelerate 1.x enables its FSDP plugin only for
    accelerator device types (MULTI_GPU, MULTI_XPU, ...); for MULTI_CPU it silently falls
    back to DDP. Its FSDP2 path itself (`fsdp2_prepare_model`: `fully_shard` per wrapped
    layer and on the root, the optimizer re-created on the sharded parameters) has nothing
    device-specific, so the benchmark sets the distributed type and plugin the Trainer
    asked for after the Accelerator is built, and checks that the model came out as an
    FSDP2 module. Without a GPU this is the only way to time FSDP2 through Accelerate."""
    from accelerate import FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    class CpuFsdp2Trainer(base):  # type: ignore[misc, valid-type]
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            state = self.accelerator.state
            if state.distributed_type == DistributedType.MULTI_CPU:
                state.distributed_type = DistributedType.FSDP
                state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
                self.is_fsdp_enabled = True

    return CpuFsdp2Trainer


def _trainer_worker(side: str, model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    import time

    import torch
    import torch.distributed as dist
    from transformers import (
        AutoModelForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    dist.init_process_group("gloo")
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (args.batch * 2 * args.steps, args.seq), generator=g)
    data = [{"input_ids": x, "labels": x} for x in ids]

    class Timer(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.begin = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.times.append(time.perf_counter() - self.begin)

    common: dict[str, Any] = dict(
        output_dir=str(Path(model_dir) / f"out-{side}"),
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=1e-4,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        optim="adamw_torch",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    timer = Timer()
    if side == "fsdpx":
        from fsdpx.hf import Trainer as FsdpxTrainer

        ds = {"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}
        trainer: Any = FsdpxTrainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=data,
            callbacks=[timer],
            fsdpx_config=ds,
        )
    else:
        fsdp_config = {
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "reshard_after_forward": True,
        }
        fsdp: Any = True  # transformers' annotation still says str
        args_ = TrainingArguments(**common, fsdp=fsdp, fsdp_config=fsdp_config)
        trainer = _cpu_fsdp2_trainer(Trainer)(
            model=model, args=args_, train_dataset=data, callbacks=[timer]
        )
    trainer.train()
    if side == "fsdp2":  # the check that Accelerate really sharded with FSDP2
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(trainer.model_wrapped, FSDPModule):
            raise RuntimeError(f"fsdp2 side is not FSDP2: {type(trainer.model_wrapped)}")
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"step_s": timer.times, "last_loss": losses[-1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["load", "trainer", "all"], default="all")
    p.add_argument("--repeats", type=int, default=2, help="runs per side (alternating)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--trainer-layers", type=int, default=4)
    p.add_argument("--trainer-hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=12, help="Trainer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="Trainer steps not timed")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--tiny", action="store_true", help="tiny models, 1 run per side")
    p.add_argument("--worker", choices=["load", "trainer"], help=argparse.SUPPRESS)
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--result-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        if args.worker == "load":
            result = _load_worker(args.side, args.model_dir)
        else:
            result = _trainer_worker(args.side, args.model_dir, args)
        rank = int(os.environ["RANK"])
        (Path(args.result_dir) / f"{rank}.json").write_text(json.dumps(result))
        return
    if args.tiny:
        args.repeats, args.steps, args.warmup, args.batch, args.seq = 1, 3, 1, 2, 16
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.part in ("load", "all"):
            _load_part(args, Path(tmp))
        if args.part in ("trainer", "all"):
            _trainer_part(args, Path(tmp))


if __name__ == "__main__":
    main()
