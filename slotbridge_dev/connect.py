"""Kafka Connect standalone running one connector, for the tests that put Debezium's own
connectors next to the bridge: its PostgreSQL source (the reference of the Debezium record
format) and its JDBC sink (a consumer of that format nobody here wrote).

The jars are one of the bootstrap's Maven sets (a classpath folder holding the Connect
runtime and the connector). Keys and values go through Connect's JsonConverter with the
``schema`` block (``schemas.enable=true``), the shape of the bridge's Debezium mode.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from slotbridge_dev.stack.cluster import free_ports

_CONVERTER = "org.apache.kafka.connect.json.JsonConverter"


def _properties(values: Mapping[str, str]) -> str:
    return "".join(f"{key}={value}\n" for key, value in values.items())


class ConnectWorker:
    """One standalone worker process and its one connector (``connector`` holds ``name``)."""

    def __init__(
        self, folder: Path, jars: Path, bootstrap: str, connector: Mapping[str, str]
    ) -> None:
        self.folder = folder
        self.jars = jars
        self.bootstrap = bootstrap
        self.connector = dict(connector)
        self.proc: subprocess.Popen[bytes] | None = None
        self.rest = ""

    @property
    def log_path(self) -> Path:
        return self.folder / "connect.log"

    def start(self) -> None:
        (rest_port,) = free_ports(1)
        self.rest = f"http://127.0.0.1:{rest_port}"
        worker = self.folder / "worker.properties"
        worker.write_text(
            _properties(
                {
                    "bootstrap.servers": self.bootstrap,
                    "key.converter": _CONVERTER,
                    "key.converter.schemas.enable": "true",
                    "value.converter": _CONVERTER,
                    "value.converter.schemas.enable": "true",
                    # A source's offsets; a sink's are its consumer group's.
                    "offset.storage.file.filename": str(self.folder / "offsets"),
                    "offset.flush.interval.ms": "1000",
                    "listeners": self.rest,
                    # The jars are a plain classpath: no plugin.path scan to wait for.
                    "plugin.discovery": "only_scan",
                }
            )
        )
        connector = self.folder / "connector.properties"
        connector.write_text(_properties(self.connector))
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    "java",
                    "-cp",
                    f"{self.jars}/*",
                    "org.apache.kafka.connect.cli.ConnectStandalone",
                    str(worker),
                    str(connector),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def status(self) -> dict[str, Any] | None:
        """The connector's REST status, or None while the worker does not answer yet."""
        url = f"{self.rest}/connectors/{self.connector['name']}/status"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                status: dict[str, Any] = json.load(response)
                return status
        except (urllib.error.URLError, ConnectionError):
            return None

    def check(self) -> dict[str, Any] | None:
        """The status (None while the REST API does not answer yet); a FAILED connector or
        task, or an exited worker, fails at once with Connect's own trace, so a record the
        connector cannot take is not a timeout."""
        assert self.proc is not None, "worker not started"
        if self.proc.poll() is not None:
            raise AssertionError(
                f"Connect exited ({self.proc.returncode}):\n{self.log_path.read_text()}"
            )
        status = self.status()
        if status is not None:
            states = [status["connector"], *status["tasks"]]
            failed = [s.get("trace", s["state"]) for s in states if s["state"] == "FAILED"]
            if failed:
                raise AssertionError("\n".join(failed))
        return status

    def wait_running(self, timeout: float) -> None:
        """Until the connector and its tasks run."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.check()
            states = [] if status is None else [status["connector"], *status["tasks"]]
            if len(states) > 1 and all(s["state"] == "RUNNING" for s in states):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"connector not running after {timeout}s: {status}")
            time.sleep(0.5)

    def stop(self, timeout: float = 30) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout)
