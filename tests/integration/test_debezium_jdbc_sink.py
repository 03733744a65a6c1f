"""The Debezium record format read by a consumer nobody here wrote: Debezium's own JDBC sink
connector (3.6.0.Final, the newest on Maven Central) in Kafka Connect standalone (jars from
the bootstrap) copies the bridge's topics (``value_format: debezium``) into a database of
the stack's subscriber, creating the tables itself from the records' Connect schemas; the
copy must equal the source row for row, types included.

Values are compared as PostgreSQL's text of both sides. The sink creates its columns from
the Connect schema alone (Debezium's source leaves out the column-type parameters without
``column.propagate.source.type``), so some columns necessarily get another type than the
source's: ``SINK_TYPES`` holds every column's type as the sink creates it, and for those
whose text then differs, ``SOURCE_AS_SINK`` the source expression the copy's text equals.
``REFUSED`` lists the values the sink cannot write at all.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from slotbridge_dev.bootstrap import DEBEZIUM_JDBC_SET, cache_dir, jars_dir
from slotbridge_dev.connect import ConnectWorker
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, Record, read_topics, sql

SCHEMA = "dbzjdbc"
TABLE = f"{SCHEMA}.alltypes"
# With REPLICA IDENTITY FULL an unchanged TOAST value is in the old row: the record has it.
FULL_TABLE = f"{SCHEMA}.toastfull"
# Values the sink cannot write at all, from Debezium's own records as from ours (they are
# the same: test_debezium_format.py and tests/unit/test_connect_values.py): one table each,
# whose sink task fails on its one row with this error.
REFUSED = {
    # MicroTime 86,400,000,000 µs: java.time.LocalTime has no 24:00.
    "time24": ("time", "'24:00:00'", "Invalid value for NanoOfDay"),
    # Debezium's stand-in for infinity, 2,146,033,979 days, is past PostgreSQL's last date.
    "dateinf": ("date", "'infinity'", 'date out of range: "5877611-06-21"'),
}
COPY_DB = "dbzjdbc_copy"
JARS = jars_dir(cache_dir(), DEBEZIUM_JDBC_SET)
COLUMNS = {
    "id": "integer",
    "i2": "smallint",
    "i4": "integer",
    "i8": "bigint",
    "n_fixed": "numeric(10,2)",
    "n_var": "numeric",
    "f4": "real",
    "f8": "double precision",
    "b": "boolean",
    "t": "text",
    "vc": "character varying(20)",
    "ch": "character(5)",
    "by": "bytea",
    "d": "date",
    "tm": "time without time zone",
    "tm3": "time(3) without time zone",
    "ttz": "time with time zone",
    "ts": "timestamp without time zone",
    "ts3": "timestamp(3) without time zone",
    "tstz": "timestamp with time zone",
    "iv": "interval",
    "u": "uuid",
    "j": "json",
    "jb": "jsonb",
    "m": "money",
    "e": f"{SCHEMA}.mood",
    "ai": "integer[]",
    "at": "text[]",
    "big": "text",
}
DDL = f"""
DROP SCHEMA IF EXISTS {SCHEMA} CASCADE;
CREATE SCHEMA {SCHEMA};
CREATE TYPE {SCHEMA}.mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE {TABLE} ({", ".join(f"{name} {kind}" for name, kind in COLUMNS.items())},
  PRIMARY KEY (id));
