"""Initial snapshot: the seam between snapshot and stream has no gap and no overlap."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from services.stack.cluster import free_ports
from services.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, sql, wait_for

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


def _writer(dsn: str, stop: threading.Event,
            step: Callable[[psycopg.Connection[Any], int], None]) -> threading.Thread:
    """Runs ``step(conn, n)`` for n = 1, 2, ... until stopped."""
    def run() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            n = 0
            while not stop.is_set():
                n += 1
                step(conn, n)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _snapshot_writes(conn: psycopg.Connection[Any], n: int) -> None:
    """Concurrent writes while the snapshot runs: new rows, updates, deletes."""
    conn.execute(f"INSERT INTO {SCHEMA}.a VALUES (%s, 1, 'new')", (1_000_000 + n,))
    conn.execute(f"UPDATE {SCHEMA}.b SET v = v + 1 WHERE id = %s", (n % 500 + 1,))
    conn.execute(f"DELETE FROM {SCHEMA}.c WHERE id = %s", (n,))


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
    writer = _writer(stack.primary_dsn, stop, _snapshot_writes)
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
        pipe.audit()
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
        DO $$ BEGIN IF EXISTS (SELECT FROM pg_roles WHERE rolname = 'sb_cdc') THEN
            DROP OWNED BY sb_cdc; DROP ROLE sb_cdc; END IF; END $$;
        CREATE ROLE sb_cdc LOGIN REPLICATION;
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


ADDED = "snapadd"


def _added_writes(conn: psycopg.Connection[Any], n: int) -> None:
    """Writes to a published table and to one not yet published."""
    with conn.transaction():
        conn.execute(f"INSERT INTO {ADDED}.base VALUES (%s, 'b')", (n,))
        conn.execute(f"INSERT INTO {ADDED}.late VALUES (%s, 0, 'new')", (1_000_000 + n,))
    conn.execute(f"UPDATE {ADDED}.late SET v = v + 1 WHERE id = %s", (n % 700 + 1,))
    conn.execute(f"DELETE FROM {ADDED}.late WHERE id = %s", (40_000 - n,))


def _replay(pipe: Pipeline, table: str) -> tuple[dict[int, Any], list[str]]:
    """The table a consumer rebuilds from the topic, and the topic's ops in order."""
    rows: dict[int, Any] = {}
    ops = []
    for r in pipe.changes(f"{ADDED}.{table}"):
        ops.append(r.value["op"])
        if r.value["op"] == "d":
            rows.pop(r.key["id"], None)
        else:
            rows[r.key["id"]] = tuple(r.value["after"][c] for c in sorted(r.value["after"])
                                      if c != "id")
    return rows, ops


def _source_rows(dsn: str, table: str) -> dict[int, Any]:
    rows = sql(dsn, f"SELECT to_jsonb(t) FROM {ADDED}.{table} t")
    return {r["id"]: tuple(r[c] for c in sorted(r) if c != "id") for (r,) in rows}


