"""A failover drill: a workload writing through a promotion, timed from the outside.

Used by the integration tests and usable from bench/ scripts. The drill only drives: it
runs the writer, calls the real ``slotbridge failover promote`` command, and measures. A
caller that has more to prove after the promotion (a bridge that must follow it, say)
passes ``before`` to act while the workload runs (crash the primary, start a bridge)
and reads the returned timings.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import yaml
from psycopg import conninfo

from slotbridge_dev.stack.cluster import wait_until
from slotbridge_dev.stack.stack import Stack, StackError

SLOTBRIDGE = str(Path(sys.executable).parent / "slotbridge")


def follow_primary(*dsns: str) -> str:
    """A multi-host DSN that connects to whichever of ``dsns`` accepts writes.

    ``target_session_attrs=read-write`` also skips a fenced old primary, because the server
    reports ``default_transaction_read_only`` to the client at connection time.
    """
    params = [conninfo.conninfo_to_dict(d) for d in dsns]
    first = {k: str(v) for k, v in params[0].items() if k not in ("host", "port")}
    return conninfo.make_conninfo(
        **first,
        host=",".join(str(p.get("host", "")) for p in params),
        port=",".join(str(p.get("port", "5432")) for p in params),
        target_session_attrs="read-write",
        connect_timeout="2",
    )


@dataclass
class Workload:
    """Small insert transactions in a loop on the current primary, until stopped."""

    dsn: str
    table: str
    committed: int = 0
    errors: int = 0
    longest_gap_s: float = 0.0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Workload:
        self._thread = threading.Thread(target=self._loop, name="workload", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Workload:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        return self

    def _loop(self) -> None:
        last = time.monotonic()
        conn: psycopg.Connection[tuple[Any, ...]] | None = None
        while not self._stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, autocommit=True)
                conn.execute(f"INSERT INTO {self.table} (payload) VALUES (repeat('x', 100))")
                now = time.monotonic()
                self.longest_gap_s = max(self.longest_gap_s, now - last)
                self.committed, last = self.committed + 1, now
                time.sleep(0.005)
            except psycopg.Error:
                self.errors += 1
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.1)
        if conn is not None:
            conn.close()


@dataclass
class DrillResult:
    promote_exit: int
    promote_seconds: float
    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    workload: Workload
    output: str
    committed_after_promote: int  # commits between the end of promote and the end of writes


def run_promote(
    config: Path, standby: str, *extra: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``slotbridge failover promote --json``, as an operator would run it."""
    return subprocess.run(
        [
            SLOTBRIDGE,
            "failover",
            "promote",
            "-c",
            str(config),
            "--standby",
            standby,
            "--json",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=env,
    )


def drill(
    config: Path,
    standby: str,
    workload: Workload,
    *,
    extra: tuple[str, ...] = (),
    before: Callable[[], object] | None = None,
    warmup_s: float = 2.0,
    cooldown_s: float = 2.0,
) -> DrillResult:
    """Writes run; ``before`` (e.g. crash the primary) fires; promote runs; writes go on."""
    workload.start()
    time.sleep(warmup_s)
    if before is not None:
        before()
    began = time.monotonic()
    proc = run_promote(config, standby, *extra)
    took = time.monotonic() - began
    at_promote = workload.committed
    time.sleep(cooldown_s)
    workload.stop()
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        data = {"summary": {}, "steps": []}
    return DrillResult(
        proc.returncode,
        took,
        data["summary"],
        data["steps"],
        workload,
        proc.stdout + proc.stderr,
        workload.committed - at_promote,
    )


def fence_by_stopping(stack: Stack) -> list[str]:
    """A fence_command that stops the stack's primary, as a real one would stop a VM."""
    code = (
        "import sys; from pathlib import Path; from slotbridge_dev.stack.stack import Stack; "
        "sys.exit(0 if Stack(Path(sys.argv[1])).node('primary').stop('fast') else 1)"
    )
    return [sys.executable, "-c", code, str(stack.state_dir)]


def settings_for(stack: Stack, path: Path, **extra: Any) -> Path:
    """Write the failover settings file describing ``stack``'s three nodes."""
    data: dict[str, Any] = {
        "primary": {"dsn": stack.primary_dsn},
        "standbys": {"standby": {"dsn": stack.standby_dsn}},
        "subscribers": {"subscriber": {"dsn": stack.subscriber_dsn}},
        "log_format": "text",
        "catchup_timeout_s": 30,
        "promote_timeout_s": 60,
        "stream_timeout_s": 60,
        **extra,
    }
    path.write_text(yaml.safe_dump(data))
    return path


def subscribe(stack: Stack, table: str, *, failover: bool = True) -> str:
    """Table on both sides, a publication, a subscription; waits until its slot is synced.

    Returns the subscription (= slot) name.
    """
    name = f"{table}_sub"
    ddl = f"CREATE TABLE {table} (id bigserial PRIMARY KEY, payload text)"
    primary, subscriber = stack.node("primary"), stack.node("subscriber")
    with primary.connect() as conn:
        conn.execute(ddl)
        conn.execute(f"CREATE PUBLICATION {table}_pub FOR TABLE {table}")
    with subscriber.connect() as conn:
        conn.execute(ddl)
        conn.execute(
            f"CREATE SUBSCRIPTION {name} CONNECTION '{stack.primary_dsn}' "
            f"PUBLICATION {table}_pub WITH (failover = {str(failover).lower()})"
        )

    def copied() -> bool:
        rows = subscriber.query(
            "SELECT count(*) FROM pg_subscription_rel r JOIN "
            "pg_subscription s ON s.oid = r.srsubid WHERE s.subname = %s "
            "AND r.srsubstate <> 'r'",
            (name,),
        )
        return rows == [(0,)]

    if wait_until(copied, 60) is None:
        raise StackError(f"subscription {name} did not finish its initial copy")
    if failover:
        stack.wait_slot_synced(name)
    return name