CREATE TABLE {FULL_TABLE} (id int PRIMARY KEY, n int, big text);
ALTER TABLE {FULL_TABLE} REPLICA IDENTITY FULL;
{"".join(f"CREATE TABLE {SCHEMA}.{t} (id int PRIMARY KEY, v {r[0]});" for t, r in REFUSED.items())}
"""
BIG = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 3200) i)"
WORKLOAD = [
    f"""INSERT INTO {TABLE} VALUES (1, 1, 2, 3, 12.5, 1.23456789012345678901, 1.5, 2.25, true,
      'hello', 'vc', 'ab', '\\xdeadbeef', '2024-02-29', '13:14:15.123456', '13:14:15.123',
      '13:14:15.5+02', '2024-02-29 13:14:15.123456', '2024-02-29 13:14:15.123',
      '2024-02-29 13:14:15.654321+01', '1 year 2 mons 3 days 04:05:06.789',
      'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{{"a": 1, "a": 2, "n": 0.12345678901234567890123}}',
      '{{"b": [1, 2], "n": 1e40}}', 12.34, 'happy', '{{1,NULL,3}}', '{{"x y","NULL",z}}', {BIG})""",
    f"""INSERT INTO {TABLE} (id, f4, f8, n_var, n_fixed, d, ts, tstz, m, ttz, tm)
      VALUES (2, 'NaN', '-Infinity', -7.25, -0.5, '1900-01-01', '1900-01-01 00:00:00',
      '1900-01-01 00:00:00+00', -1234.56, '10:00:00+00', '23:59:59.999999')""",
    f"""INSERT INTO {TABLE} (id, f4, f8, n_var, d, iv, big)
      VALUES (3, 'Infinity', 'NaN', 100, '0044-03-15 BC', '-1 day -02:00:00', 'small')""",
    f"INSERT INTO {TABLE} (id, ts, tstz, ts3) VALUES (5, 'infinity', '-infinity', '-infinity')",
    f"INSERT INTO {TABLE} (id, ts) VALUES (6, '-infinity')",
    f"INSERT INTO {TABLE} (id, t) VALUES (4, 'deleted')",
    f"UPDATE {TABLE} SET t = 'changed', i4 = 99 WHERE id = 1",  # big: unchanged TOAST
    f"UPDATE {TABLE} SET id = 10 WHERE id = 2",
    f"DELETE FROM {TABLE} WHERE id = 4",
    f"BEGIN; INSERT INTO {TABLE} (id) VALUES (21); INSERT INTO {TABLE} (id) VALUES (22); COMMIT",
    f"INSERT INTO {FULL_TABLE} VALUES (1, 1, {BIG}), (2, 1, {BIG})",
    f"UPDATE {FULL_TABLE} SET n = 2 WHERE id = 1",
    *(f"INSERT INTO {SCHEMA}.{t} VALUES (1, {v})" for t, (_, v, _) in REFUSED.items()),
]
# Every column as the sink creates it from the Connect schema (Debezium JDBC sink 3.6.0.Final,
# PostgreSQL dialect): lengths, the char padding's type, jsonb, money and enums are not in a
# Connect schema; times get the sink's default precision 6.
SINK_TYPES = {
    **COLUMNS,
    "n_var": "double precision",  # io.debezium.data.VariableScaleDecimal
    "vc": "text",
    "ch": "text",
    "tm": "time(6) without time zone",
    "tm3": "time(6) without time zone",
    "ttz": "time(6) with time zone",
    "ts": "timestamp(6) without time zone",
    "ts3": "timestamp(6) without time zone",
    "tstz": "timestamp(6) with time zone",
    "jb": "json",  # io.debezium.data.Json, for json and jsonb alike
    "m": "numeric(38,2)",  # money is a Decimal of scale 2
    "e": "text",  # io.debezium.data.Enum
}
# The row the workload updates with its TOASTed ``big`` unchanged.
UNCHANGED_TOAST_ID = 1
NON_FINITE = "('NaN', 'Infinity', '-Infinity')"
# What the copy's text equals, where the source column's own text is not it; each of these
# is the same for records of Debezium's own connector (test_debezium_format.py shows ours
# equal them).
SOURCE_AS_SINK = {
    # A VariableScaleDecimal lands in double precision: digits beyond a double's are lost.
    "n_var": "n_var::double precision",
    # Connect's JsonConverter writes a non-finite float as the string "NaN"/"Infinity"
    # (Debezium's records and ours alike) and reads such a string into a float field as
    # 0.0: the copy holds 0 for every NaN and infinity.
    "f4": f"CASE WHEN f4 IN {NON_FINITE} THEN 0 ELSE f4 END",
    "f8": f"CASE WHEN f8 IN {NON_FINITE} THEN 0 ELSE f8 END",
    # The record holds char(n)'s padded text; a text column keeps the padding.
    "ch": "rpad(ch, 5)",
    # io.debezium.time.ZonedTime is the time in UTC: the original offset is gone.
    "ttz": "ttz AT TIME ZONE 'UTC'",
    # io.debezium.time.MicroDuration is microseconds with a month of 30.4375 days; the sink
    # writes them back as hours, minutes and seconds.
    "iv": "make_interval(secs => ((extract(year FROM iv) * 12 + extract(month FROM iv))"
    " * 30.4375 + extract(day FROM iv)) * 86400 + extract(hour FROM iv) * 3600"
    " + extract(minute FROM iv) * 60 + extract(second FROM iv))",
    # io.debezium.time.MicroTimestamp's stand-in for infinity is Long.MAX_VALUE microseconds,
    # which the sink writes as the finite timestamp it is. (-infinity, Long.MIN_VALUE micro-
    # or milliseconds, arrives as -infinity.)
    "ts": "CASE WHEN ts = 'infinity' THEN '294247-01-10 04:00:54.775807' ELSE ts END",
    # money is a Decimal of scale 2: the copy has the number without the currency format.
    "m": "m::numeric",
    # An unchanged TOAST value is Debezium's placeholder in the record (its connector's
    # default with REPLICA IDENTITY DEFAULT), and the sink writes the placeholder.
    "big": f"CASE WHEN id = {UNCHANGED_TOAST_ID} THEN '__debezium_unavailable_value' ELSE big END",
}


def _copy_dsn(stack: Stack) -> str:
    return stack.subscriber_dsn.replace("dbname=postgres", f"dbname={COPY_DB}")


def _sink(folder: Path, stack: Stack, name: str, topics: list[str]) -> ConnectWorker:
    node = dict(p.split("=", 1) for p in stack.subscriber_dsn.split())
    folder.mkdir()
    return ConnectWorker(
        folder,
        JARS,
        stack.kafka.bootstrap,
        {
            "name": name,
            "connector.class": "io.debezium.connector.jdbc.JdbcSinkConnector",
            "tasks.max": "1",
            "topics": ",".join(topics),
            "connection.url": f"jdbc:postgresql://{node['host']}:{node['port']}/{COPY_DB}",
            "connection.username": node["user"],
            "connection.password": "",
            "insert.mode": "upsert",
            "delete.enabled": "true",
            "primary.key.mode": "record_key",
            "schema.evolution": "basic",
            # The copy's tables are named as the source's (no schema): alltypes, toastfull.
            "collection.name.format": "${source.table}",
            # The bridge writes in Kafka transactions: a consumer reads what they committed.
            "consumer.override.isolation.level": "read_committed",
        },
    )


def _committed(
    bootstrap: str, group: str, parts: list[TopicPartition]
) -> dict[tuple[str, int], int]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        return {(p.topic, p.partition): p.offset for p in consumer.committed(parts, timeout=10)}
    finally:
        consumer.close()


def _wait_consumed(sink: ConnectWorker, records: list[Record], timeout: float) -> None:
    """Until the sink's consumer group has committed past each topic's last record: Connect
    commits a sink's offsets only after the connector flushed the records before them, so
    the copy then holds everything the topic does. (Its committed offset is the last
    record's plus one, not the end offset: a transaction's commit marker follows.)"""
    ends: dict[tuple[str, int], int] = {}
    for record in records:
        at = (record.topic, record.partition)
        ends[at] = max(ends.get(at, 0), record.offset + 1)
    parts = [TopicPartition(topic, partition) for topic, partition in ends]
    deadline = time.monotonic() + timeout
    while True:
        sink.check()
        committed = _committed(sink.bootstrap, f"connect-{sink.connector['name']}", parts)
        if all(committed.get(at, -1) >= end for at, end in ends.items()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"sink committed {committed} after {timeout}s, topic ends {ends}")
        time.sleep(0.5)


def _rows(dsn: str, table: str, exprs: dict[str, str]) -> list[tuple[Any, ...]]:
    select = ", ".join(f"({expr})::text" for expr in exprs.values())
    # Qualified: a bare ``id`` would be the output column, the text.
    return sql(dsn, f"SELECT {select} FROM {table} ORDER BY {table}.id")


@dataclass
class Copied:
    stack: Stack
    tmp: Path
    topics: dict[str, str]  # the bridge's topic of each table (name without the schema)


@pytest.fixture(scope="module")
def copied(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Copied]:
    if not (JARS / ".stamp").exists():
        pytest.skip(
            f"Debezium JDBC sink jars absent from {JARS}: run `python3 -m slotbridge_dev.bootstrap`"
        )
    dsn = stack.primary_dsn
    sql(dsn, DDL)
    sql(stack.subscriber_dsn, f"DROP DATABASE IF EXISTS {COPY_DB} WITH (FORCE)")
    sql(stack.subscriber_dsn, f"CREATE DATABASE {COPY_DB}")
    tmp = Path(tmp_path_factory.mktemp("dbzjdbc"))
    tables = [TABLE, FULL_TABLE, *(f"{SCHEMA}.{t}" for t in REFUSED)]
    pipe = Pipeline(stack, tables, tmp)
    topics = {t.split(".")[1]: pipe.topic(t) for t in tables}
    copying = [topics["alltypes"], topics["toastfull"]]
    sink = _sink(tmp / "sink", stack, "dbzjdbc-sink", copying)
    try:
        pipe.start(SLOTBRIDGE_VALUE_FORMAT="debezium")
        pipe.wait_caught_up(60)
        for statement in WORKLOAD:
            sql(dsn, statement)
        pipe.wait_caught_up(60)
        records = read_topics(stack.kafka, copying)
        sink.start()
        sink.wait_running(60)
        _wait_consumed(sink, records, 60)
        yield Copied(stack, tmp, topics)
        assert pipe.stop() == 0
        pipe.audit()
    finally:
        sink.stop()
        pipe.cleanup()


def test_sink_created_the_documented_types(copied: Copied) -> None:
    created = dict(
        sql(
            _copy_dsn(copied.stack),
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute"
            " WHERE attrelid = 'alltypes'::regclass AND attnum > 0 AND NOT attisdropped",
        )
    )
    assert created == SINK_TYPES


def test_copy_equals_source(copied: Copied) -> None:
    source = _rows(copied.stack.primary_dsn, TABLE, {c: SOURCE_AS_SINK.get(c, c) for c in COLUMNS})
    copy = _rows(_copy_dsn(copied.stack), "alltypes", {c: c for c in COLUMNS})
    assert [row[0] for row in copy] == [row[0] for row in source]
    assert [row[0] for row in copy] == ["1", "3", "5", "6", "10", "21", "22"]  # 2 moved, 4 deleted
    diffs = [
        # (column, id, source, copy), cut short: a TOAST value is 100 kB.
        (name, s[0], (s[i] or "")[:80], (c[i] or "")[:80])
        for s, c in zip(source, copy, strict=True)
        for i, name in enumerate(COLUMNS)
        if s[i] != c[i]
    ]
    assert diffs == []


def test_unchanged_toast_copied_with_replica_identity_full(copied: Copied) -> None:
    """The way to an exact copy of unchanged TOAST values: the old row carries them."""
    query = "SELECT id, n, md5(big) FROM {} ORDER BY id"
    source = sql(copied.stack.primary_dsn, query.format(FULL_TABLE))
    assert sql(_copy_dsn(copied.stack), query.format("toastfull")) == source
    assert [row[:2] for row in source] == [(1, 2), (2, 1)]


@pytest.mark.parametrize("table", list(REFUSED))
def test_sink_refuses(copied: Copied, table: str) -> None:
    """Its own sink on the table's topic: the task fails on the row, with the error."""
    sink = _sink(copied.tmp / table, copied.stack, f"dbzjdbc-{table}", [copied.topics[table]])
    sink.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                sink.check()
            except AssertionError as failed:
                assert REFUSED[table][2] in str(failed)
                break
            assert time.monotonic() < deadline, f"the sink took {REFUSED[table][1]}"
            time.sleep(0.5)
    finally:
        sink.stop()
