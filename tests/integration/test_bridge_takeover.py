"""A successor takes the slot over in seconds, not after ``wal_sender_timeout``.

The predecessor is paused (SIGSTOP: a frozen VM, a long stall) or cut off from PostgreSQL
with its connection left half-open (a lost node), so its walsender keeps the slot. The
successor fences it in Kafka, ends that walsender and streams; the predecessor, running
again, publishes and confirms nothing and stops with one line. Kafka holds every row once
(broker-log audit). The stack's wal_sender_timeout is 60 s: a successor that waited for it
would stream after a minute.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg import conninfo

from slotbridge_dev.stack.stack import Stack
from slotbridge_dev.stack.tcp_relay import FreezableRelay
from tests.integration.bridge_harness import Pipeline, one_line_error, sql, wait_for

SCHEMA = "takeover"
# Far below the stack's wal_sender_timeout (60 s), even on a slow, busy machine; the
# measured figure is printed (and in docs/operations.md).
TAKEOVER_LIMIT_S = 30.0


@pytest.fixture
def table(stack: Stack) -> Iterator[str]:
    sql(stack.primary_dsn, f"CREATE SCHEMA {SCHEMA}")
    sql(stack.primary_dsn, f"CREATE TABLE {SCHEMA}.t (id int PRIMARY KEY, v text)")
    yield f"{SCHEMA}.t"
    sql(stack.primary_dsn, f"DROP SCHEMA {SCHEMA} CASCADE")


def _ids(pipe: Pipeline, table: str) -> list[int]:
    return [r.value["after"]["id"] for r in pipe.changes(table)]


def _take_over(old: Pipeline, table: str, tmp_path: Path, resume: Callable[[], object]) -> float:
    """Start a successor while ``old`` is out of action; seconds until it streams. Then
    ``resume()`` brings the predecessor back, which must stop by itself, fenced."""
    new = Pipeline(old.stack, old.tables, tmp_path / "successor", name=old.name)
    new.workdir.mkdir()
    try:
        started = time.monotonic()
        new.start()
        new.wait_for_log(" streaming slot=", 120)
        took = time.monotonic() - started
        assert "ended the walsender of the predecessor" in new.output(), new.output()[-3000:]
        sql(old.stack.primary_dsn, f"INSERT INTO {table} VALUES (2, 'successor')")
        new.wait_caught_up()
        resume()
        assert old.proc is not None
        assert old.proc.wait(120) == 1, old.output()[-3000:]
        line = one_line_error(
            "\n".join(t for t in old.output().splitlines() if "[rdkafka#" not in t)
        )
        assert f"another bridge took over slot {old.name}" in line, line
        sql(old.stack.primary_dsn, f"INSERT INTO {table} VALUES (3, 'after')")
        new.wait_caught_up()
        assert _ids(new, table) == [1, 2, 3]
        assert new.stop() == 0
        new.audit()
        return took
    finally:
        new.kill()


def test_paused_predecessor_is_taken_over_in_seconds(
    stack: Stack, table: str, tmp_path: Path
) -> None:
    old = Pipeline(stack, [table], tmp_path / "old")
    old.workdir.mkdir()
    try:
        old.start()
        old.wait_caught_up()
        sql(stack.primary_dsn, f"INSERT INTO {table} VALUES (1, 'predecessor')")
        old.wait_caught_up()
        paused = old.proc
        assert paused is not None
        paused.send_signal(signal.SIGSTOP)
        took = _take_over(old, table, tmp_path, lambda: paused.send_signal(signal.SIGCONT))
        print(f"\nTAKEOVER paused predecessor: successor streaming {took:.1f}s after its start")
        assert took < TAKEOVER_LIMIT_S
    finally:
        old.cleanup()


def test_cut_off_predecessor_is_taken_over_in_seconds(
    stack: Stack, table: str, tmp_path: Path
) -> None:
    params = conninfo.conninfo_to_dict(stack.primary_dsn)
    relay = FreezableRelay(str(params["host"]), int(str(params["port"]))).start()
    old = Pipeline(stack, [table], tmp_path / "old")
    old.workdir.mkdir()
    old.extra["SLOTBRIDGE_SOURCE_DSN"] = conninfo.make_conninfo(
        stack.primary_dsn, port=str(relay.port)
    )
    try:
        old.start()
        old.wait_caught_up()
        sql(stack.primary_dsn, f"INSERT INTO {table} VALUES (1, 'predecessor')")
        old.wait_caught_up()
        relay.freeze()  # the server's side of the walsender's connection stays open
        took = _take_over(old, table, tmp_path, relay.close)
        print(f"\nTAKEOVER cut-off predecessor: successor streaming {took:.1f}s after its start")
        assert took < TAKEOVER_LIMIT_S
    finally:
        relay.close()
        old.cleanup()


def _creating_walsender(stack: Stack, slot: str) -> int | None:
    """The walsender holding ``slot`` while it is being created, once it shows."""
    with psycopg.connect(stack.primary_dsn) as conn:
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return None if row is None else row[0]


@contextmanager
def _creating_slot(stack: Stack, table: str, pipe: Pipeline) -> Iterator[psycopg.Connection]:
    """``pipe`` started with a transaction open, once the creation of its slot, waiting for
    that transaction, holds the slot; yields the transaction's connection."""
    with psycopg.connect(stack.primary_dsn) as open_txn:
        open_txn.execute(f"INSERT INTO {table} VALUES (1, 'open while creating')")
        pipe.start()
        pipe.wait_for_log(f"creating slot {pipe.name}", 120)
        wait_for(
            lambda: _creating_walsender(stack, pipe.name) is not None,
            120,
            "the slot to show while its creation waits",
        )
        yield open_txn


