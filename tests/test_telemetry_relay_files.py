"""What the relay leaves for people: its replay log's permissions and its `--help` text."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from fsdpx.telemetry.wire.logfile import open_log_writer
from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.relay import main as relay_main


def test_relay_log_is_created_owner_only(tmp_path: Path) -> None:
    """The log holds the run's telemetry: 0600 like the socket, whatever the umask."""
    old_umask = os.umask(0o022)  # the common default, which left it world-readable
    try:
        relay = Relay(str(tmp_path / "r.sock"), log_path=tmp_path / "logs" / "run.tlm")
        relay.bind()
        relay.stop()
    finally:
        os.umask(old_umask)
    mode = stat.S_IMODE((tmp_path / "logs" / "run.tlm").stat().st_mode)
    assert mode == 0o600, oct(mode)


def test_existing_log_keeps_its_mode(tmp_path: Path) -> None:
    """Appending does not change a mode its owner chose (e.g. a shared 0640 log)."""
    log = tmp_path / "run.tlm"
    open_log_writer(log).close()
    os.chmod(log, 0o640)
    open_log_writer(log).close()
    assert stat.S_IMODE(log.stat().st_mode) == 0o640


def test_relay_help_keeps_the_docstrings_layout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        relay_main(["--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    # The launch command and the note stand on their own lines, as written.
    assert any(
        line.strip().startswith("python -m fsdpx.telemetry.relay --log run.tlm") for line in lines
    ), lines
    assert "[Note: relay placement]" in lines
    assert '    relay = Relay("127.0.0.1:0", log_path="run.tlm")' in lines