@pytest.mark.slow
def test_table_added_to_publication_is_snapshotted_while_streaming(
        stack: Stack, tmp_path: Path) -> None:
    """ALTER PUBLICATION ... ADD TABLE under writes: each added table's topic holds its rows
    once (snapshot, then only later changes), the stream never stops, and a kill right
    after the snapshot's Kafka commit changes nothing."""
    dsn = stack.primary_dsn
    sql(dsn, f"""
        DROP SCHEMA IF EXISTS {ADDED} CASCADE; CREATE SCHEMA {ADDED};
        CREATE TABLE {ADDED}.base (id int PRIMARY KEY, note text);
        CREATE TABLE {ADDED}.late (id int PRIMARY KEY, v int NOT NULL, note text);
        INSERT INTO {ADDED}.late SELECT g, 0, md5(g::text) FROM generate_series(1, 40000) g;
        CREATE TABLE {ADDED}.quiet (id int PRIMARY KEY, note text);
        INSERT INTO {ADDED}.quiet SELECT g, 'q' || g FROM generate_series(1, 1000) g;""")
    pipe = Pipeline(stack, [f"{ADDED}.base"], tmp_path)
    (http_port,) = free_ports(1)
    pipe.extra["SLOTBRIDGE_HTTP_PORT"] = str(http_port)
    stop = threading.Event()
    try:
        pipe.start(SLOTBRIDGE_FAILPOINTS="after_snapshot_commit=kill")
        pipe.wait_for_log("streaming", 60)
        writer = _writer(dsn, stop, _added_writes)
        # (No topic reads while the writer runs: a partition written to without a pause
        # never reports its end to a reader.)
        pipe.wait_for_log(f"created topic topic={pipe.prefix}.{ADDED}.base", 60)
        sql(dsn, f"ALTER PUBLICATION {pipe.name} ADD TABLE {ADDED}.late, {ADDED}.quiet")
        # Dies right after the first snapshot's Kafka commit; the restart must keep
        # dropping the changes that snapshot holds, and snapshot what is still missing.
        assert pipe.proc is not None and pipe.proc.wait(120) == -9, pipe.output()[-3000:]
        pipe.start()
        wait_for(lambda: pipe.output().count("snapshot of added tables published") >= 1
                 and {r.value["op"] for r in pipe.changes(f"{ADDED}.quiet")} == {"r"}, 120,
                 "both added tables snapshotted")
        time.sleep(2)  # writes go on after the snapshots
        stop.set()
        writer.join(30)
        pipe.wait_caught_up(120)
        report = json.loads(subprocess.run(
            [sys.executable, "-m", "services.cli", "status", "--json"], env=pipe.env(),
            capture_output=True, check=True, text=True).stdout)
        assert pipe.stop() == 0
        assert sql(dsn, "SELECT count(*) FROM pg_replication_slots WHERE temporary")[0][0] == 0
        for table in ("base", "late", "quiet"):
            replayed, ops = _replay(pipe, table)
            assert replayed == _source_rows(dsn, table), table
        _, ops = _replay(pipe, "late")
        snapshot_ops = ops[:ops.count("r")]
        assert snapshot_ops == ["r"] * len(snapshot_ops), "snapshot rows must precede changes"
        assert ops.count("r") >= 39_000 and {"c", "u", "d"} <= set(ops[ops.count("r"):]), ops[-9:]
        late_keys = [r.key["id"] for r in pipe.changes(f"{ADDED}.late") if r.value["op"] == "r"]
        inserted_later = {r.key["id"] for r in pipe.changes(f"{ADDED}.late")
                          if r.value["op"] == "c"}
        assert not inserted_later & set(late_keys), "a row both in the snapshot and the stream"
        pipe.audit()
        # A restart before the stream passed the snapshot point re-reads the pending entry.
        assert "snapshot of added tables starting" in pipe.output()
        tables = report["snapshot"]
        assert tables[f"{ADDED}.quiet"]["state"] == "published", report
        assert tables[f"{ADDED}.quiet"]["rows_done"] == 1000, report
    finally:
        stop.set()
        pipe.cleanup()


def test_sigterm_while_an_added_table_waits_for_a_long_transaction(
        stack: Stack, tmp_path: Path) -> None:
    """The temporary slot of an added table's snapshot waits for open transactions; SIGTERM
    must still stop the bridge promptly, and the next start takes the snapshot."""
    dsn = stack.primary_dsn
    sql(dsn, f"""
        DROP SCHEMA IF EXISTS {ADDED}w CASCADE; CREATE SCHEMA {ADDED}w;
        CREATE TABLE {ADDED}w.base (id int PRIMARY KEY);
        CREATE TABLE {ADDED}w.late (id int PRIMARY KEY);
        INSERT INTO {ADDED}w.late SELECT generate_series(1, 500);""")
    pipe = Pipeline(stack, [f"{ADDED}w.base"], tmp_path)
    blocker = psycopg.connect(dsn)
    try:
        pipe.start()
        pipe.wait_for_log("streaming", 60)
        blocker.execute(f"INSERT INTO {ADDED}w.base VALUES (-1)")  # holds an xid, uncommitted
        sql(dsn, f"ALTER PUBLICATION {pipe.name} ADD TABLE {ADDED}w.late")
        sql(dsn, f"INSERT INTO {ADDED}w.late VALUES (501)")
        pipe.wait_for_log("snapshot of added tables starting", 60)
        started = time.monotonic()
        assert pipe.stop(60) == 0, pipe.output()[-3000:]
        assert time.monotonic() - started < 40
        assert "stopped before the publisher finished" in pipe.output()
        wait_for(lambda: not sql(dsn, "SELECT 1 FROM pg_replication_slots WHERE temporary"), 30,
                 "the temporary slot to go")
        blocker.commit()
        pipe.start()
        pipe.wait_for_log("snapshot of added tables published", 60)
        pipe.wait_caught_up(60)
        assert pipe.stop() == 0
        late = pipe.changes(f"{ADDED}w.late")
        assert sorted(r.key["id"] for r in late) == list(range(1, 502))
        assert {r.value["op"] for r in late} == {"r"}
    finally:
        blocker.close()
        pipe.cleanup()
