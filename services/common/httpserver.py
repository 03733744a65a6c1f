"""The small HTTP server every daemon runs: /healthz, /readyz and Prometheus /metrics.

Liveness and readiness are callables the daemon supplies, returning ``(ok, reason)``, so
the server itself knows nothing of slots or standbys; so are any JSON documents it serves
(the bridge's snapshot progress). It runs in a daemon thread and never touches a secret:
metrics are whatever the registry holds.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

from services.common.errors import SlotbridgeError

Probe = Callable[[], tuple[bool, str]]


class HttpServerError(SlotbridgeError):
    """The server cannot listen where the settings say; the message names the fix."""

    retryable = False  # the settings must change


Document = Callable[[], dict[str, Any]]


class HealthServer:
    def __init__(
        self,
        host: str,
        port: int,
        live: Probe,
        ready: Probe,
        registry: CollectorRegistry = REGISTRY,
        documents: dict[str, Document] | None = None,
    ) -> None:
        probes = {"/healthz": live, "/readyz": ready}
        docs = documents or {}

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                elif path in probes:
                    ok, reason = probes[path]()
                    body = json.dumps({"ok": ok, "reason": reason}).encode()
                    self._send(200 if ok else 503, "application/json", body)
                elif path in docs:
                    self._send(200, "application/json", json.dumps(docs[path]()).encode())
                else:
                    self._send(404, "text/plain", b"not found\n")

            def _send(self, code: int, ctype: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # probes every few seconds would drown the daemon's own log

        try:
            self._server = ThreadingHTTPServer((host, port), Handler)
        except OSError as exc:  # socket.gaierror included: an unresolvable http_host
            raise HttpServerError(
                f"cannot serve HTTP on {host}:{port}: {exc.strerror or exc}; choose another "
                "http_port (0 turns the server off) or an http_host of this machine"
            ) from None
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
