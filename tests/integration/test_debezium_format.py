"""The Debezium record format next to the real thing: Debezium's PostgreSQL connector in Kafka
Connect standalone (jars from the bootstrap) and the bridge with ``value_format: debezium``
stream the same table through the same changes; their records must agree field by field,
but for what must differ (times, LSNs, transaction ids, names) and the documented choices
(``services/bridge/records/debezium.py``). Twice: with Debezium's defaults, and with its
three settings that make records cheaper or fewer, on both sides: no Connect schemas
(JsonConverter's ``schemas.enable=false``, the bridge's ``debezium_schemas: false``), no
context headers (``extended.headers.enabled=false``, ``debezium_context_headers:
false``) and no tombstones (``tombstones.on.delete=false``, ``tombstones_on_delete:
false``)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import jsonschema
import pytest
from confluent_kafka import Consumer

from services.contract.debezium import (
    DebeziumChange,
    DebeziumChangeValue,
    DebeziumKey,
    DebeziumKeyPayload,
)
from services.contract.schemas import json_schema
from slotbridge_dev.bootstrap import DEBEZIUM_SET, cache_dir, jars_dir
from slotbridge_dev.connect import ConnectWorker, debezium_postgres
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, sql, wait_for

SCHEMA = "dbzcmp"
JARS = jars_dir(cache_dir(), DEBEZIUM_SET)
DDL = f"""
DROP SCHEMA IF EXISTS {SCHEMA} CASCADE;
CREATE SCHEMA {SCHEMA};
CREATE TYPE {SCHEMA}.mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE {SCHEMA}.alltypes (
  id int PRIMARY KEY, i2 int2, i4 int4, i8 int8,
  n_fixed numeric(10,2), n_var numeric, n_p numeric(7), f4 real, f8 double precision,
  b bool, t text, vc varchar(20), ch char(5), by bytea, d date, tm time, tm3 time(3),
  ttz timetz, ts timestamp, ts3 timestamp(3), tstz timestamptz, iv interval, u uuid,
  j json, jb jsonb, m money, p point, e {SCHEMA}.mood, ai int4[], at text[], an numeric[],
  big text, o oid, x xml, ia interval[]
);
DROP PUBLICATION IF EXISTS {SCHEMA}_dbz;
CREATE PUBLICATION {SCHEMA}_dbz FOR TABLE {SCHEMA}.alltypes;
"""
WORKLOAD = [
    f"""INSERT INTO {SCHEMA}.alltypes VALUES (1, 1, 2, 3, 12.5, 1.23456789012345678901, 1234567,
      1.5, 2.25, true, 'hello', 'vc', 'ab', '\\xdeadbeef', '2024-02-29', '13:14:15.123456',
      '13:14:15.123', '13:14:15.5+02', '2024-02-29 13:14:15.123456', '2024-02-29 13:14:15.123',
      '2024-02-29 13:14:15.654321+01', '1 year 2 mons 3 days 04:05:06.789',
      'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{{"a": 1, "a": 2, "n": 0.12345678901234567890123}}',
      '{{"b": [1, 2], "n": 1e40}}', 12.34, '(1.5,-2.25)', 'happy', '{{1,NULL,3}}',
      '{{"x y","NULL",z}}', '{{1.5,NULL}}',
      (SELECT string_agg(md5(i::text), '') FROM generate_series(1, 3200) i), 42, '<a>1</a>',
      '{{1 day,2 hours}}')""",
    f"""INSERT INTO {SCHEMA}.alltypes (id, f4, f8, n_var, n_fixed, d, ts, tstz, m, ttz, tm)
      VALUES (2, 'NaN', '-Infinity', 'NaN', -0.5, '1900-01-01', '1900-01-01 00:00:00',
      '1900-01-01 00:00:00+00', -1234.56, '10:00:00+00', '24:00:00')""",
    f"""INSERT INTO {SCHEMA}.alltypes (id, n_var, tstz, ts, d, iv)
      VALUES (3, 100, 'infinity', 'infinity', '0044-03-15 BC', '-1 day -02:00:00')""",
    f"UPDATE {SCHEMA}.alltypes SET t = 'changed', i4 = 99 WHERE id = 1",  # big: unchanged TOAST
    f"UPDATE {SCHEMA}.alltypes SET id = 10 WHERE id = 2",
    f"DELETE FROM {SCHEMA}.alltypes WHERE id = 3",
    f"BEGIN; INSERT INTO {SCHEMA}.alltypes (id) VALUES (21); "
    f"INSERT INTO {SCHEMA}.alltypes (id) VALUES (22); COMMIT",
    f"TRUNCATE {SCHEMA}.alltypes",
]
# 3 creates, 1 update, d+tombstone+c, d+tombstone, 2 creates, truncate; without tombstones
# two fewer.
EXPECTED_RECORDS = {True: 12, False: 10}
# Published as strings by the bridge, left out by Debezium (no mapping): see connect_values.
BRIDGE_ONLY = {"ia"}


def _connect(tmp: Path, bootstrap: str, dsn: str, prefix: str, defaults: bool) -> ConnectWorker:
    return ConnectWorker(
        tmp,
        JARS,
        bootstrap,
        {
            **debezium_postgres(
                "dbzcmp", dsn, prefix, f"{SCHEMA}_dbz", f"{SCHEMA}_dbz", [f"{SCHEMA}.alltypes"]
            ),
            # The bridge always writes transaction metadata and truncates (documented).
            "provide.transaction.metadata": "true",
            "skipped.operations": "none",
            "extended.headers.enabled": str(defaults).lower(),
            "tombstones.on.delete": str(defaults).lower(),
        },
        schemas=defaults,
    )


class Compared(NamedTuple):
    """Both systems' records of the workload, read back, and how they were written."""

    ours: list[Any]
    theirs: list[Any]
    our_topic: str
    their_topic: str
    defaults: bool  # Debezium's defaults (schemas, context headers, tombstones), or none


