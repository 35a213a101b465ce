"""The relay's Prometheus endpoint: `GET /metrics` answers the current per-rank gauges
(fsdpx/telemetry/wire/prometheus.py) from a thread of its own; loopback by default, a
bearer token for anything else ([Note: Prometheus access] there). Stdlib only.

Example::

    server = MetricsServer("127.0.0.1", 9464, token=None, latest=lambda: relay.latest)
    server.start()            # http://127.0.0.1:9464/metrics
    ...
    server.stop()
"""

from __future__ import annotations

import hmac
import ipaddress
import socket
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fsdpx.telemetry.wire.prometheus import CONTENT_TYPE, prometheus_text

DEFAULT_TOKEN_ENV = "FSDPX_PROMETHEUS_TOKEN"


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


class MetricsServer:
    """Serves `prometheus_text(latest())` at /metrics.

    Args:
        host, port: where to listen (port 0: a free port, see `port` after start).
        token: the bearer token scrapes must present; None: none (loopback only).
        latest: returns the latest record per rank (called per scrape).
    Raises:
        ValueError: a non-loopback host without a token.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str | None,
        latest: Callable[[], Mapping[Any, Mapping[str, Any]]],
    ) -> None:
        if not token and not is_loopback(host):
            raise ValueError(
                f"refusing to serve Prometheus metrics on {host}:{port} without a bearer "
                f"token: anyone who can reach it could read the run's telemetry. Set "
                f"{DEFAULT_TOKEN_ENV} (or --prometheus-token-env NAME) and give Prometheus "
                "the same token, or listen on 127.0.0.1"
            )
        self.token = token or None
        self.latest = latest
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        bound_host, bound_port = self._server.server_address[:2]
        self.host = bound_host if isinstance(bound_host, str) else bound_host.decode()
        self.port = int(bound_port)
        self._thread: threading.Thread | None = None

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                if server.token is not None:
                    given = self.headers.get("Authorization", "")
                    expected = f"Bearer {server.token}"
                    if not hmac.compare_digest(given.encode(), expected.encode()):
                        self.send_response(401)
                        self.send_header("WWW-Authenticate", "Bearer")
                        self.end_headers()
                        return
                body = prometheus_text(server.latest()).encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # a scrape every few seconds must not flood the relay's stderr

        return Handler

    def start(self) -> threading.Thread:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="fsdpx-prometheus", daemon=True
        )
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
