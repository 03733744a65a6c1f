"""Initial snapshot: the seam between snapshot and stream has no gap and no overlap."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from services.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, sql

SCHEMA = "snap"
ROWS = {"a": 120_000, "b": 60_000, "c": 20_000}  # 200k rows across three tables


def _load(stack: Stack) -> None:
    statements = [f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE", f"CREATE SCHEMA {SCHEMA}"]
    for table, count in ROWS.items():
        statements += [
            f"CREATE TABLE {SCHEMA}.{table} (id int PRIMARY KEY, v int NOT NULL, note text)",
            f"INSERT INTO {SCHEMA}.{table} SELECT g, 0, md5(g::text) "
            f"FROM generate_series(1, {count}) g",
        ]
    sql(stack.primary_dsn, "; ".join(statements))


def _writer(dsn: str, stop: threading.Event) -> threading.Thread:
    """Concurrent writes while the snapshot runs: new rows, updates, deletes."""
    def run() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            n = 0
            while not stop.is_set():
                n += 1
                conn.execute(f"INSERT INTO {SCHEMA}.a VALUES (%s, 1, 'new')", (1_000_000 + n,))
                conn.execute(f"UPDATE {SCHEMA}.b SET v = v + 1 WHERE id = %s", (n % 500 + 1,))
                conn.execute(f"DELETE FROM {SCHEMA}.c WHERE id = %s", (n,))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _state_from_topics(pipe: Pipeline, table: str) -> tuple[dict[int, Any], int]:
    """Replay the change topic into a table; also count keys both snapshotted and inserted."""
    rows: dict[int, Any] = {}
    snapshotted: set[int] = set()
    overlap = 0
    for r in pipe.changes(f"{SCHEMA}.{table}"):
        op, key = r.value["op"], r.key["id"]
        if op == "r":
            snapshotted.add(key)
        if op == "c" and key in snapshotted:
            overlap += 1
        if op == "d":
            rows.pop(key, None)
        else:
            after = r.value["after"]
            rows[key] = (after["v"], after["note"])
    return rows, overlap


def _assert_topics_equal_tables(pipe: Pipeline) -> None:
    for table in ROWS:
        source = {i: (v, note) for i, v, note in
                  sql(pipe.stack.primary_dsn, f"SELECT id, v, note FROM {SCHEMA}.{table}")}
        replayed, overlap = _state_from_topics(pipe, table)
        assert overlap == 0, f"{table}: {overlap} rows both in the snapshot and the stream"
        assert len(replayed) == len(source), table
        assert replayed == source, table


@pytest.mark.slow
def test_snapshot_with_concurrent_writes_then_kill_and_restart(stack: Stack,
                                                               tmp_path: Path) -> None:
    _load(stack)
    pipe = Pipeline(stack, [f"{SCHEMA}.{t}" for t in ROWS], tmp_path)
    stop = threading.Event()
    writer = _writer(stack.primary_dsn, stop)
    try:
        # First attempt dies right before its Kafka commit: nothing may become visible.
        code, output = pipe.run_to_exit(300, SLOTBRIDGE_FAILPOINTS="snapshot_before_commit=kill")
        assert code == -9, output[-2000:]
        assert pipe.changes(f"{SCHEMA}.a") == []
        pipe.start()
        pipe.wait_for_log("snapshot read", 300)
        stop.set()
        writer.join(30)
        pipe.wait_caught_up(300)
        assert pipe.stop() == 0
        _assert_topics_equal_tables(pipe)
        log = pipe.output()
        assert "slot has no published snapshot; recreating it" in log
        snapshot_records = [r for r in pipe.changes(f"{SCHEMA}.a") if r.value["op"] == "r"]
        # The writer kept inserting before the second snapshot: at least the loaded rows,
        # each exactly once.
        assert len(snapshot_records) >= ROWS["a"]
        assert len({r.key["id"] for r in snapshot_records}) == len(snapshot_records)
        assert all(r.value["source"]["snapshot"] == "true" and r.value["source"]["txId"] is None
                   for r in snapshot_records[:10])
    finally:
        stop.set()
        pipe.cleanup()


def test_snapshot_of_unreadable_table_names_it(stack: Stack, tmp_path: Path) -> None:
    """A least-privilege role (REPLICATION + origin functions, no superuser)."""
    dsn = stack.primary_dsn
    sql(dsn, """
        DROP SCHEMA IF EXISTS snapdeny CASCADE; CREATE SCHEMA snapdeny;
        CREATE TABLE snapdeny.open (id int PRIMARY KEY); INSERT INTO snapdeny.open VALUES (1);
        CREATE TABLE snapdeny.secret (id int PRIMARY KEY); INSERT INTO snapdeny.secret VALUES (1);
        DROP ROLE IF EXISTS sb_cdc; CREATE ROLE sb_cdc LOGIN REPLICATION;
        GRANT USAGE ON SCHEMA snapdeny TO sb_cdc; GRANT SELECT ON snapdeny.open TO sb_cdc;
        GRANT EXECUTE ON FUNCTION pg_replication_origin_create(text),
              pg_replication_origin_advance(text, pg_lsn),
              pg_replication_origin_progress(text, boolean) TO sb_cdc;""")
    pipe = Pipeline(stack, ["snapdeny.open", "snapdeny.secret"], tmp_path)
    sql(dsn, f"CREATE PUBLICATION {pipe.name} FOR TABLE snapdeny.open, snapdeny.secret")
    pipe.extra["SLOTBRIDGE_SOURCE_DSN"] = dsn.replace("user=postgres", "user=sb_cdc")
    pipe.extra["SLOTBRIDGE_CREATE_PUBLICATION"] = "false"
    try:
        code, output = pipe.run_to_exit(120)
        assert code == 2, output
        errors = [line for line in output.splitlines() if " ERROR " in line]
        assert len(errors) == 1 and "Traceback" not in output, output
        assert "snapdeny.secret" in errors[0] and "GRANT SELECT" in errors[0]
        assert pipe.changes("snapdeny.open") == []  # the aborted snapshot stays invisible
    finally:
        pipe.cleanup()
