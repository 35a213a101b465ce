"""Records name the rank's node: FSDPX_NODE (fsdpx launch), else torchrun's GROUP_RANK,
else nil (fsdpx/telemetry/node.py [Note: node identity])."""

from __future__ import annotations

import logging
import types
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from fsdpx.config import TelemetryConfig
from fsdpx.engine import StepResult
from fsdpx.telemetry.node import node_from_env
from fsdpx.telemetry.publisher import Publisher
from fsdpx.telemetry.wire.logfile import iter_log
from fsdpx.telemetry.wire.protocol import RECORD_FIELDS
from fsdpx.telemetry.wire.relay import Relay

FAST = TelemetryConfig(enabled=True, start_relay=False, poll_interval_s=0.02, send_timeout_s=0.2)


def test_node_sources_in_order(caplog: pytest.LogCaptureFixture) -> None:
    assert node_from_env({"FSDPX_NODE": "1", "GROUP_RANK": "0"}) == 1
    assert node_from_env({"GROUP_RANK": "3"}) == 3
    assert node_from_env({"FSDPX_NODE": "", "GROUP_RANK": "2"}) == 2
    assert node_from_env({}) is None
    with caplog.at_level(logging.WARNING, logger="fsdpx.telemetry"):
        # Not a node rank: logged, and the next source (or nil) is used, never a guess.
        assert node_from_env({"FSDPX_NODE": "node-1", "GROUP_RANK": "1"}) == 1
        assert node_from_env({"GROUP_RANK": "-1"}) is None
    assert "FSDPX_NODE='node-1' is not a node rank" in caplog.text
    assert "GROUP_RANK='-1' is not a node rank" in caplog.text


@pytest.mark.parametrize(
    ("env", "node"),
    [({"FSDPX_NODE": "1", "GROUP_RANK": "0"}, 1), ({"GROUP_RANK": "0"}, 0), ({}, None)],
)
def test_published_records_carry_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], node: int | None
) -> None:
    for name in ("FSDPX_NODE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    log = tmp_path / "run.tlm"
    relay = Relay(str(tmp_path / "r.sock"), log_path=log)
    relay.bind()
    relay.start_thread()
    try:
        pub = Publisher(
            replace(FAST, relay=str(relay.address)),
            rank=0,
            local_rank=0,
            world_size=1,
            device=torch.device("cpu"),
            install_hooks=False,
        )
        model = torch.nn.Linear(2, 1)
        engine = types.SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        pub.on_step(engine, StepResult(1, False, None, 1.0))
        pub.close()
    finally:
        relay.stop()
    records = [r for m in iter_log(log) if m["type"] == "records" for r in m["records"]]
    assert len(records) == 1
    assert tuple(records[0]) == RECORD_FIELDS and records[0]["node"] == node
