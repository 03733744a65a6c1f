"""``slotbridge failover check`` and the watch daemon against real broken setups.

One dedicated stack walks through the broken setups in turn (each broken, checked, then
repaired and checked ready again), because building a stack per case would cost more than
the cases themselves. The destructive ones (standby down, invalidated slot) come last.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

from services.common.settings import load_settings
from services.failover.settings import FailoverSettings
from services.failover.watch import Watcher
from slotbridge_dev.drill import settings_for, subscribe
from slotbridge_dev.stack.cluster import free_ports, wait_until
from slotbridge_dev.stack.stack import Stack

SLOTBRIDGE = str(Path(sys.executable).parent / "slotbridge")


def check(config: Path) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [SLOTBRIDGE, "failover", "check", "-c", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.returncode, json.loads(proc.stdout)


def failed(data: dict[str, Any]) -> set[str]:
    return {c["code"] for c in data["checks"] if c["status"] == "fail"}


def assert_pinpointed(config: Path, *codes: str) -> dict[str, Any]:
    rc, data = check(config)
    assert rc == 1 and not data["ready"]
    assert set(codes) <= failed(data), failed(data)
    return data


def assert_ready(config: Path, timeout: float = 60) -> None:
    """Ready again (a repaired standby may need a moment to reconnect and resync)."""
    last: dict[str, Any] = {}

    def ready() -> bool:
        nonlocal last
        rc, last = check(config)
        return rc == 0

    assert wait_until(ready, timeout, interval=1.0), failed(last)


def alter(stack: Stack, node: str, *statements: str) -> None:
    with stack.node(node).connect() as conn:
        for statement in statements:
            conn.execute(statement)
        conn.execute("SELECT pg_reload_conf()")


def test_check_pinpoints_each_broken_setup(fresh_stack: Callable[[], Stack]) -> None:
    stack = fresh_stack()
    subscribe(stack, "orders")
    with stack.node("primary").connect() as conn:
        conn.execute(
            "SELECT pg_create_logical_replication_slot('bridge', 'pgoutput', false, false, true)"
        )
    stack.wait_slot_synced("bridge", advance=True)
    config = settings_for(stack, stack.state_dir / "failover.yaml", bridge_slots=["bridge"])
    assert_ready(config, timeout=5)

    for setting in ("sync_replication_slots", "hot_standby_feedback"):
        alter(stack, "standby", f"ALTER SYSTEM SET {setting} = off")
        assert_pinpointed(config, setting)
        alter(stack, "standby", f"ALTER SYSTEM RESET {setting}")
        assert_ready(config)

    no_db = f"host=127.0.0.1 port={stack.node('primary').port} user=postgres"
    alter(stack, "standby", f"ALTER SYSTEM SET primary_conninfo = '{no_db}'")
    assert_pinpointed(config, "primary_conninfo_dbname")
    alter(stack, "standby", "ALTER SYSTEM RESET primary_conninfo")
    assert_ready(config)

    # A subscription and a bridge slot without failover: both would be lost.
    with stack.node("primary").connect() as conn:
        conn.execute("SELECT pg_create_logical_replication_slot('bridge_nf', 'pgoutput')")
    subscribe(stack, "plain", failover=False)
    nf_config = settings_for(stack, stack.state_dir / "nf.yaml", bridge_slots=["bridge_nf"])
    data = assert_pinpointed(nf_config, "subscription_not_failover", "slot_not_failover")
    assert any("SET (failover = true)" in c["remedy"] for c in data["checks"])
    with stack.node("subscriber").connect() as conn:
        conn.execute("DROP SUBSCRIPTION plain_sub")
    assert_ready(config)

    # Standby down: with synchronized_standby_slots the primary sends nothing logical.
    stack.node("standby").stop("fast")
    with stack.node("primary").connect() as conn:
        conn.execute("INSERT INTO orders (payload) VALUES ('held back')")

    def sender_waits() -> bool:
        rows = stack.node("primary").query(
            "SELECT a.wait_event FROM pg_stat_activity a JOIN pg_replication_slots s "
            "ON s.active_pid = a.pid WHERE s.slot_name = 'orders_sub'"
        )
        return rows == [("WaitForStandbyConfirmation",)]

    assert wait_until(sender_waits, 30), "walsender not waiting for the standby"
    data = assert_pinpointed(
        config, "standby_reachable", "synchronized_standby_slots", "logical_senders_blocked"
    )
    blocked = next(c for c in data["checks"] if c["code"] == "logical_senders_blocked")
    assert "WaitForStandbyConfirmation" in blocked["detail"]
    assert stack.node("subscriber").query(
        "SELECT count(*) FROM orders WHERE payload = 'held back'"
    ) == [(0,)]
    stack.node("standby").start()
    assert_ready(config)
    assert wait_until(
        lambda: (
            stack.node("subscriber").query(
                "SELECT count(*) FROM orders WHERE payload = 'held back'"
            )
            == [(1,)]
        ),
        30,
    )

    # An invalidated slot: a failover slot nobody consumes, WAL past max_slot_wal_keep_size.
    with stack.node("primary").connect() as conn:
        conn.execute(
            "SELECT pg_create_logical_replication_slot('stale', 'pgoutput', false, false, true)"
        )
    stack.wait_slot_synced("stale", advance=True)
    stale_config = settings_for(
        stack, stack.state_dir / "stale.yaml", bridge_slots=["bridge", "stale"]
    )
    alter(stack, "primary", "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
    with stack.node("primary").connect() as conn:
        for _ in range(4):
            conn.execute("INSERT INTO orders (payload) SELECT 'wal' FROM generate_series(1, 100)")
            conn.execute("SELECT pg_switch_wal()")
        conn.execute("CHECKPOINT")
    data = assert_pinpointed(stale_config, "slot_invalidated")
    assert any("wal_removed" in c["detail"] for c in data["checks"])


@contextmanager
def writing(dsn: str, table: str) -> Iterator[None]:
    """Single-row inserts back to back on the primary while the block runs."""
    stop = threading.Event()

    def write() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute(f"INSERT INTO {table} (payload) VALUES ('load')")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    try:
        yield
    finally:
        stop.set()
        writer.join(10)


def test_check_is_ready_under_write_load(fresh_stack: Callable[[], Stack]) -> None:
    """Under synchronized_standby_slots each commit makes the logical walsender wait for
    the standby, so a busy one is mostly seen in that wait; the standby keeps confirming,
    and ``check`` must call that ready, every time."""
    stack = fresh_stack()
    subscribe(stack, "orders")
    config = settings_for(stack, stack.state_dir / "failover.yaml")
    primary, subscriber = stack.node("primary"), stack.node("subscriber")
    with writing(stack.primary_dsn, "orders"):
        assert wait_until(
            lambda: subscriber.query("SELECT count(*) FROM orders")[0][0] > 100, 30
        ), "the subscription does not stream"
        waits = [
            primary.query(
                "SELECT a.wait_event FROM pg_stat_activity a JOIN "
                "pg_replication_slots s ON s.active_pid = a.pid "
                "WHERE s.slot_name = 'orders_sub'"
            )
            for _ in range(20)
        ]
        assert [("WaitForStandbyConfirmation",)] in waits, "the load does not make it wait"
        verdicts = [check(config) for _ in range(8)]
    assert [failed(data) for rc, data in verdicts if rc != 0] == []


def test_watch_exports_metrics_and_stops_on_sigterm(fresh_stack: Callable[[], Stack]) -> None:
    stack = fresh_stack()
    subscribe(stack, "orders")
    port = free_ports(1)[0]
    config = settings_for(
        stack,
        stack.state_dir / "failover.yaml",
        check_interval_s=1,
        http_port=port,
        log_format="json",
    )

    watcher = Watcher(load_settings(FailoverSettings, config))  # in-process: no HTTP server
    report = watcher.round()
    assert report.ready and watcher.ready()[0]
    value = watcher.registry.get_sample_value
    assert value("slotbridge_failover_ready", {"standby": "standby"}) == 1
    assert (
        value("slotbridge_failover_slot_ready", {"standby": "standby", "slot": "orders_sub"}) == 1
    )
    assert (
        value("slotbridge_failover_slot_lag_bytes", {"standby": "standby", "slot": "orders_sub"})
        is not None
    )
    assert value("slotbridge_failover_replay_lag_bytes", {"standby": "standby"}) is not None
    labels = {"subscriber": "subscriber", "subscription": "orders_sub"}
    assert value("slotbridge_failover_subscription_enabled", labels) == 1
    assert value("slotbridge_failover_subscription_streaming", labels) == 1

    # The daemon itself: serves health, logs JSON, exits cleanly on SIGTERM.
    proc = subprocess.Popen(
        [SLOTBRIDGE, "failover", "watch", "-c", str(config)],
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ),
    )
    assert proc.stderr is not None
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not any(e.get("msg") == "round done" for e in events):
        events.append(json.loads(proc.stderr.readline()))
    assert any(e.get("port") == port for e in events), events
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as resp:
        assert json.loads(resp.read())["ok"] is True
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert b"slotbridge_failover_slot_ready" in resp.read()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    rest = proc.stderr.read()
    assert '"msg": "stopped"' in rest
    assert "password" not in rest


def test_watch_follows_a_promotion_and_repoints(fresh_stack: Callable[[], Stack]) -> None:
    """Someone promoted the standby behind our back: watch finishes the failover itself."""
    stack = fresh_stack()
    subscribe(stack, "orders")
    config = settings_for(stack, stack.state_dir / "failover.yaml", auto_repoint=True, http_port=0)
    watcher = Watcher(load_settings(FailoverSettings, config))
    assert watcher.round().ready
    with stack.node("standby").connect() as conn:
        conn.execute("SELECT pg_promote()")
    watcher.round()
    assert (
        watcher.registry.get_sample_value(
            "slotbridge_failover_promotions_detected_total", {"standby": "standby"}
        )
        == 1
    )
    assert f"port={stack.node('standby').port}" in watcher.settings.primary.dsn
    conninfo = stack.node("subscriber").query(
        "SELECT subconninfo FROM pg_subscription WHERE subname = 'orders_sub'"
    )[0][0]
    assert f"port={stack.node('standby').port}" in conninfo
    # The old primary was fenced; writes on the new one reach the subscriber.
    assert stack.node("primary").query("SHOW default_transaction_read_only") == [("on",)]
    with stack.node("standby").connect() as conn:
        conn.execute("INSERT INTO orders (payload) VALUES ('after')")
    assert wait_until(
        lambda: (
            stack.node("subscriber").query("SELECT count(*) FROM orders WHERE payload = 'after'")
            == [(1,)]
        ),
        30,
    )
