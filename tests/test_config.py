"""fsdpx.config: every user-facing error message, file loading, and property tests that
to_dict/from_dict round-trips any valid Config and that bad input only ever raises
ValueError."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpx.config import (
    SCHEDULER_KEYS,
    ActivationCheckpointConfig,
    Config,
    LossScaleConfig,
    MeshConfig,
    OptimizerConfig,
    PrecisionConfig,
    SchedulerConfig,
    ZeroConfig,
)

SECTION_CLASSES = {
    "mesh": MeshConfig,
    "zero": ZeroConfig,
    "precision": PrecisionConfig,
    "fp16": LossScaleConfig,
    "optimizer": OptimizerConfig,
    "scheduler": SchedulerConfig,
    "activation_checkpointing": ActivationCheckpointConfig,
}
TOP_KEYS = [f.name for f in dataclasses.fields(Config)]


def _bad(data: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Config.from_dict(data)


# --- unknown keys -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (
            {"gradient_acumulation_steps": 2},
            r"^unknown config key 'gradient_acumulation_steps'; "
            r"did you mean 'gradient_accumulation_steps'\?$",
        ),
        ({"zero": {"stag": 2}}, r"^unknown config key 'zero\.stag'; did you mean 'zero\.stage'\?$"),
        (
            {"scheduler": {"warmup_num_step": 2}},
            r"did you mean 'scheduler\.warmup_num_steps'\?",
        ),
        (
            {"zero": {"xyz": 1}},
            r"^unknown config key 'zero\.xyz'; known keys here: "
            r"stage, hpz_partition_size, quantized_weights, quantized_weights_dtype, "
            r"quantized_gradients, quantized_gradients_bits, quantized_gradients_hierarchical, "
            r"quantized_gradients_node_size, quantization_block_size, "
            r"block_classes, offload_optimizer, offload_param$",
        ),
        ({"qqq": 1}, r"^unknown config key 'qqq'; known keys here: " + ", ".join(TOP_KEYS) + "$"),
        ({7: 1}, r"^unknown config key '7'; known keys here: "),
    ],
)
def test_unknown_keys(data: dict[str, Any], match: str) -> None:
    _bad(data, match)


# --- types ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "match"),
    [
        # bool is an int subclass: True must not pass as stage 1, nor 1.0 or "1".
        (
            {"zero": {"stage": True}},
            r"^config key 'zero\.stage' must be one of 0, 1, 2, 3; got True$",
        ),
        ({"zero": {"stage": 1.0}}, r"'zero\.stage' must be one of 0, 1, 2, 3; got 1\.0$"),
        ({"zero": {"stage": "1"}}, r"'zero\.stage' must be one of 0, 1, 2, 3; got '1'$"),
        ({"zero": {"stage": 4}}, r"'zero\.stage' must be one of 0, 1, 2, 3; got 4$"),
        (
            {"gradient_accumulation_steps": True},
            r"^config key 'gradient_accumulation_steps' must be an integer; got True$",
        ),
        ({"gradient_accumulation_steps": 2.0}, r"must be an integer; got 2\.0$"),
        ({"mesh": {"tp": "2"}}, r"^config key 'mesh\.tp' must be an integer; got '2'$"),
        (
            {"optimizer": {"lr": "1e-3"}},
            r"^config key 'optimizer\.lr' must be a number; got '1e-3'$",
        ),
        ({"optimizer": {"lr": False}}, r"'optimizer\.lr' must be a number; got False$"),
        ({"gradient_clipping": None}, r"'gradient_clipping' must be a number; got None$"),
        ({"timeout_s": float("inf")}, r"^config key 'timeout_s' must be a finite number; got inf$"),
        ({"optimizer": {"lr": float("nan")}}, r"'optimizer\.lr' must be a finite number; got nan$"),
        ({"optimizer": {"lr": 10**400}}, r"'optimizer\.lr' must be a finite number; got 1000"),
        ({"compile": "yes"}, r"^config key 'compile' must be true or false; got 'yes'$"),
        ({"compile": 1}, r"'compile' must be true or false; got 1$"),
        (
            {"optimizer": {"betas": [0.9]}},
            r"^config key 'optimizer\.betas' must have 2 items; got \[0\.9\]$",
        ),
        ({"optimizer": {"betas": [0.9, 0.99, 0.5]}}, r"'optimizer\.betas' must have 2 items"),
        (
            {"optimizer": {"betas": 0.9}},
            r"^config key 'optimizer\.betas' must be a list; got 0\.9$",
        ),
        ({"optimizer": {"betas": ["a", 0.9]}}, r"'optimizer\.betas' must be a number; got 'a'$"),
        (
            {"zero": {"block_classes": "Block"}},
            r"'zero\.block_classes' must be a list; got 'Block'$",
        ),
        (
            {"zero": {"block_classes": ["Block", 3]}},
            r"'zero\.block_classes' must be a string; got 3$",
        ),
        ({"scheduler": {"warmup_max_lr": "x"}}, r"'scheduler\.warmup_max_lr' must be a number"),
        ({"zero": 3}, r"^config key 'zero' must be a table/object; got 3$"),
        ({"mesh": [1, 2]}, r"^config key 'mesh' must be a table/object; got \[1, 2\]$"),
    ],
)
def test_wrong_types(data: dict[str, Any], match: str) -> None:
    _bad(data, match)


@pytest.mark.parametrize("data", [[], None, "zero", 3])
def test_top_level_must_be_a_table(data: Any) -> None:
    with pytest.raises(ValueError, match=r"^a config must be a table/object of keys"):
        Config.from_dict(data)


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("precision.param_dtype", "float16", "'fp32', 'bf16', 'fp16'"),
        ("precision.reduce_dtype", "fp8", "'fp32', 'bf16', 'fp16'"),
        (
            "optimizer.type",
            "lion",
            "'adamw', 'adam', 'sgd', 'onebit_adam', 'lamb', 'zero_one_adam', 'onebit_lamb'",
        ),
        (
            "scheduler.type",
            "cosine",
            "'none', 'WarmupLR', 'WarmupDecayLR', 'WarmupCosineLR', 'OneCycle'",
        ),
        ("scheduler.warmup_type", "exp", "'log', 'linear'"),
        ("activation_checkpointing.mode", "all", "'none', 'full', 'every_n', 'selective'"),
        ("device", "tpu", "'auto', 'cpu', 'cuda'"),
    ],
)
def test_literal_lists_the_allowed_values(key: str, value: str, allowed: str) -> None:
    section, _, name = key.rpartition(".")
    data: dict[str, Any] = {section: {name: value}} if section else {name: value}
    _bad(
        data, rf"^config key '{re.escape(key)}' must be one of {re.escape(allowed)}; got '{value}'$"
    )


# --- __post_init__ range checks ---------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"train_micro_batch_size_per_gpu": 0}, r"^config key 'train_micro_batch_size_per_gpu' must be an integer >= 1; got 0$"),
        ({"gradient_accumulation_steps": 0}, r"'gradient_accumulation_steps' must be an integer >= 1; got 0$"),
        ({"gradient_clipping": -1.0}, r"'gradient_clipping' must be >= 0 \(0 disables clipping\); got -1\.0$"),
        ({"timeout_s": 0}, r"'timeout_s' must be > 0 seconds; got 0\.0$"),
        ({"mesh": {"dp_replicate": 0}}, r"^config key 'mesh\.dp_replicate' must be an integer >= 1; got 0$"),
        ({"mesh": {"tp": 0}}, r"'mesh\.tp' must be an integer >= 1; got 0$"),
        ({"mesh": {"pp": -1}}, r"'mesh\.pp' must be an integer >= 1; got -1$"),
        ({"mesh": {"dp_shard": 0}}, r"'mesh\.dp_shard' must be an integer >= 1, or -1 to infer it from the world size; got 0$"),
        ({"mesh": {"dp_shard": -2}}, r"'mesh\.dp_shard' must be .* or -1 to infer it .*; got -2$"),
        ({"zero": {"hpz_partition_size": 0}}, r"'zero\.hpz_partition_size' must be an integer >= 1; got 0$"),
        (
            {"zero": {"stage": 2, "hpz_partition_size": 2}},
            r"^config key 'zero\.hpz_partition_size' \(2\) needs zero\.stage 3; got stage 2\. "
            r"Set stage 3 or drop hpz_partition_size\.$",
        ),
        ({"fp16": {"static_scale": -1}}, r"'fp16\.static_scale' must be >= 0; got -1\.0$"),
        ({"fp16": {"window": 0}}, r"'fp16\.window' must be an integer >= 1; got 0$"),
        ({"fp16": {"hysteresis": 0}}, r"'fp16\.hysteresis' must be an integer >= 1; got 0$"),
        ({"fp16": {"min_scale": 0}}, r"'fp16\.min_scale' must be > 0; got 0\.0$"),
        ({"fp16": {"initial_scale_power": 65}}, r"'fp16\.initial_scale_power' must be an integer in \[0, 64\]; got 65$"),
        ({"fp16": {"initial_scale_power": -1}}, r"'fp16\.initial_scale_power' .*; got -1$"),
        ({"optimizer": {"lr": -1}}, r"^config key 'optimizer\.lr' must be >= 0; got -1\.0$"),
        ({"optimizer": {"betas": [1.0, 0.9]}}, r"'optimizer\.betas' must be two numbers in \[0, 1\); got \(1\.0, 0\.9\)$"),
        ({"optimizer": {"betas": [0.9, -0.1]}}, r"'optimizer\.betas' must be two numbers in \[0, 1\)"),
        ({"optimizer": {"eps": -1e-8}}, r"'optimizer\.eps' must be >= 0; got -1e-08$"),
        ({"optimizer": {"weight_decay": -0.1}}, r"'optimizer\.weight_decay' must be >= 0; got -0\.1$"),
        ({"optimizer": {"type": "sgd", "momentum": -0.5}}, r"'optimizer\.momentum' must be >= 0; got -0\.5$"),
        ({"activation_checkpointing": {"mode": "every_n", "every_n": 0}}, r"'activation_checkpointing\.every_n' must be an integer >= 1; got 0$"),
    ],
)  # fmt: skip
def test_range_checks(data: dict[str, Any], match: str) -> None:
    _bad(data, match)


def _sched(**kw: Any) -> None:
    Config.from_dict({"scheduler": kw})


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        # The schedules treat 1 like 2 (DeepSpeed's max(2, n)); DeepSpeed rejects <= 0.
        ({"type": "WarmupLR", "warmup_num_steps": 0}, r"^config key 'scheduler\.warmup_num_steps' must be an integer >= 1 \(1 acts as 2, as in DeepSpeed\); got 0$"),
        ({"type": "WarmupCosineLR", "total_num_steps": 9, "warmup_num_steps": -3}, r"'scheduler\.warmup_num_steps' must be an integer >= 1 .*; got -3$"),
        ({"type": "WarmupDecayLR"}, r"^config key 'scheduler\.total_num_steps' is required for WarmupDecayLR; set it to the number of optimizer steps of the run$"),
        ({"type": "WarmupCosineLR", "total_num_steps": None}, r"'scheduler\.total_num_steps' is required for WarmupCosineLR"),
        ({"type": "WarmupDecayLR", "warmup_num_steps": 10, "total_num_steps": 10}, r"^config key 'scheduler\.total_num_steps' must be greater than scheduler\.warmup_num_steps \(10\); got 10$"),
        ({"type": "WarmupCosineLR", "warmup_num_steps": 10, "total_num_steps": 9}, r"must be greater than scheduler\.warmup_num_steps \(10\) or equal to it; got 9$"),
        ({"type": "WarmupLR", "warmup_min_lr": -0.1}, r"'scheduler\.warmup_min_lr' must be >= 0; got -0\.1$"),
        ({"type": "WarmupLR", "warmup_max_lr": -0.1}, r"'scheduler\.warmup_max_lr' must be >= 0, or null for the optimizer lr; got -0\.1$"),
        ({"type": "WarmupCosineLR", "total_num_steps": 5000, "warmup_min_ratio": -1}, r"'scheduler\.warmup_min_ratio' must be >= 0; got -1\.0$"),
        ({"type": "WarmupCosineLR", "total_num_steps": 5000, "cos_min_ratio": -1}, r"'scheduler\.cos_min_ratio' must be >= 0; got -1\.0$"),
        ({"type": "OneCycle", "cycle_min_lr": -1}, r"'scheduler\.cycle_min_lr' must be >= 0; got -1\.0$"),
        ({"type": "OneCycle", "cycle_max_lr": -1}, r"'scheduler\.cycle_max_lr' must be >= 0, or null for the optimizer lr; got -1\.0$"),
        ({"type": "OneCycle", "cycle_first_step_size": 0}, r"'scheduler\.cycle_first_step_size' must be an integer >= 1; got 0$"),
        ({"type": "OneCycle", "cycle_second_step_size": 0}, r"'scheduler\.cycle_second_step_size' must be an integer >= 1, or null to reuse cycle_first_step_size; got 0$"),
        ({"type": "OneCycle", "cycle_first_stair_count": -1}, r"'scheduler\.cycle_first_stair_count' must be an integer >= 0 \(0: no stairs\); got -1$"),
        ({"type": "OneCycle", "cycle_second_stair_count": -1}, r"'scheduler\.cycle_second_stair_count' must be an integer >= 0, or null to reuse cycle_first_stair_count; got -1$"),
        ({"type": "OneCycle", "decay_lr_rate": -1}, r"'scheduler\.decay_lr_rate' must be >= 0; got -1\.0$"),
        ({"type": "OneCycle", "decay_step_size": -1}, r"'scheduler\.decay_step_size' must be an integer >= 0 \(0: no decay\); got -1$"),
    ],
)  # fmt: skip
def test_scheduler_range_checks(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _sched(**kw)


def test_scheduler_warmup_boundaries_pass() -> None:
    _sched(type="WarmupLR", warmup_num_steps=1)
    _sched(type="WarmupDecayLR", warmup_num_steps=1, total_num_steps=2)
    _sched(type="WarmupCosineLR", warmup_num_steps=10, total_num_steps=10)
    _sched(type="OneCycle", cycle_second_step_size=None, cycle_second_stair_count=None)


# --- keys the chosen variant does not read ----------------------------------------------


@pytest.mark.parametrize(
    ("section", "kw", "match"),
    [
        (
            "scheduler",
            {"type": "WarmupCosineLR", "total_num_steps": 2000, "warmup_max_lr": 0.5},
            r"^config key 'scheduler\.warmup_max_lr' \(0\.5\) set, but scheduler\.type "
            r"'WarmupCosineLR' does not read it; 'WarmupCosineLR' reads: cos_min_ratio, "
            r"total_num_steps, warmup_min_ratio, warmup_num_steps, warmup_type\. Remove the "
            r"key, or set scheduler\.type to one that uses it\.$",
        ),
        (
            "scheduler",
            {"type": "OneCycle", "total_num_steps": 100},
            r"'scheduler\.total_num_steps' \(100\) set, but scheduler\.type 'OneCycle' does not",
        ),
        (
            "scheduler",
            {"type": "WarmupLR", "cycle_min_lr": 0.1, "cos_min_ratio": 0.5},
            r"^config keys 'scheduler\.cos_min_ratio' \(0\.5\), 'scheduler\.cycle_min_lr' "
            r"\(0\.1\) set, but scheduler\.type 'WarmupLR' does not read them;",
        ),
        (
            # type none reads nothing: warmup settings without a schedule are a mistake,
            # and warmup_num_steps 0 is reported as unread before its range is checked.
            "scheduler",
            {"warmup_num_steps": 0},
            r"'scheduler\.warmup_num_steps' \(0\) set, but scheduler\.type 'none' does not "
            r"read it; 'none' reads: no keys\.",
        ),
        (
            "optimizer",
            {"momentum": 0.9},
            r"^config key 'optimizer\.momentum' \(0\.9\) set, but optimizer\.type 'adamw' does "
            r"not read it; 'adamw' reads: betas, bias_correction, eps, lr, weight_decay\.",
        ),
        (
            "optimizer",
            {"type": "sgd", "betas": [0.8, 0.9], "eps": 1e-6},
            r"keys 'optimizer\.betas' \(\(0\.8, 0\.9\)\), 'optimizer\.eps' \(1e-06\) set, but "
            r"optimizer\.type 'sgd' does not read them; 'sgd' reads: lr, momentum, weight_decay",
        ),
        (
            "activation_checkpointing",
            {"mode": "full", "every_n": 3},
            r"'activation_checkpointing\.every_n' \(3\) set, but activation_checkpointing\.mode "
            r"'full' does not read it; 'full' reads: no keys\.",
        ),
    ],
)
def test_unread_keys_are_errors(section: str, kw: dict[str, Any], match: str) -> None:
    _bad({section: kw}, match)


def test_unread_keys_at_their_defaults_pass() -> None:
    # to_dict writes every key, so from_dict must accept unread keys left at their defaults.
    cfg = Config.from_dict(
        {
            "scheduler": {"type": "OneCycle", "warmup_num_steps": 1000, "total_num_steps": None},
            "optimizer": {"type": "sgd", "betas": [0.9, 0.999]},
            "activation_checkpointing": {"mode": "full", "every_n": 2},
        }
    )
    assert cfg.scheduler.type == "OneCycle" and cfg.optimizer.type == "sgd"


def test_scheduler_keys_cover_every_field() -> None:
    names = {f.name for f in dataclasses.fields(SchedulerConfig)} - {"type"}
    assert set().union(*SCHEDULER_KEYS.values()) == names
    assert set(SCHEDULER_KEYS) == set(
        typing.get_args(typing.get_type_hints(SchedulerConfig)["type"])
    )


# --- from_file --------------------------------------------------------------------------

GOOD = {
    "gradient_accumulation_steps": 4,
    "zero": {"stage": 2, "block_classes": ["Block"]},
    "optimizer": {"type": "adamw", "lr": 3e-4, "betas": [0.9, 0.95]},
    "scheduler": {"type": "WarmupDecayLR", "warmup_num_steps": 10, "total_num_steps": 100},
}
GOOD_TOML = """
gradient_accumulation_steps = 4

