"""Column transforms on the real stack: nothing of a masked value leaves the bridge.

Known personal values go into inserts, updates, deletes, a key change, snapshot rows, a
TOASTed value and a column added mid-stream; then every byte of every topic the bridge
wrote (read_uncommitted, so aborted Kafka transactions too), its log and its /metrics are
searched for them. Only their transformed forms may appear. The Spark consumer's side is
in test_spark_consume.py (test_masked_columns_reach_delta_masked).
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition

from services.bridge.records.masking import HashRule, column_mask
from services.bridge.settings import MASKING_KEY_ENV
from services.common.kafka import END_READER_CONFIG
from slotbridge_dev.stack.cluster import free_ports
from slotbridge_dev.stack.kafka import Kafka
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, one_line_error, sql

KEY = "masking-key-of-the-test-0123456789"
TRANSFORMS = [
    {"tables": ["public.masked_*"], "columns": ["email", "phone*"], "transform": "hash"},
    {"tables": ["public.masked_*"], "columns": ["ssn"], "transform": "redact"},
    {"tables": ["public.masked_*"], "columns": ["card"], "transform": "mask", "keep_last": 4},
    {"tables": ["public.masked_*"], "columns": ["notes"], "transform": "drop"},
    {"tables": ["public.masked_*"], "columns": ["bio"], "transform": "truncate", "length": 3},
]
PII_COLUMNS = ["email", "ssn", "card", "phone*"]
# The values no byte the bridge writes may hold; every one is unique to this test.
SECRET = uuid.uuid4().hex[:8]


def pii(kind: str, n: int) -> str:
    return f"{kind}-{SECRET}-{n}"


def every_byte(kafka: Kafka, prefix: str, extra: list[str]) -> bytes:
    """Keys, values and headers of every record on the prefix's topics and ``extra``, as
    written, aborted transactions included."""
    consumer = Consumer(
        {
            **END_READER_CONFIG,
            "bootstrap.servers": kafka.bootstrap,
            "group.id": f"leak-{uuid.uuid4()}",
            "isolation.level": "read_uncommitted",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        topics = [t for t in consumer.list_topics(timeout=30).topics if t.startswith(prefix)]
        meta = consumer.list_topics(timeout=30).topics
        parts = [
            TopicPartition(t, p, 0)
            for t in sorted({*topics, *extra})
            if t in meta
            for p in meta[t].partitions
        ]
        consumer.assign(parts)
        pending = {(p.topic, p.partition) for p in parts}
        out = [b"|".join(t.encode() for t in topics)]
        while pending:
            msg = consumer.poll(30)
            assert msg is not None, f"no record nor end of {sorted(pending)} for 30 s"
            error = msg.error()
            if error is not None:
                assert error.code() == KafkaError._PARTITION_EOF, error
                pending.discard((msg.topic(), msg.partition()))
                continue
            key, value = msg.key(), msg.value()
            out += [
                key if isinstance(key, bytes) else b"",
                value if isinstance(value, bytes) else b"",
            ]
            # The headers' repr keeps ASCII as it is, which the values searched for are.
            out.append(repr(msg.headers()).encode())
        return b"\n".join(out)
    finally:
        consumer.close()


def hashed(text: str) -> str:
    """``text`` as the bridge's hash transform writes it with the test's key."""
    rule = HashRule(tables=["public.t"], columns=["c"], transform="hash")
    value = column_mask(rule, KEY.encode()).convert(text)
    assert isinstance(value, str)
    return value


def pipeline_of(stack: Stack, tmp_path: Path, table: str, value_format: str) -> Pipeline:
    return Pipeline(
        stack,
        [table],
        tmp_path,
        extra={
            "SLOTBRIDGE_TRANSFORMS": json.dumps(TRANSFORMS),
            "SLOTBRIDGE_PII_COLUMNS": json.dumps(PII_COLUMNS),
            MASKING_KEY_ENV: KEY,
            "SLOTBRIDGE_VALUE_FORMAT": value_format,
            "SLOTBRIDGE_HTTP_PORT": str(free_ports(1)[0]),
        },
    )


@pytest.mark.parametrize("value_format", ["slotbridge", "debezium"])
def test_no_masked_value_leaves_the_bridge(stack: Stack, tmp_path: Path, value_format: str) -> None:
    dsn = stack.primary_dsn
    table = f"public.masked_{uuid.uuid4().hex[:6]}"
    sql(
        dsn,
        f"CREATE TABLE {table} (id bigint PRIMARY KEY, email text UNIQUE NOT NULL, ssn text,"
        " card varchar(19), notes text, bio text, phone text)",
    )
    # Its storage left external, so the value is TOASTed and an update of other columns
    # sends it as unchanged.
    sql(dsn, f"ALTER TABLE {table} ALTER COLUMN notes SET STORAGE EXTERNAL")
    big_note = pii("note", 0) * 400

    def row(n: int) -> tuple[object, ...]:
        return (
            n,
            pii("email", n),
            pii("ssn", n),
            f"4111{n:012d}",
            big_note,
            pii("bio", n),
            pii("tel", n),
        )

    insert = f"INSERT INTO {table} VALUES (%s, %s, %s, %s, %s, %s, %s)"
    for n in range(1, 4):  # before the slot: snapshot rows
        sql(dsn, insert, row(n))
    pipe = pipeline_of(stack, tmp_path, table, value_format)
    port = pipe.extra["SLOTBRIDGE_HTTP_PORT"]
    try:
        pipe.start()
        pipe.wait_caught_up()
        for n in range(4, 8):
            sql(dsn, insert, row(n))
        sql(dsn, f"UPDATE {table} SET ssn = %s WHERE id = 4", (pii("ssn", 40),))  # TOAST kept
        sql(dsn, f"UPDATE {table} SET id = 40, email = %s WHERE id = 5", (pii("email", 50),))
        sql(dsn, f"DELETE FROM {table} WHERE id = 6")
        sql(dsn, f"ALTER TABLE {table} REPLICA IDENTITY FULL")
        sql(dsn, f"UPDATE {table} SET bio = %s WHERE id = 7", (pii("bio", 70),))
        sql(dsn, f"DELETE FROM {table} WHERE id = 7")
        # A column added mid-stream that a transform's pattern covers.
        sql(dsn, f"ALTER TABLE {table} ADD COLUMN phone_2 text")
        sql(
            dsn,
            f"INSERT INTO {table} VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            (*row(8), pii("tel2", 8)),
        )
        pipe.wait_caught_up()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            metrics = response.read()
        # A kill with a Kafka transaction possibly open: what it held is aborted, and
        # read_uncommitted below reads it too.
        sql(
            dsn,
            f"INSERT INTO {table} SELECT n, 'e' || n || %s, %s, NULL, NULL, NULL, NULL, NULL"
            " FROM generate_series(100, 2000) n",
            (SECRET, pii("ssn", 99)),
        )
        pipe.kill()
        pipe.start()
        pipe.wait_caught_up()
        assert pipe.stop() == 0
        written = every_byte(pipe.kafka, pipe.prefix, [pipe.progress_topic])
        log = pipe.log_path.read_bytes()
        for where, data in (("Kafka", written), ("the log", log), ("/metrics", metrics)):
            assert SECRET.encode() not in data, f"{where} holds a raw value"
        # The transformed values are there: the scan looked at the records.
        for text in (pii("email", 1), pii("email", 50), pii("tel", 2), pii("tel2", 8)):
            assert hashed(text).encode() in written, text
        assert b"************0003" in written  # card of row 3, a snapshot row
        assert b'"bio":"bio"' in written  # truncated to 3 characters
        assert b'"notes"' not in written
        # The operator is told which columns leave transformed (names only).
        assert f"{table}: email hash, ssn redact, card mask, notes drop, bio truncate" in (
            pipe.output()
        )
        pipe.audit()
    finally:
        pipe.cleanup()
        sql(dsn, f"DROP TABLE IF EXISTS {table}")


def test_an_unmasked_pii_column_is_refused_at_start_and_mid_stream(
    stack: Stack, tmp_path: Path
) -> None:
    dsn = stack.primary_dsn
    table = f"public.masked_{uuid.uuid4().hex[:6]}"
    sql(dsn, f"CREATE TABLE {table} (id bigint PRIMARY KEY, email text, ssn_backup text)")
    pipe = pipeline_of(stack, tmp_path, table, "slotbridge")
    pipe.extra["SLOTBRIDGE_TRANSFORMS"] = json.dumps(TRANSFORMS[:1])
    pipe.extra["SLOTBRIDGE_PII_COLUMNS"] = json.dumps(["email", "ssn*"])
    try:
        code, output = pipe.run_to_exit()
        assert code != 0
        assert f"{table}.ssn_backup matches pii_columns but no transform" in one_line_error(output)
        sql(dsn, f"ALTER TABLE {table} DROP COLUMN ssn_backup")
        pipe.start()
        pipe.wait_caught_up()
        sql(dsn, f"INSERT INTO {table} VALUES (1, %s)", (pii("email", 1),))
        pipe.wait_caught_up()
        # Mid-stream: the first change after the new column stops the bridge before any
        # record of it is built, and nothing of it is confirmed.
        sql(dsn, f"ALTER TABLE {table} ADD COLUMN ssn_copy text")
        (before,) = sql(dsn, "SELECT pg_current_wal_insert_lsn()")[0]
        sql(dsn, f"INSERT INTO {table} VALUES (2, %s, %s)", (pii("email", 2), pii("ssn", 2)))
        assert pipe.proc is not None
        code = pipe.proc.wait(120)
        assert code != 0
        line = one_line_error(pipe.output().split("--- run 2")[1])
        assert f"{table}.ssn_copy matches pii_columns but no transform" in line
        written = every_byte(pipe.kafka, pipe.prefix, [pipe.progress_topic])
        assert SECRET.encode() not in written
        assert hashed(pii("email", 1)).encode() in written
        assert hashed(pii("email", 2)).encode() not in written
        confirmed = sql(
            dsn,
            "SELECT confirmed_flush_lsn <= %s::pg_lsn FROM pg_replication_slots"
            " WHERE slot_name = %s",
            (str(before), pipe.name),
        )
        assert confirmed == [(True,)]
        pipe.audit()
    finally:
        pipe.cleanup()
        sql(dsn, f"DROP TABLE IF EXISTS {table}")
