"""The `fsdpx` command line. The main paths run as a user runs them, in a subprocess
(each start imports torch, about 3 s); message details are checked in-process."""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdpx.cli import main
from fsdpx.config import Config


def _fsdpx(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fsdpx.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_config_show_prints_every_default(tmp_path: Path) -> None:
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"zero": {"stage": 2}, "gradient_accumulation_steps": 4}))
    result = _fsdpx("config", "show", path)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["zero"]["stage"] == 2
    assert shown["gradient_accumulation_steps"] == 4
    assert shown["optimizer"]["lr"] == Config().optimizer.lr  # a default, filled in
    # Resolved output is itself a valid config that means the same thing.
    assert Config.from_dict(shown) == Config.from_file(path)


def test_config_show_reads_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "train.toml"
    path.write_text("[zero]\nstage = 1\n")
    assert main(["config", "show", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["zero"]["stage"] == 1


def test_config_show_bad_file_exits_2_in_a_subprocess(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"zero": {"stag": 2}}')
    result = _fsdpx("config", "show", path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert "unknown config key 'zero.stag'; did you mean 'zero.stage'?" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"zero": {"stage": 5}}', "config key 'zero.stage' must be one of 0, 1, 2, 3; got 5"),
        ('{"optimizer": {"lr": "fast"}}', "config key 'optimizer.lr' must be a number"),
        ("{not json", "bad.json: not valid JSON"),
    ],
)
def test_config_show_bad_file_prints_the_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    assert main(["config", "show", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("fsdpx config show: error: ")
    assert message in err


def test_config_show_missing_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", str(tmp_path / "nope.json")]) == 2
    err = capsys.readouterr().err
    assert "nope.json" in err and "No such file" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in ([], ["config"], ["config", "show"], ["nope"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2, argv
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "config" in capsys.readouterr().out


def test_console_script_is_installed(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("fsdpx")
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable} (package not pip-installed)")
    path = tmp_path / "c.json"
    path.write_text("{}")
    result = subprocess.run(
        [str(script), "config", "show", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads(json.dumps(Config().to_dict()))


# --- fsdpx config explain (DeepSpeed configs) ---------------------------------------------

DS_DATA = Path(__file__).parent / "data" / "deepspeed_configs"


def test_config_explain_prints_config_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    path = DS_DATA / "zero2_fp16_dynamic_hjson.json"
    assert main(["config", "explain", str(path), "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    head, table = out.split(f"# DeepSpeed keys of {path}\n")
    shown = json.loads(head.split("\n", 1)[1])
    assert Config.from_dict(shown) == Config.from_deepspeed(path, world_size=2)
    lines = {line.split()[0]: line for line in table.splitlines()[1:] if line.strip()}
    assert "mapped    zero.stage = 2" in lines["zero_optimization.stage"]
    assert "ignored   FSDP2 overlaps communication" in lines["zero_optimization.overlap_comm"]
    assert out.rstrip().splitlines()[-1].startswith(f"DeepSpeed config {path} -> fsdpx Config")


def test_config_explain_shows_refusals_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, // comment\n "optimizer": {"type": "Lion",},}')
    assert main(["config", "explain", str(path), "--world-size", "2"]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"^optimizer\.type +Lion +refused +optimizer type", out, re.M)
    assert err.startswith("fsdpx config explain: error: ")
    assert "optimizer type 'Lion' is not built into fsdpx" in err


def test_config_explain_all_keys_and_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "explain", "--all-keys"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| DeepSpeed key | fsdpx | notes |")
    assert "| `zero_optimization.stage` | mapped (derived) |" in out
    assert "| `zero_optimization.zero_quantized_weights` | `zero.quantized_weights` |" in out
    assert (
        "| `zero_optimization.zero_quantized_nontrainable_weights` | refused (accepted when "
        "false) |" in out
    )
    assert main(["config", "explain"]) == 2
    assert "give FILE or --all-keys" in capsys.readouterr().err


def test_config_explain_in_a_subprocess() -> None:
    result = _fsdpx("config", "explain", DS_DATA / "zero3_hpz.json", "--world-size", "2")
    assert result.returncode == 0, result.stderr
    assert "zero.hpz_partition_size = 2" in result.stdout


def test_a_reader_that_goes_away_ends_the_command_quietly() -> None:
    """`fsdpx config explain --all-keys | head`: the pipe closes while the table is being
    written; the command exits 141 (a shell's code for SIGPIPE) without a traceback. The
    pipe is shrunk to one page so that the 40 KB table cannot fit in it."""
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, 1031, 4096)  # F_SETPIPE_SZ (Linux)
    code = "import sys, fsdpx.cli; sys.exit(fsdpx.cli.main(['config', 'explain', '--all-keys']))"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=write_end, stderr=subprocess.PIPE, text=True
    )
    os.close(write_end)
    assert os.read(read_end, 64).startswith(b"| DeepSpeed key")
    os.close(read_end)  # the reader goes away with the process blocked on a full pipe
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
