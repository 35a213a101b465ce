"""Crash consistency and the user-facing load errors.

Trials SIGKILL one of two ranks at a random point of a save: at the k-th file-system
operation of the save path (uniform, or among the last ones: the commit), or after a
random delay (tests/ckpt_bodies.py). The checkpoint `latest` names must always be
complete, verify, hold exactly what was saved, and load into a fresh engine. 24 trials run by default, 100 more with `pytest -m slow`.
Also: loading without `latest`, a corrupt newest checkpoint, and keep_last retention
(single process, plain modules, through the function API).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import random
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fsdpx.checkpoint as ckpt
from checkpoint_tools.format import CheckpointCorruptError, CheckpointNotFoundError
from tests import ckpt_bodies
from tests.dist import run_ranks


def _trials(tmp: Path, n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        d = tmp / f"t{i}"
        d.mkdir()
        out.append(
            {
                "root": str(d / "ckpt"),
                "store": str(d / "store"),
                "expected": str(d / "expected.pt"),
                # "commit" kills rank 0 within the last file-system operations of the
                # save (MANIFEST, renames, `latest`), which uniform picks rarely hit.
                "mode": ("op", "commit", "delay")[i % 3],
                "victim": 0 if i % 3 == 1 else rng.randrange(2),
                "seed": rng.randrange(2**32),
            }
        )
    return out


def _run_trials(trials: list[dict[str, Any]], tmp: Path) -> list[dict[str, Any]]:
    out = tmp / "trials.pt"
    proc = mp.get_context("spawn").Process(target=ckpt_bodies.crash_main, args=(trials, str(out)))
    proc.start()
    proc.join(900)
    if proc.is_alive():
        proc.kill()
        proc.join()
    assert proc.exitcode == 0, f"crash orchestrator exited with {proc.exitcode}"
    return torch.load(out, weights_only=False)


def _check(trials: list[dict[str, Any]]) -> None:
    for t in trials:
        where = f"trial {t['mode']} victim={t['victim']} seed={t['seed']}: {t}"
        assert t["problems"] == [], where
        assert t["latest"] in ("global_step1", "global_step2"), where
        # Only complete checkpoints and leftover temp dirs: nothing else looks committed.
        for name in t["dirs"]:
            assert name in ("global_step1", "global_step2", "latest") or ".tmp-" in name, where
    # The kills did land: most trials lost the second save, and the victim died by SIGKILL.
    assert sum(t["latest"] == "global_step1" for t in trials) >= len(trials) // 3
    assert sum(-9 in t["exitcodes"] for t in trials) >= len(trials) // 2
    loaded = run_ranks(ckpt_bodies.load_latest_body, 2, (trials,))
    assert loaded[0] == [True] * len(trials) and loaded[1] == loaded[0]


def test_kill_during_save_never_breaks_latest(tmp_path: Path) -> None:
    _check(_run_trials(_trials(tmp_path, 24, seed=2024), tmp_path))


@pytest.mark.slow
def test_kill_during_save_many_trials(tmp_path: Path) -> None:
    _check(_run_trials(_trials(tmp_path, 100, seed=7), tmp_path))


def test_one_rank_failing_makes_every_rank_raise(tmp_path: Path) -> None:
    results = run_ranks(ckpt_bodies.one_rank_fails_body, 2, (str(tmp_path),))
    assert results[1]["save"] == ("OSError", "disk full (injected on rank 1)")
    kind, message = results[0]["save"]
    assert kind == "CheckpointError"
    assert re.search(r"rank 1 failed to save .*OSError: disk full.*nothing was committed", message)
    # Nothing of the failed save is left, and `latest` still names the good one.
    assert results[0]["dirs"] == results[1]["dirs"] == ["good", "latest"]
    # Loading: the same error type and message on both ranks (rank 1's, with its rank).
    assert results[0]["load"] == results[1]["load"]
    kind, message, offset = results[0]["load"]
    assert kind == "CheckpointCorruptError" and offset == 7
    assert re.search(r"injected on rank 1.*\(rank 1 of 2\)$", message), message


def test_a_directory_not_shared_by_every_rank_is_refused_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(ckpt_bodies.unshared_dir_body, 2, (str(tmp_path),))
    for rank, result in enumerate(results):  # each rank names the directory it was given
        kind, message = result["save"]
        assert kind == "CheckpointError"
        mine = str(tmp_path / f"node{rank}")
        assert message.startswith(
            f"the checkpoint directory {mine!r} is not shared by every rank: rank(s) 1 (on "
        ), message
        assert "no rank wrote anything and nothing was committed" in message
        assert "the same path on every rank" in message
    # Rank 0's root exists (it made it for the marker) and is empty again; rank 1 wrote nothing.
    assert results[0]["left"] == ["node0"]


# --- single-process: errors and retention ------------------------------------------------


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4))


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    return model, opt


def test_load_without_latest_says_so(tmp_path: Path) -> None:
    model, opt = _trained(0)
    with pytest.raises(CheckpointNotFoundError, match=r"has no 'latest' file.*no committed"):
        ckpt.load(tmp_path, model, opt)
    ckpt.save(tmp_path, model, opt, tag="a", options=ckpt.SaveOptions(save_latest=False))
    with pytest.raises(CheckpointNotFoundError, match=r"has no 'latest' file.*\['a'\]; pass tag="):
        ckpt.load(tmp_path, model, opt)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        ckpt.load(tmp_path / "nowhere", model, opt)
    with pytest.raises(CheckpointNotFoundError, match=r"/b' does not exist.*\['a'\]"):
        ckpt.load(tmp_path, model, opt, tag="b")
    assert ckpt.load(tmp_path, model, opt, tag="a").path == tmp_path / "a"


def _flip_byte(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_corrupt_newest_names_file_tensor_offset_and_older_checkpoint(tmp_path: Path) -> None:
    model, opt = _trained(0)
    for step in (1, 2, 3):
        ckpt.save(tmp_path, model, opt, engine_state={"global_steps": step})
    # Damage the newest and the one before it: the error points at the oldest.
    for tag in ("global_step3", "global_step2"):
        data = tmp_path / tag / "rank-00000.data"
        _flip_byte(data, data.stat().st_size - 10)
    fresh, fresh_opt = _trained(1)
    pattern = (
        r"file \S+global_step3/rank-00000\.data, tensor '(model|optim)/[^']+', offset \d+\)"
        r".*newest older checkpoint that verifies is \S+global_step1' \(tag='global_step1'\)"
    )
    with pytest.raises(CheckpointCorruptError, match=pattern) as info:
        ckpt.load(tmp_path, fresh, fresh_opt)
    assert info.value.path is not None and info.value.path.endswith("rank-00000.data")
    assert info.value.tensor is not None and info.value.offset is not None
    # With reader threads the chunks decode in place, queued across tensors: the damage
    # surfaces when the load waits for them, with the same report.
    with pytest.raises(CheckpointCorruptError, match=pattern + ".*partly overwritten"):
        ckpt.load(tmp_path, fresh, fresh_opt, threads=2)
    result = ckpt.load(tmp_path, fresh, fresh_opt, tag="global_step1", threads=2)
    assert result.engine_state == {"global_steps": 1}
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_corrupt_with_no_good_older_checkpoint(tmp_path: Path) -> None:
    model, opt = _trained(0)
    ckpt.save(tmp_path, model, opt, tag="only")
    data = tmp_path / "only" / "rank-00000.data"
    _flip_byte(data, data.stat().st_size - 10)
    with pytest.raises(CheckpointCorruptError, match="No older checkpoint under .* verifies"):
        ckpt.load(tmp_path, model, opt)


def test_keep_last_never_removes_what_latest_names(tmp_path: Path) -> None:
    model, opt = _trained(0)
    keep2 = ckpt.SaveOptions(keep_last=2)
    for step in (1, 2, 3, 4):
        ckpt.save(tmp_path, model, opt, engine_state={"global_steps": step}, options=keep2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3", "global_step4", "latest"]
    # `latest` stays on global_step4 while newer checkpoints are written without moving it.
    no_latest = ckpt.SaveOptions(keep_last=1, save_latest=False)
    for tag in ("x", "y"):
        ckpt.save(tmp_path, model, opt, tag=tag, options=no_latest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step4", "latest", "y"]
    assert (tmp_path / "latest").read_text().strip() == "global_step4"
    assert ckpt.load(tmp_path, model, opt).path.name == "global_step4"


def test_resaving_a_tag_replaces_it(tmp_path: Path) -> None:
    model, opt = _trained(0)
    ckpt.save(tmp_path, model, opt, tag="a")
    with torch.no_grad():
        model[0].weight.add_(1.0)
    ckpt.save(tmp_path, model, opt, tag="a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "latest"]
    fresh, _ = _trained(1)
    ckpt.load(tmp_path, fresh)
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_next_save_removes_leftovers_of_interrupted_saves(tmp_path: Path) -> None:
    model, opt = _trained(0)
    (tmp_path / "global_step9.tmp-0123abcd").mkdir(parents=True)
    (tmp_path / "global_step9.tmp-0123abcd" / "rank-00000.data").write_bytes(b"partial")
    (tmp_path / "latest.tmp-0123abcd").write_text("global_step9\n")
    ckpt.save(tmp_path, model, opt, tag="a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "latest"]


def test_async_failure_is_raised_at_the_next_wait_and_save(tmp_path: Path) -> None:
    model, opt = _trained(0)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    saver = ckpt.Checkpointer(ckpt.SaveOptions(), async_save=True)
    saver.save(not_a_dir, model=model, optimizer=opt, tag="a")  # fails in the background
    with pytest.raises(NotADirectoryError):
        saver.wait()
    assert saver.wait() is None  # raised once, then cleared
    saver.save(not_a_dir, model=model, optimizer=opt, tag="b")
    with pytest.raises(NotADirectoryError):
        saver.save(tmp_path / "ok", model=model, optimizer=opt, tag="c")
    # A good async save: the snapshot is taken at save time, not at write time.
    before = model[0].weight.detach().clone()
    path = saver.save(tmp_path / "ok", model=model, optimizer=opt, tag="d")
    with torch.no_grad():
        model[0].weight.add_(1.0)
    assert saver.close() == path
    fresh, _ = _trained(1)
    ckpt.load(tmp_path / "ok", fresh)
    assert torch.equal(fresh[0].weight, before)


def test_load_module_only_and_without_optimizer_state(tmp_path: Path) -> None:
    model, opt = _trained(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
        sched.step()
    ckpt.save(tmp_path, model, opt, tag="a", lr_scheduler=sched, engine_state={"global_steps": 1})
    fresh, fresh_opt = _trained(1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    before = {k: v.clone() for k, v in fresh_opt.state[fresh[0].weight].items()}
    result = ckpt.load(tmp_path, fresh, fresh_opt, lr_scheduler=fresh_sched, load_module_only=True)
    assert result.engine_state == {} and torch.equal(fresh[0].weight, model[0].weight)
    after = fresh_opt.state[fresh[0].weight]
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert fresh_sched.last_epoch == 0
    result = ckpt.load(
        tmp_path, fresh, fresh_opt, lr_scheduler=fresh_sched, load_optimizer_states=False
    )
    assert result.engine_state == {"global_steps": 1} and fresh_sched.last_epoch == 1
    assert torch.equal(fresh_opt.state[fresh[0].weight]["exp_avg"], before["exp_avg"])
    ckpt.load(tmp_path, fresh, fresh_opt)
    assert torch.equal(
        fresh_opt.state[fresh[0].weight]["exp_avg"], opt.state[model[0].weight]["exp_avg"]
    )
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 5e-3


def test_load_never_unpickles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = _trained(0)
    ckpt.save(tmp_path, model, opt, tag="a", client_state={"epoch": 3})

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pickle/torch.load used while loading a checkpoint")

    for mod, attr in [(pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(mod, attr, forbidden)
    fresh, fresh_opt = _trained(1)
    assert ckpt.load(tmp_path, fresh, fresh_opt).client_state == {"epoch": 3}


def test_client_state_must_be_msgpack_able(tmp_path: Path) -> None:
    model, opt = _trained(0)
    with pytest.raises(ValueError, match=re.escape("client_state['t'] is a Tensor")):
        ckpt.save(tmp_path, model, opt, tag="a", client_state={"t": torch.ones(1)})
    with pytest.raises(ValueError, match="must be a plain directory name"):
        ckpt.save(tmp_path, model, opt, tag="../escape")
    with pytest.raises(ValueError, match="tag=None names the checkpoint 'global_step<N>'"):
        ckpt.save(tmp_path, model, opt)
    assert not any(tmp_path.iterdir())


def test_mismatched_model_is_a_value_error(tmp_path: Path) -> None:
    model, opt = _trained(0)
    ckpt.save(tmp_path, model, opt, tag="a")
    other = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5))
    with pytest.raises(ValueError, match=r"'model/2.weight' has shape \(4, 9\) in .* but \(5, 9\)"):
        ckpt.load(tmp_path, other)
    with pytest.raises(ValueError, match=r"missing from the checkpoint \['3.weight'\]"):
        ckpt.load(tmp_path, nn.Sequential(*model, nn.Linear(4, 4, bias=False)))


def test_checkpoint_threads_option(tmp_path: Path) -> None:
    from checkpoint_tools import load_state_dict
    from fsdpx.checkpoint.saving import Checkpointer
    from fsdpx.config import Config

    with pytest.raises(
        ValueError, match=r"'checkpoint.threads' must be an integer >= 0 \(0: auto\); got -1"
    ):
        Config.from_dict({"checkpoint": {"threads": -1}})
    auto = Checkpointer.from_config(Config.from_dict({}))
    assert auto.options.threads == min(4, os.cpu_count() or 1)
    three = Checkpointer.from_config(Config.from_dict({"checkpoint": {"threads": 3}}))
    assert three.options.threads == 3
    # Parallel encoding stores the same tensors (the format tests check identical bytes).
    model, opt = _trained(0)
    states = [
        load_state_dict(
            ckpt.save(tmp_path, model, opt, tag=f"t{n}", options=ckpt.SaveOptions(threads=n)),
            include_optimizer=True,
        )
        for n in (1, 3)
    ]
    assert states[0].keys() == states[1].keys() and len(states[0]) == 16
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
