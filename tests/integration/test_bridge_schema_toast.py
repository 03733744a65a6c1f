"""Schema changes mid-stream, unchanged TOAST values, and the daemon's HTTP endpoints."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from services.contract.records import TOAST_PLACEHOLDER
from slotbridge_dev.stack.cluster import free_ports
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, read_topics, sql, wait_for

SCHEMA = "evo"
BIG = 1024 * 1024


def _setup(stack: Stack) -> None:
    sql(
        stack.primary_dsn,
        f"""
        DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA};
        CREATE TABLE {SCHEMA}.shape (id int PRIMARY KEY, a int, b text);
        CREATE TABLE {SCHEMA}.doc (id int PRIMARY KEY, n int, body text);
        CREATE TABLE {SCHEMA}.doc_full (id int PRIMARY KEY, n int, body text);
        ALTER TABLE {SCHEMA}.doc_full REPLICA IDENTITY FULL;""",
    )


def test_schema_changes_and_toast(stack: Stack, tmp_path: Path) -> None:
    _setup(stack)
    port = free_ports(1)[0]
    pipe = Pipeline(
        stack,
        [f"{SCHEMA}.shape", f"{SCHEMA}.doc", f"{SCHEMA}.doc_full"],
        tmp_path,
        extra={"SLOTBRIDGE_HTTP_PORT": str(port), "SLOTBRIDGE_HTTP_HOST": "127.0.0.1"},
    )
    pipe.start()
    try:
        pipe.wait_caught_up(60)
        dsn = stack.primary_dsn
        sql(dsn, f"INSERT INTO {SCHEMA}.shape VALUES (1, 10, 'x')")
        sql(dsn, f"ALTER TABLE {SCHEMA}.shape ADD COLUMN c numeric(5,1)")
        sql(dsn, f"INSERT INTO {SCHEMA}.shape VALUES (2, 20, 'y', 2.5)")
        sql(dsn, f"ALTER TABLE {SCHEMA}.shape DROP COLUMN b")
        sql(dsn, f"INSERT INTO {SCHEMA}.shape VALUES (3, 30, 3.5)")
        sql(dsn, f"ALTER TABLE {SCHEMA}.shape ALTER COLUMN a TYPE bigint")
        sql(dsn, f"INSERT INTO {SCHEMA}.shape VALUES (4, 40000000000, 4.5)")
        for table in ("doc", "doc_full"):
            sql(
                dsn,
                f"INSERT INTO {SCHEMA}.{table} VALUES (1, 0, (SELECT string_agg("
                f"md5(g::text), '') FROM generate_series(1, {BIG // 32}) g))",
            )
            sql(dsn, f"UPDATE {SCHEMA}.{table} SET n = 1 WHERE id = 1")
        pipe.wait_caught_up(90)

        # Schema versions: one per shape, each announced before its first record.
        shape = pipe.changes(f"{SCHEMA}.shape")
        assert [(r.value["after"], r.value["source"]["schema_version"]) for r in shape] == [
            ({"id": 1, "a": 10, "b": "x"}, 1),
            ({"id": 2, "a": 20, "b": "y", "c": "2.5"}, 2),
            ({"id": 3, "a": 30, "c": "3.5"}, 3),
            ({"id": 4, "a": 40000000000, "c": "4.5"}, 4),
        ]
        schema_records = [
            r.value
            for r in read_topics(stack.kafka, [f"{pipe.prefix}.schema"])
            if r.value["table"] == "shape"
        ]
        assert [s["version"] for s in schema_records] == [1, 2, 3, 4]
        types = [{c["name"]: c["type"] for c in s["columns"]} for s in schema_records]
        assert types[1]["c"] == "numeric(5,1)" and "b" not in types[2]
        assert types[3]["a"] == "bigint"

        # Unchanged TOAST: marked by default, filled from the old tuple with FULL identity.
        doc = pipe.changes(f"{SCHEMA}.doc")
        assert len(doc[0].value["after"]["body"]) >= BIG
        assert doc[1].value["after"] == {"id": 1, "n": 1, "body": TOAST_PLACEHOLDER}
        full = pipe.changes(f"{SCHEMA}.doc_full")
        assert full[1].value["after"]["body"] == full[0].value["after"]["body"]

        # Health and metrics endpoints of the running daemon.
        base = f"http://127.0.0.1:{port}"
        assert urllib.request.urlopen(f"{base}/healthz", timeout=5).status == 200
        assert urllib.request.urlopen(f"{base}/readyz", timeout=5).status == 200
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        assert f'slotbridge_events_total{{slot="{pipe.name}"}}' in metrics
        events = [
            line for line in metrics.splitlines() if line.startswith("slotbridge_events_total{")
        ]
        assert float(events[0].split()[-1]) >= 8
        assert 'stat="stream_bytes"' in metrics and 'stat="total_txns"' in metrics
        assert "password" not in metrics.lower()
        assert pipe.stop() == 0
        pipe.audit()
    finally:
        pipe.cleanup()
    # After the daemon is gone nothing answers (it did not linger).
    wait_for(lambda: _refused(port), 10, "the HTTP server to stop")


def _refused(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)
    except (urllib.error.URLError, ConnectionError):
        return True
    return False