[zero]
stage = 2
block_classes = ["Block"]

[optimizer]
type = "adamw"
lr = 3e-4
betas = [0.9, 0.95]

[scheduler]
type = "WarmupDecayLR"
warmup_num_steps = 10
total_num_steps = 100
"""


def test_from_file_json_and_toml(tmp_path: Path) -> None:
    want = Config.from_dict(GOOD)
    assert want.zero.block_classes == ("Block",) and want.optimizer.betas == (0.9, 0.95)
    (tmp_path / "c.json").write_text(json.dumps(GOOD))
    (tmp_path / "c.toml").write_text(GOOD_TOML)
    assert Config.from_file(tmp_path / "c.json") == want
    assert Config.from_file(str(tmp_path / "c.toml")) == want


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("bad.json", '{"zero": {"stage": 2,}}', r"bad\.json: not valid JSON: Expecting"),
        ("bad.toml", "[zero]\nstage = ", r"bad\.toml: not valid TOML: "),
        ("big.json", '{"seed": ' + "9" * 5000 + "}", r"big\.json: not valid JSON: "),
        ("typo.json", '{"zero": {"stag": 2}}', r"typo\.json: unknown config key 'zero\.stag'"),
        ("typo.toml", "[zero]\nstage = true\n", r"typo\.toml: config key 'zero\.stage' must be"),
        ("list.json", "[1, 2]", r"list\.json: a config must be a table/object"),
        ("c.yaml", "zero: {stage: 2}", r"c\.yaml: config files must end in \.json or \.toml; got suffix '\.yaml'"),
    ],
)  # fmt: skip
def test_from_file_errors_name_the_file(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + ".*" + match):
        Config.from_file(path)


def test_from_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_bytes(b'{"seed": "\xff"}')
    with pytest.raises(ValueError, match=r"c\.json: not UTF-8 text"):
        Config.from_file(path)


# --- property tests ---------------------------------------------------------------------

nonneg = st.floats(0.0, 1e6, allow_nan=False, allow_infinity=False)
pos_int = st.integers(1, 10**9)
unit = st.floats(0.0, 1.0, exclude_max=True, allow_nan=False)

SCHEDULER_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "warmup_min_lr": nonneg,
    "warmup_max_lr": st.none() | nonneg,
    "warmup_num_steps": st.integers(1, 10**6),
    "warmup_type": st.sampled_from(["log", "linear"]),
    "warmup_min_ratio": nonneg,
    "cos_min_ratio": nonneg,
    "cycle_min_lr": nonneg,
    "cycle_max_lr": st.none() | nonneg,
    "decay_lr_rate": nonneg,
    "cycle_first_step_size": pos_int,
    "cycle_second_step_size": st.none() | pos_int,
    "cycle_first_stair_count": st.integers(0, 100),
    "cycle_second_stair_count": st.none() | st.integers(0, 100),
    "decay_step_size": st.integers(0, 10**6),
}


@st.composite
def schedulers(draw: st.DrawFn) -> SchedulerConfig:
    kind: Any = draw(st.sampled_from(sorted(SCHEDULER_KEYS)))
    kw: dict[str, Any] = {
        k: draw(SCHEDULER_VALUES[k]) for k in sorted(SCHEDULER_KEYS[kind]) if k in SCHEDULER_VALUES
    }
    if "total_num_steps" in SCHEDULER_KEYS[kind]:
        kw["total_num_steps"] = kw.get("warmup_num_steps", 1000) + draw(st.integers(1, 10**6))
    return SchedulerConfig(type=kind, **kw)


@st.composite
def optimizers(draw: st.DrawFn) -> OptimizerConfig:
    kind: Any = draw(st.sampled_from(["adamw", "adam", "sgd"]))
    kw: dict[str, Any] = {"lr": draw(nonneg), "weight_decay": draw(nonneg)}
    if kind == "sgd":
        kw["momentum"] = draw(unit)
    else:
        kw["betas"] = (draw(unit), draw(unit))
        kw["eps"] = draw(nonneg)
    return OptimizerConfig(type=kind, **kw)


@st.composite
def zeros(draw: st.DrawFn) -> ZeroConfig:
    stage: Any = draw(st.sampled_from([0, 1, 2, 3]))
    return ZeroConfig(
        stage=stage,
        hpz_partition_size=draw(st.integers(1, 64)) if stage == 3 else 1,
        block_classes=tuple(draw(st.lists(st.text(min_size=1, max_size=12), max_size=3))),
    )


@st.composite
def activation_checkpointing(draw: st.DrawFn) -> ActivationCheckpointConfig:
    mode: Any = draw(st.sampled_from(["none", "full", "every_n", "selective"]))
    return ActivationCheckpointConfig(mode, every_n=draw(pos_int) if mode == "every_n" else 2)


dtypes = st.sampled_from(["fp32", "bf16", "fp16"])
configs = st.builds(
    Config,
    train_micro_batch_size_per_gpu=pos_int,
    gradient_accumulation_steps=pos_int,
    gradient_clipping=nonneg,
    mesh=st.builds(
        MeshConfig,
        dp_replicate=pos_int,
        dp_shard=st.just(-1) | pos_int,
        tp=pos_int,
        pp=pos_int,
    ),
    zero=zeros(),
    precision=st.builds(PrecisionConfig, param_dtype=dtypes, reduce_dtype=dtypes),
    fp16=st.builds(
        LossScaleConfig,
        static_scale=nonneg,
        initial_scale_power=st.integers(0, 64),
        window=pos_int,
        hysteresis=pos_int,
        consecutive_hysteresis=st.booleans(),
        min_scale=st.floats(1e-6, 1e6),
    ),
    optimizer=optimizers(),
    scheduler=schedulers(),
    activation_checkpointing=activation_checkpointing(),
    device=st.sampled_from(["auto", "cpu", "cuda"]),
    seed=st.integers(-(2**63), 2**63 - 1),
    timeout_s=st.floats(1e-3, 1e9),
    compile=st.booleans(),
)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
# Values that get past the type checks more often than arbitrary JSON does.
near_values = (
    json_values
    | st.integers(-3, 3)
    | st.sampled_from(["none", "fp16", "sgd", "OneCycle", "every_n", "linear", "Block"])
    | st.lists(st.floats(-1, 2), max_size=3)
)


@settings(max_examples=100, deadline=None)
@given(cfg=configs)
def test_round_trip_property(cfg: Config) -> None:
    assert Config.from_dict(cfg.to_dict()) == cfg
    # Through JSON as well: tuples come back as lists, ints written for floats stay exact.
    assert Config.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@settings(max_examples=100, deadline=None)
@given(cfg=configs, data=st.data())
def test_junk_key_always_raises_value_error(cfg: Config, data: st.DataObject) -> None:
    d = cfg.to_dict()
    section = data.draw(st.sampled_from([None, *SECTION_CLASSES]), label="section")
    target = d if section is None else d[section]
    junk = data.draw(st.text(max_size=20).filter(lambda k: k not in target), label="junk")
    target[junk] = data.draw(json_values, label="value")
    where = junk if section is None else f"{section}.{junk}"
    with pytest.raises(ValueError, match=rf"^unknown config key '{re.escape(where)}'"):
        Config.from_dict(d)


@st.composite
def near_configs(draw: st.DrawFn) -> dict[str, Any]:
    """Dicts keyed mostly by real field names at every level, with arbitrary values."""
    out: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(TOP_KEYS) | st.text(max_size=6), max_size=6)):
        cls = SECTION_CLASSES.get(key)
        if cls is not None and draw(st.booleans()):
            names = [f.name for f in dataclasses.fields(cls)]
            keys = draw(st.lists(st.sampled_from(names) | st.text(max_size=6), max_size=6))
            out[key] = {k: draw(near_values) for k in keys}
        else:
            out[key] = draw(near_values)
    return out


@settings(max_examples=300, deadline=None)
@given(data=json_values | near_configs())
def test_arbitrary_input_only_raises_value_error(data: Any) -> None:
    # TypeError, KeyError, AttributeError, OverflowError... must never escape from_dict.
    try:
        cfg = Config.from_dict(data)
    except ValueError:
        return
    assert isinstance(cfg, Config)


@settings(max_examples=200, deadline=None)
@given(cfg=configs, data=st.data())
def test_one_bad_value_anywhere_only_raises_value_error(cfg: Config, data: st.DataObject) -> None:
    d = cfg.to_dict()
    section = data.draw(st.sampled_from([None, *SECTION_CLASSES]), label="section")
    target = d if section is None else d[section]
    key = data.draw(st.sampled_from(sorted(target)), label="key")
    target[key] = data.draw(near_values, label="value")
    with contextlib.suppress(ValueError):
        Config.from_dict(d)


def test_tensor_parallel_plan_is_a_table_of_strings() -> None:
    cfg = Config.from_dict({"tensor_parallel": {"plan": {"blocks.*.attn.q": "colwise"}}})
    assert cfg.tensor_parallel.plan == {"blocks.*.attn.q": "colwise"}
    with pytest.raises(ValueError, match=r"^config key 'tensor_parallel.plan' must be a table"):
        Config.from_dict({"tensor_parallel": {"plan": ["colwise"]}})
    with pytest.raises(
        ValueError, match=r"^config key 'tensor_parallel.plan.a' must be a string; got 3$"
    ):
        Config.from_dict({"tensor_parallel": {"plan": {"a": 3}}})


def test_nvme_offload_needs_a_path() -> None:
    with pytest.raises(ValueError, match=r"^offload device 'nvme' needs 'nvme_path'"):
        Config.from_dict({"zero": {"offload_optimizer": {"device": "nvme"}}})


@pytest.mark.parametrize(
    ("zero", "extra", "optimizer", "message"),
    [
        (
            {"offload_param": {"device": "nvme", "nvme_path": "/x"}},
            {},
            None,
            r"zero.offload_param.device='nvme' is not supported: parameters offload to 'cpu' only",
        ),
        (
            {"stage": 2, "offload_param": {"device": "cpu"}},
            {},
            None,
            r"zero.offload_param needs zero.stage 3 \(as in DeepSpeed\), got stage 2",
        ),
        (
            {"offload_optimizer": {"device": "cpu"}},
            {},
            lambda ps: None,
            r"pass optimizer=None and set cfg.optimizer \(type 'adam' or 'adamw'\)",
        ),
        (
            {"offload_optimizer": {"device": "cpu"}},
            {"optimizer": {"type": "sgd"}},
            None,
            r"offload supports optimizer.type 'adam' and 'adamw' .* got 'sgd'",
        ),
        (
            {"offload_optimizer": {"device": "cpu"}},
            {"mesh": {"tp": 2}},
            None,
            r"supported with data parallelism only, got mesh.tp=2, mesh.pp=1",
        ),
    ],
)
def test_offload_settings_fsdpx_cannot_honour_are_refused_before_sharding(
    zero: dict, extra: dict, optimizer: object, message: str
) -> None:
    import torch

    import fsdpx

    cfg = Config.from_dict({"zero": zero, **extra})
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=message):
        fsdpx.shard(model, cfg, optimizer=optimizer)  # type: ignore[arg-type]
    assert not hasattr(model, "_get_fsdp_state")  # nothing was sharded
