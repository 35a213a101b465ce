"""Columnar batches (protocol 1.1, fsdpx/telemetry/wire/columns.py [Note: columnar
batches]; monitor/columns_ingest.py [Note: ingesting columns]): the relay sends records as
columns only to a monitor that asks, the columns hold exactly the records, records with
differing keys stay rows, a malformed block is survived, and a model fed columns ends in
the same state as one fed the same records as dicts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest

from fsdpx.telemetry.wire.coalesce import encode_batches
from fsdpx.telemetry.wire.columns import RecordColumns, to_columns
from fsdpx.telemetry.wire.protocol import MAX_FRAME_BYTES, PROTOCOL_MINOR, decode_body
from fsdpx.telemetry.wire.relay import Relay
from monitor.model import MonitorModel
from monitor.receiver import Batch, RelayClient
from monitor.runs import RunBook
from monitor.state import MonitorSettings
from monitor.synthetic import SlowPhase, SyntheticRun
from tests.test_telemetry_relay_batches import SECRET, _Monitor, _rank, _record, _serve_frames


@pytest.fixture
def relay(tmp_path: Path) -> Iterator[Relay]:
    relay = Relay(str(tmp_path / "r.sock"), secret=SECRET)
    relay.bind()
    relay.start_thread()
    yield relay
    relay.stop()


def test_columns_hold_exactly_the_records_and_differing_keys_stay_rows() -> None:
    records = [_record(r, s) for s in (1, 2) for r in range(3)]
    columns = to_columns(records)
    assert columns is not None and list(columns) == list(records[0])
    block = RecordColumns.read(columns)
    assert block is not None and block.n == 6 and block.rows() == records
    assert block.row(4) == records[4] and block.take([5, 0]).rows() == [records[5], records[0]]
    assert block.get("no such field") is None
    assert to_columns([*records, {**records[0], "extra": 1}]) is None
    assert to_columns([]) is None and to_columns([{}, {}]) is None
    assert to_columns(records[:1]) is None  # one record: a map is smaller
    one = to_columns([{"rank": 1}, {"rank": 2}])
    assert one == {"rank": [1, 2]}
    malformed: list[Any] = [{}, [], {"a": [1], "b": [1, 2]}, {"a": 1}, None]
    for bad in malformed:
        assert RecordColumns.read(bad) is None
    # Encoded as a batch: one frame, under the limit, decoded as the protocol decodes it;
    # a row batch of mixed keys goes as `records`.
    (body,) = encode_batches(records, [], columns=True)
    assert decode_body(body) == {"type": "batch", "record_columns": columns}
    assert len(body) < len(encode_batches(records, [])[0])
    mixed = [records[0], {**records[1], "extra": 1}]
    assert "records" in decode_body(encode_batches(mixed, [], columns=True)[0])


def test_big_column_batches_split_under_the_frame_limit_in_order() -> None:
    big = [{**_record(r % 512, r // 512), "pad": "x" * 200} for r in range(8192)]
    bodies = encode_batches(big, [], columns=True)
    assert len(bodies) > 1 and all(len(b) <= MAX_FRAME_BYTES - 32 for b in bodies)
    rows = []
    for body in bodies:
        block = RecordColumns.read(decode_body(body)["record_columns"])
        assert block is not None
        rows += block.rows()
    assert rows == big


def test_relay_sends_columns_only_to_the_monitor_that_asks(relay: Relay) -> None:
    rows, cols = _Monitor(relay, batch_s=1.0), _Monitor(relay, batch_s=1.0, columns=True)
    ranks = [_rank(relay, 0), _rank(relay, 1)]
    steps = 12
    for step in range(1, steps + 1):
        for rank, conn in enumerate(ranks):
            conn.send({"type": "records", "records": [_record(rank, step)]})

    def got(monitor: _Monitor) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for m in monitor.live:
            out += m.get("records", [])
            block = RecordColumns.read(m["record_columns"]) if "record_columns" in m else None
            out += block.rows() if block is not None else []
        return out

    rows.until(lambda: len(got(rows)) == 2 * steps)
    cols.until(lambda: len(got(cols)) == 2 * steps)
    # Equal keys: every live frame of the asking monitor with two or more records is
    # columnar (a lone record stays a map).
    assert all(len(m.get("records", [])) <= 1 for m in cols.live)
    assert any("record_columns" in m for m in cols.live)
    # Then a frame with a record whose keys differ: its batch goes as rows (nothing lost).
    odd = [_record(1, steps + 1), {**_record(1, steps + 2), "new": 1}]
    ranks[1].send({"type": "records", "records": odd})
    total = 2 * steps + 2
    rows.until(lambda: len(got(rows)) == total)
    cols.until(lambda: len(got(cols)) == total)
    assert got(cols) == got(rows)
    assert not any("record_columns" in m for m in rows.live)
    assert "records" in cols.live[-1]
    welcome = rows.conn.welcome
    assert welcome.get("minor") == PROTOCOL_MINOR == 1
    for conn in (*ranks, rows.conn, cols.conn):
        conn.close()


def _stream() -> tuple[SyntheticRun, list[list[dict[str, Any]]]]:
    """Batches of records of a 6-rank run with stragglers, 3 steps per batch, ranks in
    shuffled order, and a rank that stops."""
    run = SyntheticRun(
        n_ranks=6,
        phases=True,
        slow_phases=(SlowPhase(1, "data_wait_s", 0.15), SlowPhase(4, "forward_s", 0.2)),
        stop_rank=5,
        stop_after_step=10,
    )
    batches = []
    for first in range(1, 31, 3):
        batch = [r for step in range(first, first + 3) for r in run.records(step)]
        batches.append(sorted(batch, key=lambda r: (r["rank"] * 7) % 6))
    # Comm waits inside the phases that are not times, or longer than their phase (the
    # scorer takes compute times from them: monitor/stragglers.py [Note: straggler
    # scoring]): the same scores whether they came as columns or as dicts.
    hostile: list[tuple[str, Any]] = [
        ("comm_wait_forward_s", "0.1"),
        ("comm_wait_backward_s", -1.0),
        ("comm_wait_optimizer_s", True),
        ("comm_wait_forward_s", 10**400),
        ("forward_s", None),
        ("comm_wait_backward_s", 5.0),
        ("comm_wait_forward_s", None),
        ("comm_wait_backward_s", float("inf")),
    ]
    for i, (field, value) in enumerate(hostile):
        batches[i + 1][i % 6][field] = value
    return run, batches


def _state(model: MonitorModel, now: float) -> Any:
    snap = model.snapshot(now)
    rows = {r: (row.record, row.status, row.flags, row.age_s) for r, row in snap.rows.items()}
    history = {r: model.history(r) for r in model.ranks}
    return (
        rows,
        history,
        snap.summary,
        [(step, round(v, 9)) for step, v in snap.loss_curve],  # sums in another order
        [(step, round(v, 6)) for step, v in snap.throughput_curve],
        snap.stragglers,
        [(e["rank"], e["kind"], e["time"], e.get("run_id")) for e in model.events],
        model.bad_records,
        model.first_time,
        {r: model.stragglers.scores(r) for r in model.ranks},
    )


def test_a_model_fed_columns_ends_as_one_fed_dicts() -> None:
    run, batches = _stream()
    by_rows, by_columns = MonitorModel(), MonitorModel()
    for i, batch in enumerate(batches):
        now = run.time_of(3 * i + 3)
        by_rows.add_records(batch, now=now, source="a")
        block = RecordColumns.read(to_columns(batch))
        assert block is not None
        by_columns.add_columns(block, now=now, source="a")
    end = run.time_of(31)
    # Newest records stay pointers into their blocks until read ([Note: newest record on
    # demand]); one read alone (not through a snapshot) builds the same dict.
    assert by_columns.unbuilt and by_columns.ranks[2].pending is not None
    assert by_columns.ranks[2].record == by_rows.ranks[2].record
    assert by_columns.ranks[2].pending is None and by_columns.ranks[3].pending is not None
    assert any(e["kind"] == "straggler" for e in by_columns.events)
    assert len(by_columns.snapshot(end).loss_curve) == 30
    assert _state(by_columns, end) == _state(by_rows, end)


def test_columns_with_bad_ranks_or_several_runs_take_the_row_path() -> None:
    good = [{**_record(r, 1), "time": 1.0, "loss": 2.0, "run_id": "a"} for r in range(3)]
    bad = [{**good[0], "rank": "zero"}, good[1], {**good[2], "run_id": "b"}]
    # Valid ranks, but values numpy must not take: a bool and a str loss, a huge int.
    odd = [
        {**good[0], "step": 2, "loss": True},
        {**good[1], "step": 2, "loss": "x"},
        {**good[2], "step": 2, "tokens_per_s": 10**400},
    ]
    book_rows, book_cols = RunBook(MonitorSettings()), RunBook(MonitorSettings())
    for records in (good, bad, odd):
        book_rows.add_records(records, now=2.0)
        block = RecordColumns.read(to_columns(records))
        assert block is not None
        book_cols.add_columns(block, now=2.0)
    assert book_cols.run_ids == book_rows.run_ids == ["a", "b"]
    for run_id in ("a", "b"):
        assert _state(book_cols.model(run_id), 3.0) == _state(book_rows.model(run_id), 3.0)
        assert book_cols.info(run_id) == book_rows.info(run_id)
    assert book_cols.model("a").bad_records == 1
    empty = RecordColumns.read({"rank": [], "step": []})
    assert empty is not None
    book_cols.model("a").add_columns(empty, now=4.0)  # a hostile empty block: no change
    assert _state(book_cols.model("a"), 3.0) == _state(book_rows.model("a"), 3.0)


def test_receiver_asks_for_columns_and_keeps_rows_and_columns_apart(tmp_path: Path) -> None:
    path = str(tmp_path / "fake.sock")
    first = [_record(0, 1), _record(1, 1)]
    columns = to_columns(first)
    frames: list[dict[str, Any]] = [
        {"type": "batch", "record_columns": columns},
        {"type": "batch", "records": [_record(0, 2)]},
        {"type": "batch", "record_columns": {"rank": [1], "step": [1, 2]}},  # malformed
        {"type": "batch", "record_columns": to_columns([_record(1, 2), _record(2, 2)])},
    ]
    batches: list[Batch] = []

    async def scenario() -> None:
        server = await _serve_frames(frames, path)
        client = RelayClient(
            path, on_batch=batches.append, on_status=lambda *_: None, batch_s=0.5, columns=True
        )
        task = asyncio.create_task(client.run())
        deadline = time.monotonic() + 120  # only ends a failure: generous for loaded CI
        while sum(len(b.columns) for b in batches) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()

    asyncio.run(scenario())
    assert all(not (b.records and b.columns) for b in batches)
    order = [
        x for b in batches for x in (b.records or [r for block in b.columns for r in block.rows()])
    ]
    bad = {"rank": [1], "step": [1, 2]}
    assert order == [*first, _record(0, 2), bad, _record(1, 2), _record(2, 2)]


def test_hello_asks_for_columns_only_with_batches(tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    async def scenario(batch_s: float | None, columns: bool) -> None:
        from fsdpx.telemetry.wire.protocol import encode_frame, make_challenge

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(encode_frame(make_challenge(auth_required=False)))
            data = await reader.read(65536)
            seen.append(msgpack.unpackb(data[4:]))
            writer.close()

        sock = str(tmp_path / f"h-{batch_s}-{columns}.sock")
        server = await asyncio.start_unix_server(handle, sock)
        client = RelayClient(
            sock,
            on_batch=lambda b: None,
            on_status=lambda *_: None,
            batch_s=batch_s,
            columns=columns,
            reconnect=False,
        )
        await asyncio.wait_for(client.run(), 30)
        server.close()

    for batch_s, columns in ((0.5, True), (None, True), (0.5, False)):
        asyncio.run(scenario(batch_s, columns))
    assert seen[0]["columns"] is True and "columns" not in seen[1] and "columns" not in seen[2]


def test_hello_columns_must_be_a_bool() -> None:
    from fsdpx.telemetry.wire.protocol import ProtocolError
    from fsdpx.telemetry.wire.validate import check_hello

    hello = {"type": "hello", "version": 1, "role": "monitor", "host": "h", "pid": 1}
    check_hello({**hello, "batch_s": 0.5, "columns": True})
    with pytest.raises(ProtocolError, match=r"^hello field 'columns' must be a bool; got int 1$"):
        check_hello({**hello, "columns": 1})
