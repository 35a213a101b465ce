"""Exporters (issue 21): Prometheus text that a real parser (prometheus_client's) reads
back, from `fsdpx-monitor export --prometheus` and from the relay's metrics endpoint
(loopback by default, a bearer token otherwise: DESIGN clarification 15), and JSONL that
round-trips the log's records (NaN included), events and dumps."""

from __future__ import annotations

import math
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fsdpx.telemetry.wire.logfile import open_log_writer
from fsdpx.telemetry.wire.metrics_http import MetricsServer
from fsdpx.telemetry.wire.prometheus import prometheus_text
from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.relay import main as relay_main
from fsdpx.telemetry.wire.transport import connect
from monitor.cli import main as monitor_main
from monitor.export_lines import read_jsonl
from monitor.synthetic import SlowPhase, SyntheticRun


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        assert family.type == "gauge", family.name
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _log(tmp_path: Path) -> tuple[Path, SyntheticRun]:
    run = SyntheticRun(n_ranks=3, slow_phases=(SlowPhase(1, "data_wait_s", 0.1),), nan_rank=2)
    path = tmp_path / "run.tlm"
    with open_log_writer(path) as writer:
        for message in run.messages(4):
            for item in message.get("records", []) + message.get("events", []):
                item["run_id"] = "r1"
            writer.write_message(message)
        dump = {"rank": 0, "host": "node000", "run_id": "r1", "request_id": "q", "time": 1.0}
        writer.write_message({"type": "dump", "dump": dump})
    return path, run


def test_export_prometheus_parses_with_prometheus_client(tmp_path: Path) -> None:
    log, run = _log(tmp_path)
    out = tmp_path / "metrics.prom"
    assert monitor_main(["export", str(log), "--prometheus", str(out)]) == 0
    samples = _samples(out.read_text())
    labels = (("host", "node000"), ("job", ""), ("rank", "1"), ("run_id", "r1"))
    assert samples[("fsdpx_step", labels)] == 4
    assert samples[("fsdpx_step_time_seconds", labels)] == run.record(1, 4)["step_time_s"]
    phase = (
        ("host", "node000"),
        ("job", ""),
        ("phase", "data_wait"),
        ("rank", "1"),
        ("run_id", "r1"),
    )
    assert samples[("fsdpx_phase_seconds", phase)] == run.record(1, 4)["data_wait_s"]
    nan_labels = (("host", "node000"), ("job", ""), ("rank", "2"), ("run_id", "r1"))
    assert math.isnan(samples[("fsdpx_loss", nan_labels)])
    assert not any(
        name == "fsdpx_phase_seconds" and ("phase", "h2d") in lab for name, lab in samples
    )
    # The comm wait inside forward (records with the split: COMM_SPLIT_FIELDS).
    waited = samples[
        ("fsdpx_comm_wait_in_phase_seconds", phase[:2] + (("phase", "forward"),) + phase[3:])
    ]
    assert waited == run.record(1, 4)["comm_wait_forward_s"]


def test_records_of_an_older_publisher_have_no_split_gauges() -> None:
    old = SyntheticRun(n_ranks=2, phases=True, comm_split=False)
    text = prometheus_text({r: old.record(r, 3) for r in range(2)})
    assert "fsdpx_phase_seconds" in text and "fsdpx_comm_wait_in_phase_seconds" not in text
    assert len(_samples(text)) > 0  # still parses


def test_label_values_are_escaped() -> None:
    record = {"rank": 0, "host": 'a"b\\c\nd', "run_id": None, "job": None, "loss": 1.5}
    samples = _samples(prometheus_text({0: record}))
    [(name, labels)] = samples
    assert name == "fsdpx_loss" and dict(labels)["host"] == 'a"b\\c\nd'


def test_jsonl_round_trips_records_events_and_dumps(tmp_path: Path) -> None:
    log, run = _log(tmp_path)
    out = tmp_path / "run.jsonl"
    assert monitor_main(["export", str(log), "--jsonl", str(out)]) == 0
    items = read_jsonl(out)
    records = [i for i in items if i["type"] == "record"]
    assert len(records) == 3 * 4
    first = {k: v for k, v in records[0].items() if k != "type"}
    expected = {**run.record(0, 1), "run_id": "r1"}
    assert first == expected
    assert math.isnan(next(r for r in records if r["rank"] == 2)["loss"])
    assert [i["kind"] for i in items if i["type"] == "event"][:3] == ["start"] * 3
    assert [i["request_id"] for i in items if i["type"] == "dump"] == ["q"]
    for line in out.read_text().splitlines():
        assert "NaN" not in line  # strict JSON: no bare NaN


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def test_relay_serves_live_gauges_and_checks_the_token(tmp_path: Path) -> None:
    relay = Relay(str(tmp_path / "relay.sock"))
    address = relay.bind()
    relay.start_thread()
    metrics = MetricsServer("127.0.0.1", 0, token="s3cret", latest=lambda: dict(relay.latest))
    metrics.start()
    try:
        run = SyntheticRun(n_ranks=1, phases=True)
        rec = {**run.record(0, 3), "run_id": "r1"}
        conn = connect(address, role="rank", secret=None, timeout_s=5, rank=0, host="node000")
        conn.send({"type": "records", "records": [rec]})
        url = f"http://127.0.0.1:{metrics.port}/metrics"
        for _ in range(500):  # until the relay took the record in (a state)
            status, text = _get(url, "s3cret")
            if "fsdpx_step{" in text:
                break
        assert status == 200
        labels = (("host", "node000"), ("job", ""), ("rank", "0"), ("run_id", "r1"))
        assert _samples(text)[("fsdpx_step", labels)] == 3
        assert _get(url)[0] == 401 and _get(url, "wrong")[0] == 401
        assert _get(url.replace("/metrics", "/other"), "s3cret")[0] == 404
        conn.close()
    finally:
        metrics.stop()
        relay.stop()


def test_non_loopback_metrics_need_a_token(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(
        ValueError, match="refusing to serve Prometheus metrics on 0.0.0.0:0 without"
    ):
        MetricsServer("0.0.0.0", 0, token=None, latest=dict)
    monkeypatch.delenv("FSDPX_PROMETHEUS_TOKEN", raising=False)
    with pytest.raises(SystemExit):
        relay_main(
            [
                "--listen",
                "127.0.0.1:0",
                "--prometheus-port",
                "0",
                "--prometheus-host",
                "0.0.0.0",
            ]
        )
    assert "without a bearer token" in capsys.readouterr().err
