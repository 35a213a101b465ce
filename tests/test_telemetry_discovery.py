"""Relay discovery ([Note: relay discovery] in fsdpx/telemetry/wire/discovery.py): the
ranks publish every node's relay in the rendezvous store and a file, and the monitor
follows the relays it finds there. Two simulated nodes on one machine."""

from __future__ import annotations

import argparse
import io
import json
import tempfile
from pathlib import Path

import pytest
from torch.distributed import TCPStore

from fsdpx.telemetry.announce import group_entries, store_endpoint
from fsdpx.telemetry.wire.discovery import (
    STORE_KEY,
    RelayEntry,
    advertised,
    parse_relay_list,
    relay_list_json,
)
from fsdpx.telemetry.wire.transport import parse_address
from monitor.cli import live_addresses
from monitor.discover import relays_from_file, relays_from_store
from tests import discovery_bodies
from tests.dist import run_ranks


def _args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "addresses": [],
        "discovery": None,
        "rendezvous": None,
        "discover_timeout": 0.0,
    }
    return argparse.Namespace(**{**base, **kw})


def test_two_nodes_publish_their_relays_and_the_monitor_follows_both(tmp_path: Path) -> None:
    # The rendezvous store, hosted here as torchrun's agent on the master host hosts it.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    endpoint = f"127.0.0.1:{store.port}"
    discovery = tmp_path / "relays.json"
    # Unix socket paths must be short (sun_path): not under pytest's tmp_path.
    with tempfile.TemporaryDirectory(prefix="fsdpx-disc-", dir="/tmp") as sock_dir:
        results = run_ranks(
            discovery_bodies.two_nodes_publish_their_relays,
            4,
            (sock_dir, str(discovery)),
            env={"FSDPX_RDZV_ENDPOINT": endpoint},
        )
        sockets = [f"unix:{sock_dir}/node{n}.sock" for n in (0, 1)]
        want = [
            RelayEntry(0, "node-0", sockets[0], (0, 1)),
            RelayEntry(1, "node-1", sockets[1], (2, 3)),
        ]
        # The monitor (rank 0 in its role) found both relays, each carrying its node's
        # ranks with their node: all four ranks through the two discovered relays.
        assert results[0]["addresses"] == sockets
        assert results[0]["seen"] == {sockets[0]: {0: 0, 1: 0}, sockets[1]: {2: 1, 3: 1}}
        # The same list in the store (still there after the job, as the agent's store is
        # for the job's life) and in the file.
        assert relays_from_store(endpoint, timeout_s=30.0) == want
        assert relays_from_file(discovery, timeout_s=0.0) == want
        assert json.loads(discovery.read_text())["run_id"] == "disc"
        err = io.StringIO()
        # Explicit addresses come first; a discovered one already given is not repeated.
        got = live_addresses(_args(addresses=[sockets[1]], discovery=discovery), err)
        assert got == [sockets[1], sockets[0]]
        assert err.getvalue() == f"fsdpx-monitor: node 0 (node-0, 2 ranks): relay {sockets[0]}\n"


def test_a_wildcard_listener_is_published_under_the_node_s_host() -> None:
    assert advertised(parse_address("0.0.0.0:7077"), "node-1") == "tcp://node-1:7077"
    assert advertised(parse_address("[::]:7077"), "node-1") == "tcp://node-1:7077"
    assert advertised(parse_address("10.0.0.5:7077"), "node-1") == "tcp://10.0.0.5:7077"
    assert advertised(parse_address("/run/x.sock"), "node-1") == "unix:/run/x.sock"


def test_ranks_are_grouped_by_node_and_only_local_rank_0_names_the_relay() -> None:
    gathered = [
        (3, 1, "b", None),
        (0, 0, "a", "tcp://a:1"),
        (2, 1, "b", "tcp://b:1"),
        (1, 0, "a", None),
        (4, 2, "c", None),  # a node whose relay nobody knows: left out
    ]
    assert group_entries(gathered) == [
        RelayEntry(0, "a", "tcp://a:1", (0, 1)),
        RelayEntry(1, "b", "tcp://b:1", (2, 3)),
    ]