def _read(bootstrap: str, topic: str, count: int, timeout: float = 60) -> list[Any]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"cmp-{time.time_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([topic])
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            out.append((msg.key(), msg.value(), msg.headers() or []))
    finally:
        consumer.close()
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["defaults", "lean"])
def both(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Compared]:
    defaults: bool = request.param
    if not (JARS / ".stamp").exists():
        pytest.skip(
            f"Debezium/Connect jars absent from {JARS}: run `python3 -m slotbridge_dev.bootstrap`"
        )
    dsn = stack.primary_dsn
    sql(dsn, DDL)
    tmp = Path(tmp_path_factory.mktemp("dbz"))
    # Debezium's topics are its own, not the bridge's: a fresh prefix per run.
    prefix = f"{SCHEMA}_{uuid.uuid4().hex[:8]}"
    connect = _connect(tmp, stack.kafka.bootstrap, dsn, prefix, defaults)
    connect.start()
    pipe = Pipeline(stack, [f"{SCHEMA}.alltypes"], tmp)
    try:
        pipe.start(
            SLOTBRIDGE_VALUE_FORMAT="debezium",
            SLOTBRIDGE_DEBEZIUM_SCHEMAS=str(defaults).lower(),
            SLOTBRIDGE_DEBEZIUM_CONTEXT_HEADERS=str(defaults).lower(),
            SLOTBRIDGE_TOMBSTONES_ON_DELETE=str(defaults).lower(),
        )
        pipe.wait_caught_up(60)
        wait_for(
            lambda: (
                sql(
                    dsn, f"SELECT active FROM pg_replication_slots WHERE slot_name = '{SCHEMA}_dbz'"
                )
                == [(True,)]
            ),
            120,
            "Debezium streaming",
        )
        for statement in WORKLOAD:
            sql(dsn, statement)
        pipe.wait_caught_up(90)
        our_topic, their_topic = pipe.topic(f"{SCHEMA}.alltypes"), f"{prefix}.{SCHEMA}.alltypes"
        expected = EXPECTED_RECORDS[defaults]
        ours = _read(stack.kafka.bootstrap, our_topic, expected)
        theirs = _read(stack.kafka.bootstrap, their_topic, expected)
        yield Compared(ours, theirs, our_topic, their_topic, defaults)
        assert pipe.stop() == 0
        pipe.audit()
    finally:
        connect.stop()
        pipe.cleanup()
        wait_for(
            lambda: (
                not sql(
                    dsn,
                    "SELECT 1 FROM pg_replication_slots WHERE active AND "
                    f"slot_name = '{SCHEMA}_dbz'",
                )
            ),
            30,
            "Connect gone",
        )
        sql(
            dsn,
            f"SELECT pg_drop_replication_slot('{SCHEMA}_dbz') FROM pg_replication_slots"
            f" WHERE slot_name = '{SCHEMA}_dbz'",
        )
        sql(dsn, f"DROP PUBLICATION IF EXISTS {SCHEMA}_dbz; DROP SCHEMA IF EXISTS {SCHEMA} CASCADE")


