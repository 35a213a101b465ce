"""The memory estimator: analytic model states vs the bytes a real fsdpx run holds (stages
0-3, 2 and 4 CPU ranks), the fake-mode measurement vs both, DeepSpeed's formulas against
the numbers DeepSpeed prints, and the world-size-64 run of a 1B-parameter model."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fsdpx
from fsdpx.cli import main
from fsdpx.config import Config
from fsdpx.demo.gpt import GPT, GPTConfig
from fsdpx.estimate import (
    deepspeed_formulas,
    estimate_memory,
    estimate_table,
    parse_count,
    zero_paper_bytes,
)
from fsdpx.estimate_measured import measure_memory
from tests import ds_bodies
from tests.dist import run_ranks

REPO = Path(__file__).resolve().parent.parent
STAGES = (0, 1, 2, 3)


@pytest.fixture(autouse=True)
def _no_default_process_group() -> None:
    # measure_memory creates (and destroys) a fake default process group in this process.
    if dist.is_initialized():
        pytest.skip(
            "an earlier test left a default process group initialised; the fake-mode "
            "estimate needs a process without one"
        )


def _meta_model(cfg: GPTConfig = ds_bodies.EST_MODEL) -> GPT:
    with torch.device("meta"):
        return GPT(cfg)


def _within(estimate: int, measured: int, rel: float) -> bool:
    return abs(estimate - measured) <= rel * measured


@pytest.mark.parametrize("world_size", [2, 4])
def test_model_states_within_5_percent_of_a_real_run(world_size: int) -> None:
    results = run_ranks(ds_bodies.measure_body, world_size, (STAGES,))
    rows = []
    for stage in STAGES:
        cfg = Config.from_dict({"zero": {"stage": stage}})
        est = estimate_memory(_meta_model(), cfg, world_size)
        fake = measure_memory(lambda: GPT(ds_bodies.EST_MODEL), cfg, world_size, _inputs())
        for rank, result in enumerate(results):
            real = result[stage]
            assert real["num_params"] == est.num_params
            measured = real["params"] + real["grads"] + real["optimizer"]
            for key in ("params", "grads", "optimizer"):
                assert _within(getattr(est, key), real[key], 0.05), (stage, rank, key)
            assert _within(est.device_model_states, measured, 0.05), (stage, rank)
            rows.append((stage, rank, est.device_model_states, measured))
        # The fake run shards as fsdpx.shard does: rank 0's bytes are identical.
        real0 = results[0][stage]
        assert (fake.params, fake.grads, fake.optimizer) == (
            real0["params"],
            real0["grads"],
            real0["optimizer"],
        ), stage
    for stage, rank, e, m in rows:
        print(
            f"ws={world_size} stage={stage} rank={rank} est={e} measured={m} "
            f"({100 * (e - m) / m:+.2f}%)"
        )


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(2, 32, dtype=torch.long)
    return x, x


def test_padding_makes_rank_0_the_largest_shard() -> None:
    # vocab 131 does not split evenly over 4 ranks: FSDP2 pads dim 0 to 33 rows per rank.
    est = estimate_memory(_meta_model(), Config.from_dict({"zero": {"stage": 3}}), 4)
    unpadded = est.num_params * 4 / 4
    assert est.params > unpadded
    assert est.params == sum(
        math.ceil(p.shape[0] / 4) * math.prod(p.shape[1:]) * 4 for p in _meta_model().parameters()
    )


def test_deepspeed_formulas_reproduce_deepspeed_printout() -> None:
    # DeepSpeed's estimate_zero3_model_states_mem_needs_all_cold for t5-small (60,506,624
    # params, largest layer 16,449,536), 1 node x 1 GPU, as DeepSpeed prints it (GB = 2**30):
    #   1.52GB | 0.06GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1
    #   1.35GB | 0.17GB | offload_param=none, offload_optimizer=cpu , zero_init=1
    #   0.09GB | 1.08GB | offload_param=none, offload_optimizer=none, zero_init=1
    p, layer = 60_506_624, 16_449_536
    expected = {
        (True, True): (0.06, 1.52),
        (True, False): (0.17, 1.35),
        (False, False): (1.08, 0.09),
    }
    for (opt, par), (gpu, cpu) in expected.items():
        g, c = deepspeed_formulas(
            3,
            p,
            1,
            offload_optimizer=opt,
            offload_param=par,
            largest_layer_params=layer,
            gpus_per_node=1,
        )
        assert g is not None and c is not None
        assert (round(g / 2**30, 2), round(c / 2**30, 2)) == (gpu, cpu), (opt, par)
    # Zero-2 without offload: 4P + 16P/N on the GPU (stage_1_and_2.py).
    assert (
        deepspeed_formulas(
            2,
            10**9,
            8,
            offload_optimizer=False,
            offload_param=False,
            largest_layer_params=0,
            gpus_per_node=8,
        )[0]
        == 6 * 10**9
    )
    assert deepspeed_formulas(
        0,
        10**9,
        8,
        offload_optimizer=False,
        offload_param=False,
        largest_layer_params=0,
        gpus_per_node=8,
    ) == (None, None)


def test_fsdpx_and_formula_relations_for_a_parameter_count() -> None:
    p, n, layer = 10**9, 64, 5 * 10**7
    table = {
        (e.stage, e.offload_optimizer, e.offload_param): e
        for e in estimate_table(p, Config(), n, largest_layer_params=layer)
    }
    s3 = table[(3, "none", "none")]
    # fsdpx at stage 3: 16 bytes per parameter per rank (fp32 master, grad, 2 Adam moments)
    # plus the step counter; DeepSpeed's 18P/N + 4L counts a 16-bit shard and a layer buffer.
    assert s3.device_model_states == 16 * math.ceil(p / n) + 4
    assert s3.deepspeed_gpu == 4 * layer + int(18 * p / n)
    assert s3.zero_paper == zero_paper_bytes(3, p, n) == 16 * p // n
    assert table[(0, "none", "none")].device_model_states == 16 * p + 4
    off = table[(3, "cpu", "cpu")]
    assert off.device_model_states == 0 and off.host_bytes == s3.device_model_states
    # Optimizer offload (fp32): the moments, the fp32 master and a host copy of the grads.
    assert table[(2, "cpu", "none")].host_bytes == s3.optimizer + 2 * 4 * math.ceil(p / n)
    assert s3.gathered_params == 2 * layer * 4
    # Parameter offload alone: fsdpx.optim.AdamW steps the host parameters, moments there too.
    par = estimate_memory(
        p, Config.from_dict({"zero": {"stage": 3, "offload_param": {"device": "cpu"}}}), n
    )
    assert par.device_model_states == 0 and par.host_bytes == s3.device_model_states


def test_fake_mode_activations_and_peak_with_a_sample_input() -> None:
    cfg = Config.from_dict({"zero": {"stage": 3}})
    est = estimate_memory(_meta_model(), cfg, 4, sample_inputs=_inputs())
    assert est.activations is not None and est.peak is not None
    assert est.activations > 0
    assert est.peak >= est.device_model_states + est.activations


@pytest.mark.slow
def test_world_64_one_billion_parameters_in_fake_mode() -> None:
    big = GPTConfig(
        vocab_size=50304, block_size=1024, n_layer=20, n_head=16, n_embd=2048, bias=False
    )
    cfg = Config.from_dict({"zero": {"stage": 3}})
    x = torch.zeros(1, 1024, dtype=torch.long)
    measured = measure_memory(lambda: GPT(big), cfg, 64, (x, x))
    est = estimate_memory(_meta_model(big), cfg, 64)
    assert est.num_params > 10**9
    assert (measured.params, measured.grads, measured.optimizer) == (
        est.params,
        est.grads,
        est.optimizer,
    )
    # Consistent with the formulas: 16 bytes/param/rank (+padding, +step counters) ...
    assert _within(measured.model_states, 16 * est.num_params // 64, 0.001)
    # ... which is DeepSpeed's zero3 GPU figure less its 16-bit shard (2P/N) and layer buffer.
    assert est.deepspeed_gpu is not None
    ds_minus = est.deepspeed_gpu - 4 * (est.num_params - 2 * 50304 * 2048 - 1024 * 2048) // 20
    assert _within(measured.model_states, ds_minus - 2 * est.num_params // 64, 0.01)
    unsharded = measured.peak_by_category["Unsharded Param"]
    assert est.gathered_params is not None and unsharded <= est.gathered_params


def test_world_64_small_model_in_fake_mode() -> None:
    cfg = Config.from_dict({"zero": {"stage": 2}, "precision": {"param_dtype": "bf16"}})
    measured = measure_memory(_meta_model(), cfg, 64, _inputs())
    est = estimate_memory(_meta_model(), cfg, 64)
    assert (measured.params, measured.grads, measured.optimizer) == (
        est.params,
        est.grads,
        est.optimizer,
    )
    assert est.gathered_params == est.num_params * 2  # bf16 working copy of everything


def test_errors() -> None:
    with pytest.raises(ValueError, match="num_params must be >= 1; got 0"):
        estimate_memory(0)
    with pytest.raises(ValueError, match="sample_inputs needs the model itself"):
        estimate_memory(10, sample_inputs=())
    with pytest.raises(ValueError, match=r"a parameter count must be a number .* got '1.3X'"):
        parse_count("1.3X")
    assert parse_count("1.3B") == 1_300_000_000 and parse_count("350M") == 350_000_000
    with pytest.raises(NotImplementedError, match="data parallelism only"):
        measure_memory(_meta_model(), Config.from_dict({"mesh": {"tp": 2}}), 4, _inputs())
    assert fsdpx.estimate_memory is estimate_memory


def test_estimate_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["estimate", "--model", "tests.ds_bodies:est_model_with_input", "--world-size", "4"])
        == 0
    )
    out = capsys.readouterr().out
    assert "measured (fake run of the real sharding): activations" in out
    assert "this config: stage 3, shard group 4" in out
    ds = REPO / "tests/data/deepspeed_configs/zero3_offload_cpu_monitors.json"
    argv = ["estimate", "--params", "7B", "--world-size", "8", "--deepspeed", str(ds)]
    assert main([*argv, "--largest-layer-params", "200M"]) == 0
    out = capsys.readouterr().out
    assert "offload optimizer cpu / param cpu: device model states 0.000 GiB" in out
    assert out.splitlines()[0] == "per-rank GiB, 7,000,000,000 params, world size 8"
    assert main(["estimate", "--params", "lots"]) == 2
    err = capsys.readouterr().err
    assert "fsdpx estimate: error: a parameter count must be a number" in err


def test_estimate_cli_runs_as_a_console_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fsdpx.cli", "estimate", "--params", "1.3B", "--world-size", "64"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    assert "per-rank GiB, 1,300,000,000 params, world size 64" in result.stdout


@pytest.mark.parametrize(
    ("offload", "dtype"),
    [("cpu", "bf16"), ("cpu", "fp32"), ("nvme", "bf16")],
)
def test_offload_placement_matches_the_tensors_offload_allocates(
    offload: str, dtype: str, tmp_path: Path
) -> None:
    """The estimate's device / host / NVMe bytes against what an offloaded engine holds:
    its device shards and gradients, and OffloadedAdamW's host tensors or swap file."""
    from tests import offload_bodies

    (r,) = run_ranks(
        offload_bodies.placement_body, world_size=1, args=(offload, dtype, str(tmp_path))
    )
    assert r["est_device"] == r["device"]
    if offload == "cpu":
        assert r["est_host"] == r["host_tensors"] + r["steps"]
        assert r["est_nvme"] == 0
    else:
        assert r["est_host"] == 1 << 20 >= r["host_buffers"]
        assert r["est_nvme"] == 3 * 4 * r["total_numel"] + r["steps"] <= r["file_bytes"]


def test_sp_ranks_share_the_shards() -> None:
    # ZeRO-3 over dp_shard x sp: 8 ranks with sp 2 shard like 8 ranks without it.
    plain = fsdpx.estimate_memory(1_000_000, Config.from_dict({"zero": {"stage": 3}}), 8)
    sp = fsdpx.estimate_memory(
        1_000_000, Config.from_dict({"zero": {"stage": 3}, "mesh": {"sp": 2}}), 8
    )
    assert sp.device_model_states == plain.device_model_states
