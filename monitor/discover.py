"""Finding every node's relay for `fsdpx-monitor --rendezvous HOST:PORT` and
`fsdpx-monitor --discovery FILE` ([Note: relay discovery] in
fsdpx/telemetry/wire/discovery.py).

The file needs nothing beyond the standard library. The rendezvous store is torch's
TCPStore, so `--rendezvous` imports torch when it is used (only then: the monitor stays
torch-free otherwise, [Note: the wire package is torch-free]).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path

from fsdpx.telemetry.wire.discovery import STORE_KEY, RelayEntry, parse_relay_list

POLL_S = 0.2


def relays_from_file(
    path: Path, timeout_s: float, sleep: Callable[[float], None] = time.sleep
) -> list[RelayEntry]:
    """The relays listed in `path`, waiting up to `timeout_s` for rank 0 to write it.

    Raises:
        ValueError: no file after `timeout_s`, or a file that is not a relay list.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = path.read_text()
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise ValueError(
                    f"no relay list at {str(path)!r} after {timeout_s:g} s: the job's rank 0 "
                    "writes it at telemetry start-up when telemetry.discovery_file names it "
                    "(on a file system this machine sees); check the path, or raise "
                    "--discover-timeout"
                ) from None
            sleep(POLL_S)
        except OSError as exc:
            raise ValueError(f"cannot read the relay list {str(path)!r}: {exc.strerror}") from None
    return parse_relay_list(text, repr(str(path)))


def relays_from_store(endpoint: str, timeout_s: float) -> list[RelayEntry]:
    """The relays the job's rank 0 published in the rendezvous store at `endpoint`.

    Raises:
        ValueError: a bad endpoint, torch missing, no store there, or no list in it after
            `timeout_s`.
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(
            f"--rendezvous {endpoint!r}: expected HOST:PORT, the job's rendezvous endpoint "
            "(torchrun's --rdzv-endpoint; fsdpx launch's --master_addr:--master_port)"
        )
    try:
        from torch.distributed import TCPStore
    except ModuleNotFoundError:
        raise ValueError(
            "--rendezvous reads torch's rendezvous store and needs torch installed here; "
            "without it, use --discovery FILE (telemetry.discovery_file) or give the "
            "relays' addresses"
        ) from None
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = TCPStore(
            host.strip("[]"), int(port), is_master=False, wait_for_workers=False, timeout=timeout
        )
    except (RuntimeError, OSError) as exc:
        raise ValueError(
            f"no rendezvous store answers at {endpoint} ({_first_line(exc)}); is the job "
            "running, and is this its --rdzv-endpoint / --master_addr:--master_port?"
        ) from None
    try:
        store.wait([STORE_KEY], timeout)
        value = store.get(STORE_KEY)
    except (RuntimeError, OSError):
        raise ValueError(
            f"the rendezvous store at {endpoint} holds no relay list after {timeout_s:g} s: "
            "the job's rank 0 publishes it at telemetry start-up (telemetry.enabled, "
            "telemetry.publish_relays) into FSDPX_RDZV_ENDPOINT (fsdpx launch sets it; with "
            "plain torchrun export it as the --rdzv-endpoint); raise --discover-timeout, "
            "or give the relays' addresses"
        ) from None
    return parse_relay_list(value, f"the rendezvous store at {endpoint}")


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
