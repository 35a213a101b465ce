"""Every config key DeepSpeed accepts has a row in fsdpx's DeepSpeed key table.

The key list, tests/data/deepspeed_<version>_keys.json, was extracted once from DeepSpeed's
own config classes and constants by scripts/extract_deepspeed_keys.py, in a separate
environment with DeepSpeed installed; this test reads only the JSON (fsdpx and its tests
never import deepspeed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fsdpx.config import Config

# After the move into the fsdpx.deepspeed package this is fsdpx.deepspeed._keys.
from fsdpx.deepspeed._keys import DEEPSPEED_VERSION, DS_KEYS, KeyRule

DATA = Path(__file__).parent / "data" / f"deepspeed_{DEEPSPEED_VERSION}_keys.json"


@pytest.fixture(scope="module")
def extracted() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DATA.read_text())
    return data


def _rule(key: str) -> tuple[str, KeyRule] | None:
    """The row the translator reaches for `key`: it walks the key's path and stops at the
    first row that is not a section (a block handled whole covers every key inside it)."""
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        rule = DS_KEYS.get(prefix)
        if rule is None:
            return None
        if rule.action != "section":
            return prefix, rule
    return key, DS_KEYS[key]


def test_data_file_is_for_the_table_version(extracted: dict[str, Any]) -> None:
    assert extracted["deepspeed_version"] == DEEPSPEED_VERSION
    # A sanity floor: the extraction found the big blocks (ZeRO, precision, optimizer).
    keys = extracted["keys"]
    assert len(keys) > 300
    for key in (
        "zero_optimization.offload_param.pin_memory",
        "bf16.bf16_master_weights_and_grads",
        "optimizer.params.bias_correction",
        "scheduler.params.warmup_num_steps",
    ):
        assert key in keys


def test_every_deepspeed_key_has_a_row(extracted: dict[str, Any]) -> None:
    keys = list(extracted["keys"]) + list(extracted["removed"])
    missing = [k for k in keys if _rule(k) is None]
    assert not missing, f"{len(missing)} DeepSpeed keys have no row in DS_KEYS: {missing}"


def test_every_row_says_why(extracted: dict[str, Any]) -> None:
    """Ignored rows carry the reason and a tag, refused rows the reason and what to do
    instead, mapped rows a target or a note; no leaf of the key list ends on a section
    (which would make its value an error)."""
    for key in list(extracted["keys"]) + list(extracted["removed"]):
        found = _rule(key)
        assert found is not None
        where, rule = found
        if rule.action == "section":
            assert extracted["keys"].get(key, {}).get("block"), f"{key}: leaf on a section"
            continue
        assert rule.action in ("mapped", "ignored", "refused"), (key, rule)
        if rule.action == "mapped":
            assert rule.target or rule.note, f"{where}: mapped without target or note"
        elif rule.action == "ignored":
            assert rule.note and rule.tag, f"{where}: ignored without reason/tag"
        else:
            assert len(rule.note) > 20, f"{where}: refused without reason and alternative"


@pytest.mark.parametrize(
    "key,action",
    [
        ("bf16.bf16_master_weights_and_grads", "mapped"),
        ("bf16.bf16_optimizer_states", "mapped"),
        ("compile.deepcompile", "refused"),
        ("hybrid_engine", "refused"),
        ("progressive_layer_drop", "refused"),
        ("zero_optimization.zenflow", "refused"),
        ("torch_autocast.enabled", "mapped"),
        ("optimizer.params.freeze_step", "mapped"),
        ("optimizer.params.bias_correction", "mapped"),
    ],
)
def test_keys_from_issue_14_are_known(key: str, action: str) -> None:
    found = _rule(key)
    assert found is not None and found[1].action == action


def test_removed_keys_are_refused(extracted: dict[str, Any]) -> None:
    """Keys DeepSpeed 0.19.8 itself rejects are never silently accepted by fsdpx, except the
    few fsdpx implements (mics_shard_size -> HSDP)."""
    implemented = {
        "zero_optimization.mics_shard_size",
        "zero_optimization.mics_hierarchical_params_gather",
    }
    for key in extracted["removed"]:
        found = _rule(key)
        assert found is not None
        if key not in implemented:
            assert found[1].action == "refused", key


def test_deepspeed_bias_correction_false_is_mapped(tmp_path: Any) -> None:
    path = tmp_path / "ds.json"
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "bias_correction": False}},
    }
    path.write_text(json.dumps(ds))
    cfg = Config.from_deepspeed(str(path), world_size=1)
    assert cfg.optimizer.bias_correction is False and cfg.optimizer.type == "adamw"
    ds["optimizer"]["params"]["bias_correction"] = True  # type: ignore[index]
    path.write_text(json.dumps(ds))
    assert Config.from_deepspeed(str(path), world_size=1).optimizer.bias_correction is True
