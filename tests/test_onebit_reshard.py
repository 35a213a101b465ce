"""The 1-bit optimizers (1-bit Adam, 0/1 Adam, 1-bit Lamb) resumed at another world size,
4 -> 2 and 2 -> 4 ranks, saved after their compressed phase started: everything but the
per-rank error feedback loads exactly, the feedback restarts at zero with a warning on
rank 0 ([Note: per-rank optimizer state at another world size] in
fsdpx/checkpoint/state.py), and training goes on with buffers sized for the new world,
the replicas equal."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import fsdpx
from fsdpx.comm.onebit import padded_numel
from tests import ckpt_bodies
from tests.dist import run_ranks
from tests.test_resume_optimizers import CASES as RESUME_CASES

# Saved at step 2: after 1-bit Adam's / 1-bit Lamb's first compressed exchange and at a
# 0/1 Adam synchronisation (frozen from step 2), so every rank holds live error feedback.
CASES = {k: v for k, v in RESUME_CASES.items() if k != "bf16_masters"}
AT, MORE = 2, 2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _save(root: str, tag: str) -> dict[str, Any]:
    out = {}
    for name, cfg in CASES.items():
        engine = fsdpx.shard(ckpt_bodies.gpt(), fsdpx.Config.from_dict(cfg))
        torch.manual_seed(100 + torch.distributed.get_rank())
        ckpt_bodies._train(engine, AT)
        live = engine.optimizer.rank_local_state()  # type: ignore[attr-defined]
        engine.save_checkpoint(Path(root) / tag / name)
        engine.wait_for_checkpoint()
        out[name] = {"state": ckpt_bodies.full_state(engine), "live": bool(live)}
    return out


def _load(root: str, tag: str) -> dict[str, Any]:
    out = {}
    records = _Records()
    logging.getLogger("fsdpx").addHandler(records)
    try:
        for name, cfg in CASES.items():
            engine = fsdpx.shard(ckpt_bodies.gpt(seed=7), fsdpx.Config.from_dict(cfg))
            records.messages.clear()
            engine.load_checkpoint(Path(root) / tag / name)
            optimizer: Any = engine.optimizer
            loaded = ckpt_bodies.full_state(engine)
            after_load = optimizer.rank_local_state()
            warnings = [m for m in records.messages if "error feedback" in m]
            torch.manual_seed(200 + torch.distributed.get_rank())
            losses = ckpt_bodies._train(engine, MORE)
            out[name] = {
                "loaded": loaded,
                "after_load": after_load,
                "warnings": warnings,
                "losses": losses,
                "final": ckpt_bodies.full_state(engine),
                "buffers": {k: v.numel() for k, v in optimizer.rank_local_state().items()},
                "numels": [p.numel() for g in optimizer.param_groups for p in g["params"]],
            }
    finally:
        logging.getLogger("fsdpx").removeHandler(records)
    return out


def save_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return _save(root, "from2")


def load_body_from2(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return _load(root, "from2")


def load_and_save_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return {"loaded": _load(root, "from2"), "saved": _save(root, "from4")}


def load_body(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return _load(root, "from4")


def _check(saved: list[dict[str, Any]], loaded: list[dict[str, Any]], old: int) -> None:
    new = len(loaded)
    for case in CASES:
        assert all(s[case]["live"] for s in saved), case  # there was feedback to lose
        reference = saved[0][case]["state"]
        for s in saved[1:]:  # the replicas agree at the save (0/1 Adam: a synchronisation)
            assert all(torch.equal(s[case]["state"][k], v) for k, v in reference.items()), case
        for rank, got in enumerate(loaded):
            r = got[case]
            assert r["loaded"].keys() == reference.keys(), case
            differ = [k for k, v in reference.items() if not torch.equal(r["loaded"][k], v)]
            assert not differ, (case, differ)
            assert r["after_load"] == {}, case  # the feedback restarts at zero
            if rank == 0:
                assert len(r["warnings"]) == 1, (case, r["warnings"])
                assert f"saved by {old} ranks, this job has {new}" in r["warnings"][0]
                assert "restarts at zero" in r["warnings"][0]
            else:
                assert r["warnings"] == [], case
            assert all(torch.isfinite(torch.tensor(r["losses"]))), case
            # Buffers rebuilt for the new world: the worker buffers padded to 8 * new ranks.
            worker = sorted(v for k, v in r["buffers"].items() if k.endswith("worker_error"))
            if case == "onebit_lamb_compressed":  # one exchange of all momenta together
                expected = [padded_numel(sum(r["numels"]), new)]
            else:
                expected = sorted(padded_numel(n, new) for n in r["numels"])
            assert worker == expected, case
        final = loaded[0][case]["final"]
        for other in loaded[1:]:
            assert all(torch.equal(other[case]["final"][k], v) for k, v in final.items()), case


def test_resume_on_three_ranks_of_two_ranks_restarts_only_the_error_feedback(
    tmp_path: Any,
) -> None:
    """The default-tier twin of the slow 2 -> 4 -> 2 test below: 3 ranks pad the buffers
    to 24-element units where 2 ranks padded to 16."""
    root = str(tmp_path)
    two = run_ranks(save_body, 2, (root,))
    three = run_ranks(load_body_from2, 3, (root,))
    _check(two, three, old=2)


@pytest.mark.slow
def test_resume_at_another_world_size_restarts_only_the_error_feedback(tmp_path: Any) -> None:
    """2 -> 4 and 4 -> 2 ranks, the sizes DeepSpeed users move between."""
    root = str(tmp_path)
    two = run_ranks(save_body, 2, (root,))
    four = run_ranks(load_and_save_body, 4, (root,))
    back = run_ranks(load_body, 2, (root,))
    _check(two, [r["loaded"] for r in four], old=2)
    _check([r["saved"] for r in four], back, old=4)