def _parse(raw: bytes | None, topic: str) -> Any:
    # Schema names are the topic's: compare them with the topic replaced.
    return None if raw is None else json.loads(raw.decode().replace(topic, "TOPIC"))


def _framed(value: Any, schemas: bool) -> Any:
    """A value as ``{"schema", "payload"}``: a payload alone gets a null schema."""
    return value if schemas else {"schema": None, "payload": value}


def _drop_bridge_only(value: Any) -> Any:
    schema, payload = value["schema"], value["payload"]
    for field in schema["fields"][:2] if schema is not None else ():
        field["fields"] = [f for f in field["fields"] if f["field"] not in BRIDGE_ONLY]
    for side in ("before", "after"):
        if payload[side] is not None:
            for name in BRIDGE_ONLY:
                assert name in payload[side]
                del payload[side][name]
    return value


def test_record_count_and_ops(both: Compared) -> None:
    expected = EXPECTED_RECORDS[both.defaults]
    assert (len(both.ours), len(both.theirs)) == (expected, expected)
    tombstones = [v is None for _, v, _ in both.ours]
    assert tombstones == [v is None for _, v, _ in both.theirs]
    assert sum(tombstones) == (2 if both.defaults else 0)


def test_keys_values_and_headers_match_debezium(both: Compared) -> None:
    our_topic, their_topic = both.our_topic, both.their_topic
    # The context headers are there with Debezium's defaults only (both sides agree below).
    context = {h[0] for _, _, headers in both.theirs for h in headers if "context" in h[0]}
    assert bool(context) == both.defaults, context
    pairs = zip(both.ours, both.theirs, strict=True)
    for n, ((ok, ov, oh), (tk, tv, th)) in enumerate(pairs):
        assert _parse(ok, our_topic) == _parse(tk, their_topic), n
        assert [h[0] for h in oh] == [h[0] for h in th], n
        assert {k: v for k, v in oh if k.endswith("key")} == {
            k: v for k, v in th if k.endswith("key")
        }, n
        if tv is None:
            assert ov is None, n
            continue
        mine = _drop_bridge_only(_framed(_parse(ov, our_topic), both.defaults))
        real = _framed(_parse(tv, their_topic), both.defaults)
        assert mine["schema"] == real["schema"], n
        p, q = mine["payload"], real["payload"]
        assert (p["op"], p["before"], p["after"]) == (q["op"], q["before"], q["after"]), n
        ps, qs = p["source"], q["source"]
        assert set(ps) == set(qs), n
        for key in (
            "connector",
            "snapshot",
            "db",
            "schema",
            "table",
            "xmin",
            "origin",
            "origin_lsn",
        ):
            assert ps[key] == qs[key], (n, key)
        for src in (ps, qs):
            prev, lsn = json.loads(src["sequence"])
            assert lsn == str(src["lsn"]) and (prev is None or int(prev) <= src["lsn"])
            assert src["ts_us"] // 1000 == src["ts_ms"] and src["ts_ns"] == src["ts_us"] * 1000
        assert p["transaction"] is not None and q["transaction"] is not None
        assert (p["transaction"]["total_order"], p["transaction"]["data_collection_order"]) == (
            q["transaction"]["total_order"],
            q["transaction"]["data_collection_order"],
        ), n
        assert set(p) == set(q), n


def test_debezium_records_hold_to_the_contract(both: Compared) -> None:
    """``schemas/debezium_*.schema.json`` describe what the real connector writes, not only
    what the bridge writes: its keys and values validate against them."""
    key_model, value_model = (
        (DebeziumKey, DebeziumChangeValue)
        if both.defaults
        else (DebeziumKeyPayload, DebeziumChange)
    )
    keys = jsonschema.Draft202012Validator(json_schema(key_model))
    values = jsonschema.Draft202012Validator(json_schema(value_model))
    ops = set()
    for key, value, _ in both.theirs:
        if key is not None:  # a truncate's is
            keys.validate(json.loads(key))
        if value is not None:
            values.validate(json.loads(value))
            ops.add(_framed(json.loads(value), both.defaults)["payload"]["op"])
    assert ops == {"c", "u", "d", "t"}
