"""Config.from_deepspeed: every shipped DeepSpeed config translates; each refusal, the batch
rule and the summary line are pinned by message; a 2-rank run from each runnable config
equals the run from the equivalent native Config (one spawn for all of them)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdpx.config import Config
from fsdpx.deepspeed._config import explain, translate
from fsdpx.deepspeed._json import strip_comments_and_trailing_commas
from fsdpx.deepspeed._keys import DS_KEYS
from tests import ds_bodies
from tests.dist import run_ranks

DATA = Path(__file__).parent / "data" / "deepspeed_configs"
FILES = sorted(DATA.glob("*.json"))
ADAMW = {"type": "adamw", "lr": 0.01}

# The native Config each runnable file means at world size 2, written by hand.
NATIVE: dict[str, dict[str, Any]] = {
    "zero1_adamw_warmuplr": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "zero": {"stage": 1},
        "optimizer": {**ADAMW, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        "scheduler": {
            "type": "WarmupLR",
            "warmup_min_lr": 0.0,
            "warmup_max_lr": 0.01,
            "warmup_num_steps": 3,
            "warmup_type": "linear",
        },
    },
    "zero2_fp16_dynamic_hjson": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "precision": {"param_dtype": "fp16", "reduce_dtype": "fp32"},
        "fp16": {"static_scale": 0, "initial_scale_power": 8, "window": 2, "hysteresis": 1},
        "zero": {"stage": 2},
        "optimizer": {**ADAMW, "weight_decay": 0.01},
        "scheduler": {
            "type": "WarmupDecayLR",
            "warmup_min_lr": 0.001,
            "warmup_max_lr": 0.01,
            "warmup_num_steps": 2,
            "total_num_steps": 10,
        },
    },
    "zero2_fp16_static_onecycle": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.5,
        "precision": {"param_dtype": "fp16", "reduce_dtype": "fp32"},
        "fp16": {"static_scale": 128},
        "zero": {"stage": 2},
        "optimizer": {"type": "adamw", "lr": 0.005},
        "scheduler": {
            "type": "OneCycle",
            "cycle_min_lr": 0.001,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 2,
            "cycle_second_step_size": 2,
            "decay_lr_rate": 0.1,
            "decay_step_size": 1,
        },
    },
    "zero3_bf16_auto": {
        "train_micro_batch_size_per_gpu": 2,
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        "zero": {"stage": 3},
        "optimizer": {**ADAMW, "weight_decay": 0.05},
        "scheduler": {
            "type": "WarmupCosineLR",
            "total_num_steps": 10,
            "warmup_num_steps": 2,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.01,
        },
    },
    "zero0_sgd_bf16": {
        "train_micro_batch_size_per_gpu": 2,
        "precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
        "zero": {"stage": 0},
        "optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9},
    },
    "zero3_activation_checkpointing_mics": {
        "train_micro_batch_size_per_gpu": 2,
        "zero": {"stage": 3},
        "mesh": {"dp_shard": 2, "dp_replicate": 1},
        "activation_checkpointing": {"mode": "full"},
        "optimizer": ADAMW,
    },
    "legacy_bool_zero_bfloat16": {
        "train_micro_batch_size_per_gpu": 2,
        "zero": {"stage": 1},
        "precision": {"param_dtype": "bf16", "reduce_dtype": "bf16"},
        "optimizer": ADAMW,
    },
    "zero2_adam_l2_derived_gas": {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero": {"stage": 2},
        "optimizer": {"type": "adam", "lr": 0.01, "weight_decay": 0.01},
        "scheduler": {"type": "WarmupLR", "warmup_num_steps": 2, "warmup_max_lr": 0.001},
    },
    "zero3_hpz": {
        "gradient_accumulation_steps": 2,
        "zero": {"stage": 3, "hpz_partition_size": 2},
        "optimizer": {**ADAMW, "weight_decay": 0.1},
    },
}
# Checked for translation only (offload and pipelining are built by other issues).
NOT_RUNNABLE: dict[str, dict[str, Any]] = {
    "zero3_offload_cpu_monitors": {
        "zero": {"stage": 3},
        "zero.offload_optimizer": {"device": "cpu", "pin_memory": True},
        "telemetry": {"enabled": True},
        "gradient_accumulation_steps": 4,
    },
    "zero3_offload_nvme": {
        "zero.offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True},
        "precision": {"param_dtype": "fp16", "reduce_dtype": "fp16"},
        "gradient_accumulation_steps": 8,
    },
    "pipeline_stages2": {
        "mesh": {"pp": 2},
        "activation_checkpointing": {"mode": "full"},
        "gradient_accumulation_steps": 8,
    },
}


def test_every_shipped_config_is_covered_and_translates() -> None:
    assert len(FILES) >= 10
    assert {f.stem for f in FILES} == set(NATIVE) | set(NOT_RUNNABLE)
    for path in FILES:
        tr = translate(path, world_size=2)
        assert tr.summary.startswith(f"DeepSpeed config {path} -> fsdpx Config (world size 2)")
        # Every key of the file has exactly one row.
        keys = _leaf_keys(json.loads(strip_comments_and_trailing_commas(path.read_text())))
        assert keys <= {r.key for r in tr.rows}, path


def _leaf_keys(data: dict[str, Any], prefix: str = "") -> set[str]:
    out = set()
    for k, v in data.items():
        path = prefix + k
        if path == "zero_optimization" and isinstance(v, bool):  # old form of {"stage": 0/1}
            out.add("zero_optimization.stage")
        elif isinstance(v, dict) and DS_KEYS.get(path, None) and DS_KEYS[path].action == "section":
            out |= _leaf_keys(v, path + ".")
        else:
            out.add(path)
    return out


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_runnable_config_equals_its_native_config(name: str) -> None:
    assert Config.from_deepspeed(DATA / f"{name}.json", world_size=2) == Config.from_dict(
        NATIVE[name]
    )


@pytest.mark.parametrize("name", sorted(NOT_RUNNABLE))
def test_offload_and_pipeline_configs_translate(name: str) -> None:
    cfg = Config.from_deepspeed(DATA / f"{name}.json", world_size=2)
    for dotted, expected in NOT_RUNNABLE[name].items():
        node: Any = cfg
        for part in dotted.split("."):
            node = getattr(node, part)
        if isinstance(expected, dict):
            for k, v in expected.items():
                assert getattr(node, k) == v, (dotted, k)
        else:
            assert node == expected, dotted


def test_ds_runs_equal_native_runs_on_two_ranks() -> None:
    cases = {name: (str(DATA / f"{name}.json"), cfg) for name, cfg in NATIVE.items()}
    results = run_ranks(ds_bodies.ds_vs_native_body, 2, (cases,))
    for rank_result in results:
        for name, r in rank_result.items():
            assert r["same_config"], name
            ds, native = r["ds"], r["native"]
            assert len(ds["losses"]) == ds_bodies.STEPS * (
                NATIVE[name].get("gradient_accumulation_steps", 1)
            )
            for key in ("losses", "lrs", "scales"):
                torch.testing.assert_close(
                    torch.tensor(ds[key]), torch.tensor(native[key]), msg=f"{name} {key}"
                )
            for p, ref in native["params"].items():
                torch.testing.assert_close(ds["params"][p], ref, msg=f"{name} {p}")
            # Training moved the weights (a run that did nothing would also "match").
            start = ds_bodies.make_model().state_dict()
            moved = max(float((ds["params"][p] - start[p]).abs().max()) for p in start)
            assert moved > 1e-4, name


# --- semantics written out where DeepSpeed's defaults differ from fsdpx's -------------------


def test_deepspeed_defaults_are_written_out() -> None:
    cfg = Config.from_deepspeed({"train_batch_size": 4}, world_size=2)
    assert cfg.zero.stage == 0  # no zero_optimization block: DeepSpeed's stage 0, not 3
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == (2, 1)
    cfg = Config.from_deepspeed(
        {"train_batch_size": 2, "scheduler": {"type": "WarmupLR", "params": {}}}, world_size=1
    )
    assert cfg.scheduler.warmup_max_lr == 0.001
    cfg = Config.from_deepspeed(
        {"train_batch_size": 2, "optimizer": {"type": "Adam", "params": {"lr": 0.1}}},
        world_size=1,
    )
    assert cfg.optimizer.type == "adamw"
    bf16 = Config.from_deepspeed({"train_batch_size": 2, "bf16": {"enabled": True}}, world_size=1)
    assert (bf16.precision.param_dtype, bf16.precision.reduce_dtype) == ("bf16", "bf16")


def test_world_size_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = Config.from_deepspeed({"train_batch_size": 16, "gradient_accumulation_steps": 2})
    assert cfg.train_micro_batch_size_per_gpu == 2
    monkeypatch.delenv("WORLD_SIZE")
    assert Config.from_deepspeed({"train_batch_size": 16}).train_micro_batch_size_per_gpu == 16


@pytest.mark.parametrize(
    ("batch", "world", "expected"),
    [
        ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, 4, (4, 2)),
        ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (4, 2)),
        ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 4, (3, 2)),
        ({"train_micro_batch_size_per_gpu": 3}, 4, (3, 1)),
        ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2}, 8, (2, 1)),
        ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto"}, 8, (8, 1)),
    ],
)
def test_batch_values_are_derived_like_deepspeed(
    batch: dict[str, Any], world: int, expected: tuple[int, int]
) -> None:
    cfg = Config.from_deepspeed(batch, world_size=world)
    assert (cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expected


def test_batch_rule_message_shows_all_four_numbers() -> None:
    bad = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    with pytest.raises(
        ValueError,
        match=r"train_batch_size is not equal to micro_batch_per_gpu \* gradient_acc_step \* world_size 32 != 4 \* 2 \* 2 \(data-parallel size 2 = world size 2\)",
    ):
        Config.from_deepspeed(bad, world_size=2)
    # The data-parallel size excludes pipeline stages.
    piped = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "pipeline": {"stages": 2}}
    with pytest.raises(
        ValueError, match=r"16 != 2 \* 4 \* 1 .*world size 2 / \(pipeline 2 x tensor 1\)"
    ):
        Config.from_deepspeed({**piped, "gradient_accumulation_steps": 4}, world_size=2)
    with pytest.raises(
        ValueError,
        match="Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided",
    ):
        Config.from_deepspeed({"gradient_accumulation_steps": 2}, world_size=1)
    with pytest.raises(ValueError, match=r"3 != 0 \* 1 \* 4"):
        Config.from_deepspeed({"train_batch_size": 3}, world_size=4)


def test_lamb_maps_with_its_parameters() -> None:
    cfg = Config.from_deepspeed(
        {
            "train_batch_size": 4,
            "optimizer": {
                "type": "Lamb",
                "params": {
                    "lr": 2e-3,
                    "weight_decay": 0.01,
                    "bias_correction": False,
                    "max_coeff": 0.3,
                    "min_coeff": 0.02,
                    "eps_inside_sqrt": True,
                },
            },
        },
        world_size=4,
    )
    opt = cfg.optimizer
    assert (opt.type, opt.lr, opt.weight_decay, opt.bias_correction) == ("lamb", 2e-3, 0.01, False)
    assert (opt.max_coeff, opt.min_coeff, opt.eps_inside_sqrt) == (0.3, 0.02, True)
    with pytest.raises(ValueError, match="optimizer.max_coeff"):
        Config.from_deepspeed(
            {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"max_coeff": 1.0}}},
            world_size=4,
        )


REFUSALS = [
    ({"optimizer": {"type": "Lion"}}, "optimizer type 'Lion' is not built into fsdpx"),
    (
        {"scheduler": {"type": "LRRangeTest"}},
        "scheduler type 'LRRangeTest' is not built into fsdpx.*pass lr_scheduler=callable",
    ),
    (
        {"zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}},
        r"'zero_optimization.zero_quantized_nontrainable_weights' = True: quantized frozen "
        r"weights: not implemented yet .*set it to false",
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
        "partial optimizer offload is not implemented",
    ),
    (
        {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
        "offload_param needs ZeRO stage 3",
    ),
    (
        {"pipeline": {"stages": 2, "seed_layers": True}},
        r"'pipeline.seed_layers' = True: per-layer seeding is not supported",
    ),
    (
        {"activation_checkpointing": {"cpu_checkpointing": True}},
        "keeping checkpointed activations in CPU memory is not implemented",
    ),
    (
        {"activation_checkpointing": {"partition_activations": True}},
        "splitting saved activations across tensor-parallel ranks is not implemented",
    ),
    (
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        "fp16 and bf16 are both enabled; enable one",
    ),
    (
        {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
        "fsdpx keeps fp32 master weights",
    ),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, "NVIDIA Apex AMP is not supported"),
    (
        {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1.0}}},
        r"cycle_momentum' is absent \(true\): fsdpx's OneCycle cycles only the learning rate",
    ),
    (
        {"scheduler": {"type": "WarmupLR", "params": {"cycle_min_lr": 0.1}}},
        r"'cycle_min_lr' is not a parameter of DeepSpeed's WarmupLR",
    ),
    (
        {"optimizer": {"type": "AdamW", "params": {"amsgrad": True}}},
        "AMSGrad is not in the built-in optimizers",
    ),
    ({"sparse_gradients": True}, "sparse embedding gradients are not supported"),
    ({"elasticity": {"enabled": True}}, "elastic batch sizing is not supported"),
    (
        {"communication_data_type": "fp8"},
        "'communication_data_type' must be one of fp32, fp16, bf16; got 'fp8'",
    ),
    (
        {"zero_optimization": {"stage": 3, "mics_shard_size": 3}},
        "mics_shard_size 3 must divide the data-parallel size 4",
    ),
]


@pytest.mark.parametrize(("extra", "message"), REFUSALS)
def test_refusals_name_the_key_and_what_to_use(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config.from_deepspeed({"train_batch_size": 4, **extra}, world_size=4)


def test_all_refusals_are_listed_in_one_error() -> None:
    with pytest.raises(
        ValueError,
        match=r"<dict>: 2 DeepSpeed key\(s\) cannot be used:\n  zero_optimization.zero_quantized_nontrainable_weights: .*\n  optimizer.type: ",
    ):
        Config.from_deepspeed(
            {
                "train_batch_size": 1,
                "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True},
                "optimizer": {"type": "Lion"},
            },
            world_size=1,
        )


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"zero_optimization": {"stage3_prefetch_bucket_sise": 1}},
            r"unknown DeepSpeed config key 'zero_optimization.stage3_prefetch_bucket_sise'; did you mean 'zero_optimization.stage3_prefetch_bucket_size'\?",
        ),
        ({"gradient_clippng": 1.0}, r"did you mean 'gradient_clipping'\?"),
        ({"fp16": {"enable": True}}, r"did you mean 'fp16.enabled'\?"),
        (
            {"no_such_thing": 1},
            r"unknown DeepSpeed config key 'no_such_thing'; see `fsdpx config explain`",
        ),
    ],
)
def test_unknown_keys_get_did_you_mean(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Config.from_deepspeed({"train_batch_size": 1, **data}, world_size=1)


def test_summary_line_is_logged_once_and_pinned(caplog: pytest.LogCaptureFixture) -> None:
    path = DATA / "zero3_hpz.json"
    with caplog.at_level(logging.INFO, logger="fsdpx"):
        Config.from_deepspeed(path, world_size=2)
    lines = [r for r in caplog.records if r.name == "fsdpx"]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    assert lines[0].getMessage() == (
        f"DeepSpeed config {path} -> fsdpx Config (world size 2): mapped 9: "
        "train_micro_batch_size_per_gpu, gradient_accumulation_steps, zero_optimization.stage, "
        "zero_optimization.zero_hpz_partition_size, zero_optimization.zero_quantized_weights, "
        "zero_optimization.zero_quantized_gradients, optimizer.type, optimizer.params.lr, "
        "optimizer.params.weight_decay; ignored 1 (FSDP2 manages this itself: "
        "zero_optimization.reduce_bucket_size). "
        f"Full table: fsdpx config explain {path}"
    )


def test_summary_reports_auto_and_written_defaults() -> None:
    tr = translate(DATA / "zero3_bf16_auto.json", world_size=2)
    assert "gradient_clipping (auto: fsdpx default)" in tr.summary
    assert "optimizer.params.betas (auto: fsdpx default)" in tr.summary
    tr = translate({"train_batch_size": 2}, world_size=1)
    assert "DeepSpeed defaults written out: zero_optimization.stage, optimizer" in tr.summary


def test_summary_is_info_on_rank_0_only(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = {
        "train_batch_size": 2,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
    }
    with caplog.at_level(logging.INFO, logger="fsdpx"):
        monkeypatch.setenv("RANK", "1")
        Config.from_deepspeed(data, world_size=2)
        monkeypatch.setenv("RANK", "0")
        Config.from_deepspeed(data, world_size=2)
    assert [r.levelno for r in caplog.records if r.name == "fsdpx"] == [logging.INFO]


def test_hf_style_auto_precision_takes_the_fsdpx_default() -> None:
    tr = translate(
        {
            "train_batch_size": 2,
            "fp16": {"enabled": "auto", "loss_scale": 0},
            "bf16": {"enabled": "auto"},
        },
        world_size=1,
    )
    assert tr.config.precision.param_dtype == "fp32"
    rows = {r.key: r for r in tr.rows}
    assert rows["fp16.enabled"].detail == "'auto' -> false (fsdpx default)"
    assert rows["fp16.loss_scale"].detail == "fp16 is not enabled"
    assert "fp16.enabled (auto: fsdpx default)" in tr.summary
    with pytest.raises(ValueError, match="'bf16.enabled' must be true or false; got 'yes'"):
        translate({"train_batch_size": 2, "bf16": {"enabled": "yes"}}, world_size=1)


def test_monitor_blocks_enable_telemetry() -> None:
    tr = translate(DATA / "zero3_offload_cpu_monitors.json", world_size=2)
    assert tr.config.telemetry.enabled
    rows = {r.key: r for r in tr.rows}
    assert "fsdpx-monitor export" in rows["tensorboard.enabled"].detail
    assert rows["csv_monitor.output_path"].status == "ignored"


def test_explain_keeps_going_past_refusals() -> None:
    rows, cfg, error = explain(
        {"train_batch_size": 1, "optimizer": {"type": "Lion"}, "overlap": 1}, world_size=1
    )
    assert cfg is None and error is not None
    status = {r.key: r.status for r in rows}
    assert status == {
        "train_batch_size": "mapped",
        "optimizer.type": "refused",
        "overlap": "unknown",
        "train_micro_batch_size_per_gpu": "mapped",
        "gradient_accumulation_steps": "mapped",
        "zero_optimization.stage": "mapped",
    }


# --- the hjson subset ---------------------------------------------------------------------


def test_comments_and_trailing_commas_are_stripped_outside_strings() -> None:
    text = '{"a": "x // not a comment, /* nor this */ #", // c\n "b": [1, 2,], /* x\n y */ "c": {"d": 1,},}'
    assert json.loads(strip_comments_and_trailing_commas(text)) == {
        "a": "x // not a comment, /* nor this */ #",
        "b": [1, 2],
        "c": {"d": 1},
    }
    escaped = r'{"p": "C:\\dir\"//x", }'
    assert json.loads(strip_comments_and_trailing_commas(escaped)) == {"p": 'C:\\dir"//x'}


def test_bad_file_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_batch_size": 1 /* open')
    with pytest.raises(
        ValueError, match=r"ds.json: not a valid DeepSpeed config .*unterminated /\* comment"
    ):
        Config.from_deepspeed(bad)
    bad.write_text("{train_batch_size: 1}")
    with pytest.raises(
        ValueError, match=r"ds.json: not a valid DeepSpeed config .*line 1 column 2"
    ):
        Config.from_deepspeed(bad)
    bad.write_text("[1]")
    with pytest.raises(ValueError, match="a DeepSpeed config must be a JSON object; got"):
        Config.from_deepspeed(bad)


def test_world_size_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(
        ValueError, match="WORLD_SIZE environment variable must be an integer; got 'two'"
    ):
        Config.from_deepspeed({"train_batch_size": 1})
    with pytest.raises(ValueError, match="world_size must be >= 1; got 0"):
        Config.from_deepspeed({"train_batch_size": 1}, world_size=0)


@pytest.mark.parametrize(
    ("section", "key"), [("tensor_parallel", "autotp_size"), ("pipeline", "stages")]
)
def test_parallel_size_not_dividing_the_world_is_a_user_error(section: str, key: str) -> None:
    # Regression: the key was filed as "mapped" and then again as the error, tripping an
    # internal assertion ("reported twice") instead of reaching the user.
    data = {"train_micro_batch_size_per_gpu": 1, section: {key: 4}}
    tp, pp = (4, 1) if section == "tensor_parallel" else (1, 4)
    message = (
        rf"{section}\.{key}: world size 6 is not divisible by pipeline stages \({pp}\) x "
        rf"tensor-parallel size \({tp}\); launch a multiple of 4 ranks"
    )
    with pytest.raises(ValueError, match=message):
        Config.from_deepspeed(data, world_size=6)
    rows, cfg, error = explain(data, world_size=6)
    assert cfg is None and error is not None
    assert [r.status for r in rows if r.key == f"{section}.{key}"] == ["error"]


def test_table_rules_are_well_formed() -> None:
    for key, rule in DS_KEYS.items():
        if "." in key:
            assert DS_KEYS[key.rpartition(".")[0]].action == "section", key
        if rule.action == "ignored":
            assert rule.note and rule.tag, key
        if rule.action == "refused":
            assert rule.note, key


def test_sequence_parallel_size_maps_to_mesh_sp_and_divides_the_batch_rule() -> None:
    # 8 ranks, sp 2: 4 data-parallel ranks in DeepSpeed's batch rule (16 = 2 x 2 x 4).
    cfg = Config.from_deepspeed(
        {
            "train_batch_size": 16,
            "train_micro_batch_size_per_gpu": 2,
            "sequence_parallel_size": 2,
        },
        world_size=8,
    )
    assert cfg.mesh.sp == 2
    assert cfg.gradient_accumulation_steps == 2
    with pytest.raises(
        ValueError,
        match=r"world size 6 is not divisible by pipeline stages \(1\) x tensor-parallel size "
        r"\(1\) x sequence-parallel size \(4\); launch a multiple of 4 ranks",
    ):
        Config.from_deepspeed({"train_batch_size": 6, "sequence_parallel_size": 4}, world_size=6)
