"""Kafka Connect standalone running one connector, for the tests that put Debezium's own
connectors next to the bridge: its PostgreSQL source (the reference of the Debezium record
format) and its JDBC sink (a consumer of that format nobody here wrote).

The jars are one of the bootstrap's Maven sets (a classpath folder holding the Connect
runtime and the connector). Keys and values go through Connect's JsonConverter with the
``schema`` block (``schemas.enable=true``), the shape of the bridge's Debezium mode, or
without it (``schemas=False``: ``schemas.enable=false``, the bridge's
``debezium_schemas: false``). The JVM
runs with the heap and garbage collector Kafka's own ``connect-standalone.sh`` gives it, so
what bench/vs_debezium.py measures is Connect as it is usually started.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from psycopg.conninfo import conninfo_to_dict

from slotbridge_dev.stack.cluster import free_ports

_CONVERTER = "org.apache.kafka.connect.json.JsonConverter"
# connect-standalone.sh's KAFKA_HEAP_OPTS and kafka-run-class.sh's KAFKA_JVM_PERFORMANCE_OPTS.
_JVM = [
    "-Xms256M",
    "-Xmx2G",
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
]


def _properties(values: Mapping[str, str]) -> str:
    return "".join(f"{key}={value}\n" for key, value in values.items())


def debezium_postgres(
    name: str, dsn: str, prefix: str, slot: str, publication: str, tables: Iterable[str]
) -> dict[str, str]:
    """Debezium's PostgreSQL source connector streaming ``tables`` (``schema.table``) of an
    existing ``publication`` with pgoutput into ``<prefix>.<schema>.<table>``, without reading
    the tables first. With no stored offset it streams from where ``slot`` is: its creation
    when Debezium creates it, its confirmed position when it already exists."""
    parts = conninfo_to_dict(dsn)
    return {
        "name": name,
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "tasks.max": "1",
        "database.hostname": str(parts["host"]),
        "database.port": str(parts["port"]),
        "database.user": str(parts["user"]),
        "database.password": str(parts.get("password") or ""),
        "database.dbname": str(parts["dbname"]),
        "topic.prefix": prefix,
        "plugin.name": "pgoutput",
        "slot.name": slot,
        "publication.name": publication,
        "publication.autocreate.mode": "disabled",
        "table.include.list": ",".join(tables),
        "snapshot.mode": "no_data",
    }


class ConnectWorker:
    """One standalone worker process and its one connector (``connector`` holds ``name``).

    ``log_level`` is the root logger's: ERROR (log4j's own default) keeps a failing test's
    output to the failure; INFO adds the connector's progress lines."""

    def __init__(
        self,
        folder: Path,
        jars: Path,
        bootstrap: str,
        connector: Mapping[str, str],
        log_level: str = "ERROR",
        schemas: bool = True,
    ) -> None:
        self.folder = folder
        self.schemas = schemas
        self.jars = jars
        self.bootstrap = bootstrap
        self.connector = dict(connector)
        self.log_level = log_level
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
                    "key.converter.schemas.enable": str(self.schemas).lower(),
                    "value.converter": _CONVERTER,
                    "value.converter.schemas.enable": str(self.schemas).lower(),
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
        log4j = self.folder / "log4j2.properties"
        log4j.write_text(
            _properties(
                {
                    "rootLogger.level": self.log_level,
                    "rootLogger.appenderRef.stdout.ref": "STDOUT",
                    "appender.stdout.type": "Console",
                    "appender.stdout.name": "STDOUT",
                    "appender.stdout.layout.type": "PatternLayout",
                    "appender.stdout.layout.pattern": "[%d] %p %m (%c)%n",
                }
            )
        )
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    "java",
                    *_JVM,
                    f"-Dlog4j2.configurationFile={log4j}",
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
        """SIGTERM, then after ``timeout`` a thread dump into ``connect.hang.txt`` and
        SIGKILL: Connect's shutdown hook can hang for good in Jetty's ``Server.join``
        (``RestServer.stop``, with the REST thread pool still running; seen in CI once,
        after the test's checks had passed), and a leaked JVM holds 0.5 GB and its ports."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
            return
        except subprocess.TimeoutExpired:
            pass
        dump = self.folder / "connect.hang.txt"
        jstack = shutil.which("jstack")
        with dump.open("wb") as out:
            if jstack is None:
                out.write(b"no jstack on PATH\n")
            else:
                command = [jstack, str(self.proc.pid)]
                subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=30)
        self.proc.kill()
        self.proc.wait(timeout)
        print(f"Connect ignored SIGTERM for {timeout:.0f} s and was killed; threads: {dump}")
