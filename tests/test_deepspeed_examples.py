"""The DeepSpeed-style scripts in examples/deepspeed/, run as a user runs them (torchrun,
one changed import), against a single-process reference. Slow: each launches torchrun;
tests/test_deepspeed_engine.py is their default-tier twin."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "deepspeed"


def _launch(script: str, nproc: int, *args: str) -> str:
    """Run an example as a user would; returns its output."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if nproc == 1:
        cmd = [sys.executable, str(EXAMPLES / script), *args]
    else:
        torchrun = Path(sys.executable).with_name("torchrun")
        cmd = [
            str(torchrun),
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(EXAMPLES / script),
            *args,
        ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path / "pytorch_model.bin", weights_only=True)


@pytest.mark.slow
def test_cifar_style_one_and_two_ranks_train_the_same_model(tmp_path: Path) -> None:
    config = str(EXAMPLES / "cifar_ds_config.json")
    out1 = _launch("cifar_style.py", 1, "--deepspeed_config", config, "--out", str(tmp_path / "1"))
    out2 = _launch(
        "cifar_style.py",
        2,
        "--deepspeed",
        "--deepspeed_config",
        config,
        "--out",
        str(tmp_path / "2"),
    )
    assert "steps 32 samples 512" in out1 and "steps 32 samples 512" in out2
    assert "[fsdpx.deepspeed] step=4, skipped=0, lr=" in out2  # steps_per_print
    a, b = _weights(tmp_path / "1"), _weights(tmp_path / "2")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name)


def _hf_reference(steps: int) -> dict[str, torch.Tensor]:
    """examples/deepspeed/hf_causal_lm.py's training in one process with plain
    transformers and torch: dp=2 chunks per micro-step, gas 2, the same clip and schedule."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import hf_causal_lm as example
    finally:
        sys.path.remove(str(EXAMPLES))
    from fsdpx.deepspeed.runtime.lr_schedules import WarmupDecayLR

    torch.manual_seed(0)
    model = example.build_model()
    groups = example.param_groups(model)
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    sched = WarmupDecayLR(
        opt, total_num_steps=steps, warmup_max_lr=1e-3, warmup_num_steps=2, warmup_type="linear"
    )
    dp, gas, micro = 2, 2, 2
    data = list(example.batches(steps * gas, micro * dp))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            grads = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
            for x in data[step * gas : (step + 1) * gas]:
                for r in range(dp):
                    work = copy.deepcopy(model)
                    ids = x[r * micro : (r + 1) * micro]
                    (work(input_ids=ids, labels=ids).loss / (gas * dp)).backward()
                    for n, p in work.named_parameters():
                        grads[n] += p.grad
            for n, p in model.named_parameters():
                p.grad = grads[n]
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_hf_causal_lm_matches_plain_transformers(tmp_path: Path) -> None:
    pytest.importorskip(
        "transformers", reason="needs the fsdpx[hf] extra (scripts/setup.sh installs it)"
    )
    _launch("hf_causal_lm.py", 2, "--steps", "6", "--out", str(tmp_path))
    ours, ref = _weights(tmp_path), _hf_reference(6)
    assert ours.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(ours[name], ref[name], msg=name)


@pytest.mark.slow
def test_masked_lm_with_offload_resumes_and_matches_one_rank(tmp_path: Path) -> None:
    """examples/deepspeed/masked_lm.py (no-decay groups, ZeRO-2 + CPU optimizer offload):
    stopped after 5 steps and resumed from its step-4 checkpoint, its losses equal the
    uninterrupted run's. (Offloaded training against a single-process reference is
    tests/test_offload.py's; the script logs each step's last micro-batch loss, which
    differs between world sizes.)"""
    import json

    config = str(EXAMPLES / "masked_lm_ds_config.json")

    def run(nproc: int, ckpt: str, *extra: str) -> list[float]:
        out = tmp_path / f"{ckpt}.json"
        _launch(
            "masked_lm.py",
            nproc,
            "--deepspeed_config",
            config,
            "--ckpt",
            str(tmp_path / ckpt),
            "--losses",
            str(out),
            *extra,
        )
        return json.loads(out.read_text())

    full = run(2, "full")
    run(2, "resumed", "--stop-after", "5")
    resumed = run(2, "resumed")
    assert len(full) == 12
    assert resumed == full


def _pipeline_reference(
    steps: int, gas: int, micro: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """examples/deepspeed/pipeline_alexnet.py's training in one process: the same layers as
    one nn.Sequential, the same seed, data order (the loader a dp size of 1 builds),
    micro-batches and Adam."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        import pipeline_alexnet as example
    finally:
        sys.path.remove(str(EXAMPLES))
    from torch import nn
    from torch.utils.data import DataLoader, DistributedSampler

    from fsdpx.deepspeed.runtime.utils import set_random_seed

    class Flatten(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.flatten(x, 1)

    torch.manual_seed(1138)
    set_random_seed(1138)
    layers = example.join_layers(example.AlexNet(num_classes=10))
    model = nn.Sequential(*[m if isinstance(m, nn.Module) else Flatten() for m in layers])
    data = example.SyntheticImages()
    loader = DataLoader(
        data, batch_size=micro, sampler=DistributedSampler(data, num_replicas=1, rank=0)
    )
    stream = iter(example.deepspeed.utils.RepeatingLoader(loader))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(gas):
            x, y = next(stream)
            loss = nn.functional.cross_entropy(model(x), y) / gas
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    names = {id(m): n for n, m in model.named_children()}
    state = {f"{names[id(m)]}.{k}": v for m in model.children() for k, v in m.state_dict().items()}
    return losses, state


@pytest.mark.slow
def test_pipeline_alexnet_two_stages_match_a_single_process(tmp_path: Path) -> None:
    from checkpoint_tools import load_state_dict

    steps = 6
    out = _launch(
        "pipeline_alexnet.py",
        2,
        "--deepspeed_config",
        str(EXAMPLES / "pipeline_ds_config.json"),
        "-p",
        "2",
        "--steps",
        str(steps),
        "--out",
        str(tmp_path),
    )
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
    # train_batch_size 32 / micro 4 on one data-parallel rank: 8 micro-batches a step.
    ref_losses, ref_state = _pipeline_reference(steps, gas=8, micro=4)
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-6)
    weights = load_state_dict(tmp_path, dtype="fp32")
    assert sorted(weights) == sorted(ref_state)
    for name, value in ref_state.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-5, msg=name)
