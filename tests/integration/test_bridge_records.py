"""Every DML kind and every listed type, end to end into Kafka, validated against schemas/."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import REPO, Pipeline, own_table_pipeline, read_topics, sql

SCHEMA = "rec"
TYPES_DDL = f"""
DROP SCHEMA IF EXISTS {SCHEMA} CASCADE;
CREATE SCHEMA {SCHEMA};
CREATE TYPE {SCHEMA}.mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE {SCHEMA}.everything (
    id bigint PRIMARY KEY, i2 smallint, i4 integer, num numeric(12,3), num_free numeric,
    f8 double precision, flag boolean, t text, vc varchar(20), u uuid, j json, jb jsonb,
    raw bytea, d date, tm time, ts timestamp, tstz timestamptz, iv interval,
    ints integer[], texts text[], nums numeric[], mood {SCHEMA}.mood, pt point
);
CREATE TABLE {SCHEMA}.full_ident (id int PRIMARY KEY, v text);
ALTER TABLE {SCHEMA}.full_ident REPLICA IDENTITY FULL;
CREATE TABLE {SCHEMA}.keyless (a int, b text);
CREATE TABLE {SCHEMA}.docs (id int PRIMARY KEY, j json, jb jsonb, grid int[][]);
"""

ROW = f"""
INSERT INTO {SCHEMA}.everything VALUES (
  1, -2, 40000, 123456789.125, '-0.000000001', 1.5, true, 'héllo "q"', 'vc',
  'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{{"a": [1, 2]}}', '{{"b": null}}', '\\x00ff10',
  '2024-02-29', '13:14:15.5', '2024-01-02 03:04:05.123456', '2024-01-02 03:04:05+02',
  '1 day 02:03:04', '{{1,NULL,3}}', '{{"a,b","c\\"d",NULL}}', '{{1.5,NaN}}', 'happy',
  '(1,2)')
