"""The checkpoint root's rules (checkpoint_tools/format/root.py, FORMAT.md §2.1), judged
the same way by the runtime (`fsdpx.checkpoint.load`, `Engine.load_checkpoint`) and the
offline tools (`resolve_checkpoint`, `fsdpx-ckpt`): tags, hostile `latest` files, what
"committed" means, and DeepSpeed folders, which are never "no checkpoint"."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import fsdpx
import fsdpx.checkpoint as ckpt
from checkpoint_tools import load_state_dict, resolve_checkpoint
from checkpoint_tools.cli import main
from checkpoint_tools.format import (
    CheckpointFormatError,
    CheckpointNotFoundError,
    DeepSpeedCheckpointError,
)
from checkpoint_tools.format.root import (
    LATEST,
    MAX_LATEST_BYTES,
    check_tag,
    committed,
    read_latest,
    resolve,
    write_latest,
)

REPO = Path(__file__).resolve().parents[1]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A root with one committed checkpoint `a` that `latest` names."""
    r = tmp_path / "ckpt"
    ckpt.save(r, _model(), tag="a")
    assert (r / LATEST).read_text() == "a\n"
    return r


def _runtime(r: Path) -> Path:
    return ckpt.load(r, _model()).path


# Both sides resolve a root the same way: the runtime's load and the tools' resolver.
RESOLVERS: list[Callable[[Path], Path]] = [_runtime, resolve_checkpoint]
IDS = ["runtime", "tools"]


# --- tags ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tag", "why"),
    [
        ("..", "must not start with '.'"),
        (".hidden", "must not start with '.'"),
        ("a/b", r"no '/'"),
        ("a\\b", r"no '/'"),
        ("", "non-empty"),
        ("latest", "'latest' is the file naming"),
        ("x.tmp-1", "marks the temporary files"),
        ("a\nb", "control characters"),
    ],
)
def test_bad_tags_are_refused_on_save_and_load(root: Path, tag: str, why: str) -> None:
    with pytest.raises(ValueError, match=f"checkpoint tag must be a plain directory name.*{why}"):
        check_tag(tag)
    with pytest.raises(ValueError, match=why):
        ckpt.save(root, _model(), tag=tag)
    with pytest.raises(ValueError, match=why):
        ckpt.load(root, _model(), tag=tag)
    assert sorted(p.name for p in root.iterdir()) == ["a", LATEST]


def test_missing_tag_directory(root: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match=r"/nope' does not exist.*\['a'\]; pass tag"):
        ckpt.load(root, _model(), tag="nope")
    (root / LATEST).write_text("gone\n")
    with pytest.raises(
        CheckpointNotFoundError, match=r"/gone' \(the one 'latest' names\) does not"
    ):
        _runtime(root)
    with pytest.raises(CheckpointNotFoundError, match="latest names 'gone', which does not exist"):
        resolve_checkpoint(root)


# --- hostile `latest` ---------------------------------------------------------------------


@pytest.mark.parametrize("resolver", RESOLVERS, ids=IDS)
def test_symlinked_latest_is_refused(root: Path, resolver: Callable[[Path], Path]) -> None:
    # Even a symlink to a file that names a real checkpoint: `latest` is never followed.
    (root.parent / "elsewhere").write_text("a\n")
    (root / LATEST).unlink()
    (root / LATEST).symlink_to(root.parent / "elsewhere")
    with pytest.raises(CheckpointFormatError, match="cannot open 'latest'.*symlinks are refused"):
        resolver(root)


@pytest.mark.parametrize("resolver", RESOLVERS, ids=IDS)
def test_oversized_latest_is_refused(root: Path, resolver: Callable[[Path], Path]) -> None:
    (root / LATEST).write_text("a" + " " * MAX_LATEST_BYTES + "\n")  # strips to "a"
    with pytest.raises(CheckpointFormatError, match=f"more than {MAX_LATEST_BYTES} bytes"):
        resolver(root)


@pytest.mark.parametrize("resolver", RESOLVERS, ids=IDS)
@pytest.mark.parametrize(
    ("content", "why"),
    [
        (b"../../etc\n", r"no '/'"),
        (b"..\n", "must not start with '.'"),
        (b"a/b\n", r"no '/'"),
        (b"\n", "non-empty"),
        (b"latest\n", "'latest' is the file naming"),
        (b"a.tmp-1234\n", "marks the temporary files"),
        (b"\xff\xfe\n", "not UTF-8"),
    ],
)
def test_bad_latest_content_is_a_format_error(
    root: Path, resolver: Callable[[Path], Path], content: bytes, why: str
) -> None:
    (root / LATEST).write_bytes(content)
    with pytest.raises(CheckpointFormatError, match=f"latest must hold one plain directory.*{why}"):
        resolver(root)


@pytest.mark.parametrize("resolver", RESOLVERS, ids=IDS)
def test_latest_that_is_not_a_regular_file(root: Path, resolver: Callable[[Path], Path]) -> None:
    (root / LATEST).unlink()
    os.mkfifo(root / LATEST)  # would block a plain open(); refused without waiting
    with pytest.raises(CheckpointFormatError, match="'latest' is not a regular file"):
        resolver(root)
    (root / LATEST).unlink()
    (root / LATEST).mkdir()
    with pytest.raises(CheckpointFormatError, match="'latest' is not a regular file"):
        resolver(root)


