"""The monitor against a real relay (fsdpx/telemetry/wire/relay.py) in this process: history for
a late monitor, live records after it, the shared-secret handshake, and the app itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fsdpx.telemetry.wire.relay import Relay
from fsdpx.telemetry.wire.transport import connect
from monitor.app import MonitorApp
from monitor.receiver import Batch, RelayClient
from monitor.synthetic import SyntheticRun

RUN = SyntheticRun(n_ranks=2, step_time_s=0.1)


@pytest.fixture
def relay_factory(tmp_path: Path) -> Iterator[Callable[..., str]]:
    relays: list[Relay] = []

    def start(secret: bytes | None = None) -> str:
        relay = Relay(str(tmp_path / f"r{len(relays)}.sock"), secret=secret)
        relay.bind()
        relay.start_thread()
        relays.append(relay)
        return str(tmp_path / f"r{len(relays) - 1}.sock")

    yield start
    for relay in relays:
        relay.stop()


class Ranks:
    """The synthetic run's ranks, connected to a relay as a publisher would be (one
    connection per rank, kept open: a closed one makes the relay report the rank dead)."""

    def __init__(self, address: str, secret: bytes | None = None) -> None:
        # Each hello names the rank and host its records carry (the relay checks it).
        self.conns = [
            connect(address, role="rank", secret=secret, timeout_s=5.0, rank=r, host=host, pid=1)
            for r in range(RUN.n_ranks)
            for host in [RUN.record(r, 1)["host"]]
        ]

    def publish(self, steps: range) -> None:
        for rank, conn in enumerate(self.conns):
            conn.send({"type": "records", "records": [RUN.record(rank, s) for s in steps]})

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


async def collect(client: RelayClient, until: Callable[[], bool], timeout_s: float = 20.0) -> None:
    task = asyncio.create_task(client.run())
    deadline = time.monotonic() + timeout_s
    try:
        while not until() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_late_monitor_gets_history_then_live_records(
    relay_factory: Callable[..., str],
) -> None:
    address = relay_factory()
    ranks = Ranks(address)
    ranks.publish(range(1, 4))  # before the monitor connects: history
    batches: list[Batch] = []
    statuses: list[tuple[bool, str]] = []

    def steps() -> set[tuple[int, int]]:
        return {(r["rank"], r["step"]) for b in batches for r in b.records}

    async def scenario() -> None:
        client = RelayClient(
            address,
            on_batch=batches.append,
            on_status=lambda up, detail: statuses.append((up, detail)),
        )

        def live_after_history() -> bool:
            if any(b.history for b in batches) and not getattr(live_after_history, "sent", 0):
                live_after_history.sent = 1  # type: ignore[attr-defined]
                ranks.publish(range(4, 6))
            return len(steps()) == 10

        await collect(client, live_after_history)

    asyncio.run(scenario())
    ranks.close()
    assert steps() == {(r, s) for r in range(2) for s in range(1, 6)}
    history = [b for b in batches if b.history]
    assert {(r["rank"], r["step"]) for b in history for r in b.records} == {
        (r, s) for r in range(2) for s in range(1, 4)
    }
    assert not any(r["step"] > 3 for b in history for r in b.records)
    assert statuses[0] == (True, "connected")


def test_secret_handshake(relay_factory: Callable[..., str]) -> None:
    address = relay_factory(secret=b"right")
    ranks = Ranks(address, secret=b"right")
    ranks.publish(range(1, 3))
    results: dict[bytes | None, tuple[list[Batch], list[str]]] = {}

    async def attempt(secret: bytes | None) -> None:
        batches: list[Batch] = []
        statuses: list[str] = []
        client = RelayClient(
            address,
            on_batch=batches.append,
            on_status=lambda up, detail: statuses.append(detail),
            secret=secret,
            reconnect=False,
        )
        await asyncio.wait_for(client.run(), 10) if secret != b"right" else await collect(
            client, lambda: len(batches) > 0
        )
        results[secret] = (batches, statuses)

    for secret in (None, b"wrong", b"right"):
        asyncio.run(attempt(secret))
    ranks.close()
    assert results[None][0] == [] and "requires a shared secret" in results[None][1][0]
    assert results[b"wrong"][0] == [] and "refused" in results[b"wrong"][1][0]
    assert {r["step"] for r in results[b"right"][0][0].records} == {1, 2}


def test_app_shows_live_records_from_a_relay(relay_factory: Callable[..., str]) -> None:
    address = relay_factory()
    ranks = Ranks(address)
    ranks.publish(range(1, 3))

    async def scenario() -> None:
        app = MonitorApp(sources=[address])
        async with app.run_test(size=(80, 24)) as pilot:
            deadline = time.monotonic() + 20
            while app.snapshot.summary.step != 2 and time.monotonic() < deadline:
                await pilot.pause(0.05)
            assert app.snapshot.summary.step == 2
            ranks.publish(range(3, 8))
            while app.snapshot.summary.step != 7 and time.monotonic() < deadline:
                await pilot.pause(0.05)
            assert app.snapshot.summary.step == 7
            assert app.snapshot.summary.alive == 2
            assert app._connections[address] == "connected"
            ranks.close()  # the relay reports both ranks gone: dead, the step stays
            while app.snapshot.summary.dead != 2 and time.monotonic() < deadline:
                await pilot.pause(0.05)
            assert app.snapshot.summary.dead == 2 and app.snapshot.summary.step == 7

    asyncio.run(scenario())