"""

EXPECTED_AFTER = {
    "id": 1,
    "i2": -2,
    "i4": 40000,
    "num": "123456789.125",
    "num_free": "-0.000000001",
    "f8": 1.5,
    "flag": True,
    "t": 'héllo "q"',
    "vc": "vc",
    "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
    "j": {"a": [1, 2]},
    "jb": {"b": None},
    "raw": base64.b64encode(b"\x00\xff\x10").decode(),
    "d": "2024-02-29",
    "tm": "13:14:15.5",
    "ts": "2024-01-02T03:04:05.123456",
    "tstz": "2024-01-02T01:04:05Z",
    "iv": "P1DT2H3M4S",
    "ints": [1, None, 3],
    "texts": ["a,b", 'c"d', None],
    "nums": ["1.5", "NaN"],
    "mood": "happy",
    "pt": "(1,2)",
}


def _schemas() -> dict[str, dict[str, object]]:
    folder = REPO / "schemas"
    return {p.name.split(".")[0]: json.loads(p.read_text()) for p in folder.glob("*.json")}


@pytest.fixture(scope="module")
def published(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    sql(stack.primary_dsn, TYPES_DDL)
    pipe = Pipeline(
        stack,
        [f"{SCHEMA}.everything", f"{SCHEMA}.full_ident", f"{SCHEMA}.keyless", f"{SCHEMA}.docs"],
        Path(tmp_path_factory.mktemp("records")),
    )
    pipe.start()
    try:
        # The slot must exist before the workload, or its changes predate the stream.
        pipe.wait_caught_up(60)
        dsn = stack.primary_dsn
        sql(dsn, ROW)
        sql(
            dsn,
            f"UPDATE {SCHEMA}.everything SET t = 'changed', ints = '{{{{1,2}},{{3,4}}}}'"
            " WHERE id = 1",
        )
        sql(dsn, f"UPDATE {SCHEMA}.everything SET id = 2 WHERE id = 1")
        sql(dsn, f"DELETE FROM {SCHEMA}.everything WHERE id = 2")
        sql(dsn, f"INSERT INTO {SCHEMA}.full_ident VALUES (1, 'old')")
        sql(dsn, f"UPDATE {SCHEMA}.full_ident SET v = 'new' WHERE id = 1")
        sql(dsn, f"INSERT INTO {SCHEMA}.keyless VALUES (1, 'x')")
        sql(dsn, f"TRUNCATE {SCHEMA}.full_ident")
        sql(
            dsn,
            f"INSERT INTO {SCHEMA}.docs VALUES (1, ' null ', 'null'), (2, NULL, NULL),"
            f" (3, '{{\"a\": null}}', '[null]')",
        )
        sql(dsn, f"UPDATE {SCHEMA}.docs SET jb = '{{}}' WHERE id = 1")
        sql(dsn, "SELECT pg_logical_emit_message(true, 'rec.note', 'hello')")
        # Sent outside any transaction (heartbeats, other tools' watermarks): not
        # published, and the stream goes on past it.
        sql(dsn, "SELECT pg_logical_emit_message(false, 'rec.signal', 'ping')")
        sql(dsn, "SELECT pg_logical_emit_message(true, 'rec.note', 'after the signal')")
        pipe.wait_caught_up(90)
        yield pipe
        assert pipe.stop() == 0
        pipe.audit()
    finally:
        pipe.cleanup()


def test_types_and_dml_kinds(published: Pipeline) -> None:
    records = read_topics(published.stack.kafka, [published.topic("rec.everything")])
    ops = [(r.value["op"] if r.value else None) for r in records]
    # insert, update, key change (delete + tombstone of the old key, then the update), delete
    assert ops == ["c", "u", "d", None, "u", "d", None]
    insert = records[0]
    assert insert.key == {"id": 1}
    assert insert.value["after"] == EXPECTED_AFTER
    assert insert.value["before"] is None
    assert records[1].value["after"]["ints"] == [[1, 2], [3, 4]]
    assert records[1].value["after"]["t"] == "changed"
    assert records[4].key == {"id": 2} and records[4].value["before"] == {"id": 1}
    assert records[5].value["before"] == {"id": 2} and records[5].value["after"] is None
    assert records[6].key == {"id": 2}
    for r in records:
        if r.value:
            src = r.value["source"]
            assert src["schema"] == "rec" and src["table"] == "everything"
            assert src["lsn"] <= src["commit_lsn"]
            assert src["txId"] > 0


def test_json_null_is_told_from_sql_null(published: Pipeline) -> None:
    records = read_topics(published.stack.kafka, [published.topic("rec.docs")])
    seen = {(r.value["op"], r.value["after"]["id"]): r.value for r in records}
    assert seen[("c", 1)]["after"] == {"id": 1, "j": None, "jb": None, "grid": None}
    assert seen[("c", 1)]["json_nulls"] == {"after": ["j", "jb"]}
    assert seen[("c", 2)]["after"] == {"id": 2, "j": None, "jb": None, "grid": None}
    # JSON null inside a document is just JSON; SQL NULL is no JSON null.
    assert "json_nulls" not in seen[("c", 2)] and "json_nulls" not in seen[("c", 3)]
    assert seen[("c", 3)]["after"] == {"id": 3, "j": {"a": None}, "jb": [None], "grid": None}
    assert seen[("u", 1)]["after"] == {"id": 1, "j": None, "jb": {}, "grid": None}
    assert seen[("u", 1)]["json_nulls"] == {"after": ["j"]}


def test_replica_identity_full_carries_before_and_truncate(published: Pipeline) -> None:
    records = published.changes("rec.full_ident")
    assert [r.value["op"] for r in records] == ["c", "u", "t"]
    update = records[1]
    assert update.key == {"id": 1}
    assert update.value["before"] == {"id": 1, "v": "old"}
    assert update.value["after"] == {"id": 1, "v": "new"}
    truncate = records[2]
    assert truncate.key is None and truncate.value["before"] is None


def test_keyless_table_is_published_with_null_key(published: Pipeline) -> None:
    records = published.changes("rec.keyless")
    assert [(r.key, r.value["after"]) for r in records] == [(None, {"a": 1, "b": "x"})]
    assert "has no primary key or replica identity" in published.output()


def test_every_record_validates_against_schemas(published: Pipeline) -> None:
    schemas = _schemas()
    topics = {
        published.topic(t): "change_value"
        for t in ("rec.everything", "rec.full_ident", "rec.keyless")
    }
    topics[f"{published.prefix}.transaction"] = "transaction"
    topics[f"{published.prefix}.schema"] = "table_schema"
    topics[f"{published.prefix}.message"] = "message"
    topics[published.progress_topic] = "progress"
    records = read_topics(published.stack.kafka, list(topics))
    checked = 0
    for r in records:
        if r.value is None:
            continue
        jsonschema.validate(r.value, schemas[topics[r.topic]])
        checked += 1
    assert checked >= 15
    kinds = {topics[r.topic] for r in records}
    assert kinds == {"change_value", "transaction", "table_schema", "message", "progress"}


def test_only_transactional_messages_are_published(published: Pipeline) -> None:
    records = read_topics(published.stack.kafka, [f"{published.prefix}.message"])
    seen = [(r.value["prefix"], base64.b64decode(r.value["content"])) for r in records]
    assert seen == [("rec.note", b"hello"), ("rec.note", b"after the signal")]
    assert all(r.value["transactional"] for r in records)


def test_schema_topic_describes_columns(published: Pipeline) -> None:
    records = read_topics(published.stack.kafka, [f"{published.prefix}.schema"])
    everything = [r.value for r in records if r.value["table"] == "everything"]
    assert len(everything) == 1
    cols = {c["name"]: c for c in everything[0]["columns"]}
    assert cols["num"]["type"] == "numeric(12,3)"
    assert cols["id"]["nullable"] is False and cols["id"]["key"] is True
    assert cols["mood"]["type"] == "rec.mood"
    assert everything[0]["key_columns"] == ["id"]
    # Declared dimensions ride along when there is more than one (format_type hides them).
    assert "dimensions" not in cols["ints"]
    docs = [r.value for r in records if r.value["table"] == "docs"]
    assert {c["name"]: c.get("dimensions") for c in docs[0]["columns"]} == {
        "id": None,
        "j": None,
        "jb": None,
        "grid": 2,
    }


def test_status_command_reports_slot_origin_and_kafka(published: Pipeline) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "status", "--json"],
        cwd=REPO,
        env=published.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["exists"] is True and report["plugin"] == "pgoutput"
    assert report["failover"] is True and report["active"] is True
    assert report["origin_lsn"] == report["kafka_published_lsn"]
    assert report["decoding"]["total_txns"] >= 8
    table = subprocess.run(
        [sys.executable, "-m", "services.cli", "status"],
        cwd=REPO,
        env=published.env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "confirmed_flush_lsn" in table.stdout and table.returncode == 0


@pytest.fixture(scope="module", params=["slotbridge", "debezium"])
def no_tombstones(
    request: pytest.FixtureRequest, stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    """A bridge with ``tombstones_on_delete: false``, in each record format, over a table of
    its own; a purge of many rows (the compiled path) and a key change and a single delete
    (the decoder's path), each in a transaction of its own."""
    table = f"{SCHEMA}.no_tomb_{request.param[:3]}"
    pipe = own_table_pipeline(
        stack,
        Path(tmp_path_factory.mktemp("notomb")),
        table,
        {"SLOTBRIDGE_VALUE_FORMAT": request.param, "SLOTBRIDGE_TOMBSTONES_ON_DELETE": "false"},
    )
    pipe.start()
    try:
        pipe.wait_caught_up(60)
        dsn = stack.primary_dsn
        sql(dsn, f"INSERT INTO {table} SELECT g, 'row ' || g FROM generate_series(1, 50) g")
        sql(dsn, f"DELETE FROM {table} WHERE id <= 40")
        sql(dsn, f"UPDATE {table} SET id = 100 WHERE id = 41")
        sql(dsn, f"DELETE FROM {table} WHERE id = 42")
        pipe.wait_caught_up(90)
        yield pipe
        assert pipe.stop() == 0
        pipe.audit()
    finally:
        pipe.cleanup()


def _op(value: dict[str, object]) -> object:
    """A change record's op, in either record format."""
    payload = value.get("payload", value)
    assert isinstance(payload, dict)
    return payload["op"]


def test_without_tombstones_a_delete_is_its_record_alone(no_tombstones: Pipeline) -> None:
    (table,) = no_tombstones.tables or []
    records = read_topics(no_tombstones.stack.kafka, [no_tombstones.topic(table)])
    assert all(r.value is not None for r in records), "a tombstone was written"
    ops = [_op(r.value) for r in records]
    # 50 inserts, 40 deletes, the key change (the old key's delete, then the new key's row:
    # an update in the default format, a create in Debezium's), one more delete.
    changed = "c" if "debezium" in no_tombstones.extra["SLOTBRIDGE_VALUE_FORMAT"] else "u"
    assert ops == ["c"] * 50 + ["d"] * 40 + ["d", changed, "d"]
    keys = [r.key.get("payload", r.key) for r in records[50:]]
    assert keys == [{"id": i} for i in range(1, 42)] + [{"id": 100}, {"id": 42}]