def test_a_damaged_latest_stops_retention(root: Path) -> None:
    # keep_last must never delete what `latest` names; when `latest` cannot be read, the
    # save still commits, warns, and removes nothing.
    (root / LATEST).write_text("../a\n")
    options = ckpt.SaveOptions(keep_last=1, save_latest=False)
    with pytest.warns(UserWarning, match="cleaning up .* failed: latest must hold one plain"):
        ckpt.save(root, _model(), tag="b", options=options)
    assert [d.name for d in committed(root)] == ["a", "b"]


# --- latest written, committed read -------------------------------------------------------


def test_write_latest_is_atomic_and_checked(tmp_path: Path) -> None:
    write_latest(tmp_path, "global_step3")
    assert (tmp_path / LATEST).read_bytes() == b"global_step3\n"
    assert read_latest(tmp_path) == "global_step3"
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST]  # no temp file left
    with pytest.raises(ValueError, match="checkpoint tag must be a plain directory name"):
        write_latest(tmp_path, "../x")
    assert read_latest(tmp_path) == "global_step3"
    assert read_latest(tmp_path / "missing") is None


def test_committed_means_a_regular_manifest_under_a_valid_tag(root: Path) -> None:
    ckpt.save(root, _model(), tag="b")
    for name in ("c.tmp-0123", ".d"):  # a save in progress, a hidden directory
        (root / name).mkdir()
        (root / name / "MANIFEST").write_bytes((root / "a" / "MANIFEST").read_bytes())
    (root / "e").mkdir()  # a MANIFEST that is a symlink: the reader would refuse it
    (root / "e" / "MANIFEST").symlink_to(root / "a" / "MANIFEST")
    (root / "f").mkdir()  # no MANIFEST: incomplete
    os.utime(root / "a" / "MANIFEST", ns=(2 * 10**18, 2 * 10**18))  # `a` committed last
    assert [d.name for d in committed(root)] == ["b", "a"]
    (root / LATEST).unlink()
    with pytest.raises(CheckpointNotFoundError, match="committed checkpoints here: b, a"):
        resolve_checkpoint(root)
    assert committed(root / "missing") == []


def test_one_owner_of_the_root_rules() -> None:
    """No module besides checkpoint_tools/format/root.py defines the root's rules again."""
    owned = {"fsync_dir", "_fsync_dir", "read_latest", "write_latest", "check_tag"}
    owned |= {"committed", "resolve", "resolve_checkpoint", "is_committed"}
    owner = REPO / "checkpoint_tools" / "format" / "root.py"
    found = []
    for pkg in ("fsdpx", "checkpoint_tools", "monitor"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            if path == owner:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef) and node.name in owned:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}")
    assert not found, found


# --- DeepSpeed folders --------------------------------------------------------------------


def _deepspeed_folder(tmp_path: Path, *, latest: bool = True) -> Path:
    """DeepSpeed's layout (the file names only: nothing here is ever opened)."""
    ds = tmp_path / "ds"
    (ds / "global_step10").mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        (ds / "global_step10" / name).write_bytes(b"PK\x03\x04 not read")
    if latest:
        (ds / "latest").write_text("global_step10")
    return ds


_DS = r"is a DeepSpeed checkpoint folder \(it holds '.*_states\.pt'\).*fsdpx cannot load "
_DS += "DeepSpeed checkpoints directly.*fsdpx-ckpt import-deepspeed DS_DIR OUT_DIR"


@pytest.mark.parametrize("latest", [True, False], ids=["with-latest", "without-latest"])
def test_deepspeed_folder_is_never_no_checkpoint(tmp_path: Path, latest: bool) -> None:
    ds = _deepspeed_folder(tmp_path, latest=latest)
    calls: list[Callable[[], object]] = [
        lambda: ckpt.load(ds, _model()),
        lambda: ckpt.load(ds / "global_step10", _model()),
        lambda: resolve(ds, "global_step10"),
        lambda: resolve_checkpoint(ds),
        lambda: resolve_checkpoint(ds / "global_step10"),
        lambda: load_state_dict(ds),
    ]
    for call in calls:
        with pytest.raises(DeepSpeedCheckpointError, match=_DS) as info:
            call()
        assert isinstance(info.value, CheckpointFormatError)
        assert not isinstance(info.value, CheckpointNotFoundError)
    # The other resolver paths still say "not found" for a plain empty directory.
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError):
        resolve_checkpoint(tmp_path / "empty")


def test_deepspeed_folder_through_the_engine_and_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ds = _deepspeed_folder(tmp_path)
    engine = fsdpx.shard(_model(), fsdpx.Config.from_dict({"zero": {"stage": 0}}))
    with pytest.raises(DeepSpeedCheckpointError, match=_DS):
        engine.load_checkpoint(ds)
    assert main(["verify", str(ds)]) == 1
    assert "DeepSpeedCheckpointError" in capsys.readouterr().err


def test_deepspeed_hint_names_no_command_that_does_not_exist(tmp_path: Path) -> None:
    # The hint names the import command exactly when `fsdpx-ckpt --help` lists it
    # (checkpoint_tools/format/deepspeed_folder.py: IMPORT_HINT).
    help_text = subprocess.run(
        [sys.executable, "-m", "checkpoint_tools", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    with pytest.raises(DeepSpeedCheckpointError) as info:
        resolve_checkpoint(_deepspeed_folder(tmp_path))
    assert ("import-deepspeed" in help_text) == ("import-deepspeed" in str(info.value))
