"""Routes and key choices on the real stack: partitions of one table into one topic, a
table keyed by a unique index under REPLICA IDENTITY FULL, and the refusals."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, one_line_error, read_topics, sql


def test_routed_partitions_and_a_chosen_key(stack: Stack, tmp_path: Path) -> None:
    dsn = stack.primary_dsn
    tag = uuid.uuid4().hex[:6]
    parts = [f"public.orders_{tag}_2025_{m}" for m in ("01", "02")]
    accounts = f"public.accounts_{tag}"
    for table in parts:
        sql(dsn, f"CREATE TABLE {table} (id bigint PRIMARY KEY, note text)")
    sql(
        dsn,
        f"CREATE TABLE {accounts} (id bigint PRIMARY KEY, region text NOT NULL,"
        " ref text NOT NULL, balance int, UNIQUE (region, ref))",
    )
    sql(dsn, f"ALTER TABLE {accounts} REPLICA IDENTITY FULL")
    pipe = Pipeline(stack, [*parts, accounts], tmp_path)
    routed = f"{pipe.prefix}.orders"
    pipe.extra.update(
        {
            "SLOTBRIDGE_ROUTES": json.dumps(
                [{"tables": [f"public.orders_{tag}_2025_*"], "topic": routed}]
            ),
            "SLOTBRIDGE_KEYS": json.dumps([{"tables": [accounts], "columns": ["region", "ref"]}]),
        }
    )
    try:
        pipe.start()
        pipe.wait_caught_up()
        for n, table in enumerate(parts):
            sql(dsn, f"INSERT INTO {table} SELECT i, 'n' || i FROM generate_series(1, 50) i")
            sql(dsn, f"UPDATE {table} SET note = 'u{n}' WHERE id <= 10")
            sql(dsn, f"DELETE FROM {table} WHERE id > 40")
        sql(dsn, f"INSERT INTO {accounts} VALUES (1, 'eu', 'a', 10), (2, 'us', 'b', 20)")
        sql(dsn, f"UPDATE {accounts} SET balance = 11 WHERE id = 1")
        sql(dsn, f"UPDATE {accounts} SET region = 'apac' WHERE id = 2")  # the chosen key moves
        pipe.wait_caught_up()
        assert pipe.stop() == 0

        records = read_topics(pipe.kafka, [routed])
        # Per source table, each key's last record is the row PostgreSQL holds.
        last: dict[tuple[str, int], object] = {}
        tombstoned: set[int] = set()
        for r in records:
            if r.value is None:
                tombstoned.add(r.key["id"])
                continue
            last[(r.value["source"]["table"], r.key["id"])] = r.value["after"]
        for table in parts:
            name = table.split(".")[1]
            expected = {
                i: {"id": i, "note": f"u{parts.index(table)}" if i <= 10 else f"n{i}"}
                for i in range(1, 41)
            }
            mine = {i: row for (t, i), row in last.items() if t == name and row is not None}
            assert mine == expected, table
        assert tombstoned == set(range(41, 51))
        assert {r.topic for r in records} == {routed}
        assert not read_topics(pipe.kafka, [pipe.topic(p) for p in parts])  # nothing unrouted

        keyed = read_topics(pipe.kafka, [pipe.topic(accounts)])
        keys = [(r.key, r.value is None) for r in keyed]
        assert keys == [
            ({"region": "eu", "ref": "a"}, False),
            ({"region": "us", "ref": "b"}, False),
            ({"region": "eu", "ref": "a"}, False),
            ({"region": "us", "ref": "b"}, False),  # the old key's delete...
            ({"region": "us", "ref": "b"}, True),  # ...and tombstone
            ({"region": "apac", "ref": "b"}, False),
        ]
        pipe.audit()
    finally:
        pipe.cleanup()
        for table in [*parts, accounts]:
            sql(dsn, f"DROP TABLE IF EXISTS {table}")


def test_routes_and_keys_that_could_lose_rows_are_refused_at_start(
    stack: Stack, tmp_path: Path
) -> None:
    dsn = stack.primary_dsn
    tag = uuid.uuid4().hex[:6]
    a, b = f"public.route_{tag}_a", f"public.route_{tag}_b"
    sql(dsn, f"CREATE TABLE {a} (id bigint PRIMARY KEY, code text NOT NULL UNIQUE)")
    sql(dsn, f"CREATE TABLE {b} (code text PRIMARY KEY)")
    pipe = Pipeline(stack, [a, b], tmp_path)
    try:
        pipe.extra["SLOTBRIDGE_ROUTES"] = json.dumps(
            [{"tables": [f"public.route_{tag}_*"], "topic": f"{pipe.prefix}.both"}]
        )
        code, output = pipe.run_to_exit()
        assert code != 0
        line = one_line_error(output)
        assert "are routed to topic" in line and "with different keys" in line, line
        pipe.extra["SLOTBRIDGE_ROUTES"] = "[]"
        pipe.extra["SLOTBRIDGE_KEYS"] = json.dumps([{"tables": [a], "columns": ["code"]}])
        code, output = pipe.run_to_exit()
        assert code != 0
        assert f"key (code) of {a} needs REPLICA IDENTITY FULL" in one_line_error(output)
    finally:
        pipe.cleanup()
        for table in (a, b):
            sql(dsn, f"DROP TABLE IF EXISTS {table}")