def test_predecessor_still_creating_the_slot_is_taken_over(
    stack: Stack, table: str, tmp_path: Path
) -> None:
    """A slot's creation waits for the transactions open when it began, holding the slot
    all along. A successor starting meanwhile ends that walsender, and the slot, never
    persisted, goes with it: the successor creates it again and streams. The predecessor,
    its CREATE_REPLICATION_SLOT broken, asks Kafka and stops fenced (a broken replication
    command is not a reason of its own: the CI run of abfcd93 saw a loser stop with
    START_REPLICATION's 'server closed the connection' instead)."""
    old = Pipeline(stack, [table], tmp_path / "old")
    old.workdir.mkdir()
    new = Pipeline(stack, [table], tmp_path / "new", name=old.name)
    new.workdir.mkdir()
    try:
        with _creating_slot(stack, table, old) as open_txn:
            new.start()
            new.wait_for_log("ended the walsender of the predecessor", 120)
            assert old.proc is not None
            assert old.proc.wait(120) == 1, old.output()[-3000:]
            line = one_line_error(
                "\n".join(t for t in old.output().splitlines() if "[rdkafka#" not in t)
            )
            assert f"another bridge took over slot {old.name}" in line, line
            open_txn.commit()  # the successor's creation waits for it too
        new.wait_for_log(" streaming slot=", 120)
        sql(stack.primary_dsn, f"INSERT INTO {table} VALUES (2, 'streamed')")
        new.wait_caught_up()
        assert "created failover slot" in new.output(), new.output()[-3000:]
        assert sorted(_ids(new, table)) == [1, 2]  # 1 from the initial snapshot
        assert new.stop() == 0
        new.audit()
    finally:
        new.kill()
        old.cleanup()


def test_a_broken_slot_command_waits_for_kafka_to_say_whether_the_bridge_lost(
    stack: Stack, table: str, tmp_path: Path
) -> None:
    """A replication command that breaks may have lost the slot to a successor, which only
    Kafka can tell. While Kafka cannot answer, the bridge keeps asking (a known wait), where
    it used to let the command's error stand and could start a session whose new producer
    fences the successor. Here the slot's creation breaks while the broker is down and no
    successor exists: once the broker is back, the bridge learns it was not fenced and
    stops with the command's own error, as a bridge that never streamed does."""
    old = Pipeline(stack, [table], tmp_path / "old")
    old.workdir.mkdir()
    # Each question then gives up after 10 s of the broker's absence, not 300.
    old.extra["SLOTBRIDGE_KAFKA_TRANSACTION_TIMEOUT_MS"] = "10000"
    kafka_down = False
    try:
        with _creating_slot(stack, table, old) as open_txn:
            stack.kafka.stop()
            kafka_down = True
            sql(
                stack.primary_dsn,
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                f"WHERE slot_name = '{old.name}'",
            )
            asking = "Kafka cannot say yet whether another bridge took the slot over"
            proc = old.proc
            assert proc is not None
            wait_for(
                lambda: old.output().count(asking) >= 2 or proc.poll() is not None,
                300,
                "two unanswered questions",
            )
            assert proc.poll() is None, old.output()[-3000:]
            # A question gives up once its transaction is past the timeout; its line must
            # say so, not promise to publish again what a batch held: it held no change.
            asked = [t for t in old.output().splitlines() if asking in t]
            assert any("the check for a newer bridge held its Kafka" in t for t in asked), asked
            assert not any("publishes what it held" in t for t in asked), asked
            stack.kafka.start()
            kafka_down = False
            assert proc.wait(180) != 0, old.output()[-3000:]
            line = one_line_error(
                "\n".join(t for t in old.output().splitlines() if "[rdkafka#" not in t)
            )
            assert "another bridge took over" not in line, line
            open_txn.rollback()
    finally:
        if kafka_down:
            stack.kafka.start()
        old.cleanup()