def test_store_endpoint_comes_from_the_launcher_or_master_addr() -> None:
    assert store_endpoint({"FSDPX_RDZV_ENDPOINT": "node-0:29500"}) == ("node-0", 29500)
    master = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    assert store_endpoint(master) == ("10.0.0.1", 1234)
    assert store_endpoint({**master, "FSDPX_RDZV_ENDPOINT": "[::1]:5"}) == ("::1", 5)
    assert store_endpoint({}) is None
    with pytest.raises(ValueError, match="FSDPX_RDZV_ENDPOINT='node-0' is not a rendezvous"):
        store_endpoint({"FSDPX_RDZV_ENDPOINT": "node-0"})


def test_bad_relay_lists_are_refused_naming_the_source() -> None:
    with pytest.raises(ValueError, match="'f.json' is not a relay list"):
        parse_relay_list("{", "'f.json'")
    with pytest.raises(ValueError, match="expected a relay list of format version 1, found 9"):
        parse_relay_list('{"version": 9}', "x")
    with pytest.raises(ValueError, match="the relay list is empty"):
        parse_relay_list(relay_list_json("r", []), "x")
    with pytest.raises(ValueError, match="a relay entry without an address"):
        parse_relay_list('{"version": 1, "relays": [{"node": 0}]}', "x")


def test_monitor_discovery_errors_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no relay list at .*telemetry.discovery_file"):
        live_addresses(_args(discovery=tmp_path / "none.json"))
    with pytest.raises(ValueError, match="--rendezvous 'node-0': expected HOST:PORT"):
        live_addresses(_args(rendezvous="node-0"))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set("other", "x")
    # The key is never set: the (short) wait ends with the message, not a hang.
    with pytest.raises(ValueError, match="holds no relay list after 0.2 s.*FSDPX_RDZV_ENDPOINT"):
        relays_from_store(f"127.0.0.1:{store.port}", timeout_s=0.2)
    store.set(STORE_KEY, "not json")
    with pytest.raises(ValueError, match="the rendezvous store at .* is not a relay list"):
        relays_from_store(f"127.0.0.1:{store.port}", timeout_s=5.0)


def _announce(monkeypatch: pytest.MonkeyPatch, **cfg: object) -> None:
    """announce_relays in this one process (world size 1, no process group)."""
    import types

    import torch

    from fsdpx.config import TelemetryConfig
    from fsdpx.distributed import DistInfo
    from fsdpx.telemetry.announce import announce_relays

    monkeypatch.setenv("FSDPX_NODE_HOST", "node-0")
    publisher = types.SimpleNamespace(
        address=parse_address("0.0.0.0:7077"), node=0, run=types.SimpleNamespace(run_id="r1")
    )
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    announce_relays(publisher, TelemetryConfig(**cfg), info)  # type: ignore[arg-type]


def test_a_list_that_cannot_be_published_is_logged_not_raised(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import socket

    import fsdpx.telemetry.announce as announce

    with socket.socket() as closed:  # a port nothing listens on once closed
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("FSDPX_RDZV_ENDPOINT", f"127.0.0.1:{port}")
    monkeypatch.setattr(announce, "STORE_TIMEOUT_S", 0.5)  # only shortens the failing wait
    missing = tmp_path / "no-such-dir" / "relays.json"
    with caplog.at_level("WARNING", logger="fsdpx.telemetry"):
        _announce(monkeypatch, discovery_file=str(missing))
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        f"could not write the relay list to telemetry.discovery_file={str(missing)!r}" in m
        for m in messages
    ), messages
    assert any(
        f"could not publish the relay list in the rendezvous store at 127.0.0.1:{port}" in m
        for m in messages
    ), messages


def test_publish_relays_false_leaves_the_store_alone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("FSDPX_RDZV_ENDPOINT", f"127.0.0.1:{store.port}")
    _announce(monkeypatch, publish_relays=False, discovery_file=str(tmp_path / "r.json"))
    assert not store.check([STORE_KEY])
    # The file is still written; a wildcard listener appears under the node's host.
    assert relays_from_file(tmp_path / "r.json", timeout_s=0.0) == [
        RelayEntry(0, "node-0", "tcp://node-0:7077", (0,))
    ]
    _announce(monkeypatch)
    assert parse_relay_list(store.get(STORE_KEY), "store")[0].address == "tcp://node-0:7077"


def test_the_monitor_command_reports_a_missing_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from monitor.cli import main

    argv = ["--discovery", str(tmp_path / "none.json"), "--discover-timeout", "0"]
    assert main(argv) == 2
    assert "fsdpx-monitor: error: no relay list at" in capsys.readouterr().err
