"""The event builder: decoded messages of one transaction in, Kafka records out."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from services.bridge.decode import messages as m
from services.bridge.records.catalog import RelationCatalog, known_versions
from services.bridge.records.debezium import DebeziumEventBuilder
from services.bridge.records.default import DefaultEventBuilder
from services.bridge.records.events import (
    EventBuilder,
    Record,
    RecordChoices,
    RowTooLarge,
    begin_value,
    end_value,
)
from services.contract.records import TOAST_PLACEHOLDER

TS = 785_000_000_123_456
COLUMNS = (
    m.Column("id", 20, -1, True),
    m.Column("name", 25, -1, False),
    m.Column("doc", 3802, -1, False),
)
ACCOUNTS = m.Relation(None, 16_401, "public", "accounts", "d", COLUMNS)
# A row's life in one transaction, after its table's description.
INSERT_UPDATE_DELETE = (
    ACCOUNTS,
    m.Insert(None, 16_401, ["1", "ann", None]),
    m.Update(None, 16_401, None, False, ["1", "bob", None]),
    m.Delete(None, 16_401, ["1", None, None], True),
)


def builder(
    max_record_bytes: int = 1 << 20,
    *,
    debezium: bool = False,
    begin_records: bool = True,
    end_records: bool = True,
    tombstones: bool = True,
) -> EventBuilder:
    catalog = RelationCatalog("app", lambda oid: None)
    choices = RecordChoices(
        begin_records=begin_records, end_records=end_records, tombstones=tombstones
    )
    if debezium:
        return DebeziumEventBuilder(catalog, "app", "shop", max_record_bytes, None, choices=choices)
    return DefaultEventBuilder(catalog, "app", "shop", max_record_bytes, choices=choices)


def build(b: EventBuilder, *messages: m.Message, xid: int = 700) -> list[Record]:
    changes: Iterator[tuple[int, m.Message]] = iter(
        (0x100 + i, msg) for i, msg in enumerate(messages)
    )
    return list(b.transaction(xid, 0x200, TS, changes, end_lsn=0x208))


def value(record: Record) -> Any:
    assert record[2] is not None
    return json.loads(record[2])


def key(record: Record) -> Any:
    assert record[1] is not None
    return json.loads(record[1])


def test_a_transaction_is_begin_schema_changes_end() -> None:
    records = build(builder(), ACCOUNTS, m.Insert(None, 16_401, ["1", "ann", '{"a": 1}']))
    assert [r[0] for r in records] == [
        "app.transaction",
        "app.schema",
        "app.public.accounts",
        "app.transaction",
    ]
    begin, schema, insert, end = records
    assert value(begin)["status"] == "BEGIN" and value(begin)["id"] == "700:512"
    assert key(schema) == {"schema": "public", "table": "accounts", "version": 1}
    assert value(schema)["key_columns"] == ["id"]
    assert [c["type"] for c in value(schema)["columns"]] == ["bigint", "text", "jsonb"]
    assert key(insert) == {"id": 1}
    change = value(insert)
    assert change["op"] == "c" and change["before"] is None
    assert change["after"] == {"id": 1, "name": "ann", "doc": {"a": 1}}
    assert change["source"]["txId"] == 700 and change["source"]["lsn"] == 0x101
    assert change["source"]["commit_lsn"] == 0x200 and change["source"]["schema_version"] == 1
    assert change["transaction"] == {"id": "700:512", "total_order": 1, "data_collection_order": 1}
    assert value(end)["status"] == "END" and value(end)["event_count"] == 1
    assert value(end)["data_collections"] == [
        {"data_collection": "public.accounts", "event_count": 1}
    ]


def _stable(record: Record) -> tuple[str, Any, Any]:
    """A record less its processing time (ts_ms and its kin: on schema, change and END
    records), the one thing two builds differ in whenever they fall in different
    milliseconds."""
    body = value(record) if record[2] is not None else None
    payload = body.get("payload", body) if isinstance(body, dict) else body
    if isinstance(payload, dict):
        payload = {k: v for k, v in payload.items() if not k.startswith("ts_")}
    return record[0], record[1], payload


@pytest.mark.parametrize("debezium", [False, True], ids=["default", "debezium"])
def test_without_begin_records_a_transaction_is_the_same_less_its_begin(debezium: bool) -> None:
    """``transaction_begin_records: false``: every record but the BEGIN, the END (which
    carries the counts) as with BEGIN records on."""

    with_begin = build(builder(debezium=debezium), *INSERT_UPDATE_DELETE)
    without = build(builder(debezium=debezium, begin_records=False), *INSERT_UPDATE_DELETE)
    assert with_begin[0][0] == "app.transaction" and value(with_begin[0])
    assert _stable(with_begin[0])[2]["status"] == "BEGIN"
    assert [_stable(r) for r in without] == [_stable(r) for r in with_begin[1:]]
    statuses = [_stable(r)[2]["status"] for r in without if r[0] == "app.transaction"]
    assert statuses == ["END"]
    end = _stable(without[-1])[2]
    assert end["event_count"] == 3  # insert, update, delete (its tombstone is no event)
    assert end["data_collections"] == [{"data_collection": "public.accounts", "event_count": 3}]


@pytest.mark.parametrize("debezium", [False, True], ids=["default", "debezium"])
def test_without_transaction_metadata_a_transaction_is_its_schema_and_changes(
    debezium: bool,
) -> None:
    """``transaction_metadata: false``: no record on the transaction topic, every other
    record as with it on, each change record keeping its transaction block (its total
    order is what the Spark consumers order a transaction's changes by)."""
    with_metadata = build(builder(debezium=debezium), *INSERT_UPDATE_DELETE)
    without = build(
        builder(debezium=debezium, begin_records=False, end_records=False), *INSERT_UPDATE_DELETE
    )
    assert [_stable(r) for r in without] == [
        _stable(r) for r in with_metadata if r[0] != "app.transaction"
    ]
    assert len(without) == len(with_metadata) - 2
    orders = [
        _stable(r)[2]["transaction"]["total_order"]
        for r in without
        if r[0] == "app.public.accounts" and r[2] is not None
    ]
    assert orders == [1, 2, 3]


def test_a_schema_record_goes_out_once_per_table_version() -> None:
    b = builder()
    first = build(b, ACCOUNTS, m.Insert(None, 16_401, ["1", "a", None]))
    again = build(b, ACCOUNTS, m.Insert(None, 16_401, ["2", "b", None]))  # a new session's
    assert [r[0] for r in first].count("app.schema") == 1
    assert [r[0] for r in again].count("app.schema") == 0
    altered = m.Relation(
        None, 16_401, "public", "accounts", "d", (*COLUMNS, m.Column("x", 23, -1, False))
    )
    records = build(b, altered, m.Insert(None, 16_401, ["3", "c", None, "9"]))
    (schema,) = [r for r in records if r[0] == "app.schema"]
    assert value(schema)["version"] == 2
    assert value(records[2])["source"]["schema_version"] == 2


def test_a_restart_reuses_the_versions_in_the_schema_topic() -> None:
    published = value(build(builder(), ACCOUNTS)[1])
    b = DefaultEventBuilder(
        RelationCatalog("app", lambda oid: None, known_versions([published])),
        "app",
        "shop",
        1 << 20,
    )
    records = build(b, ACCOUNTS, m.Insert(None, 16_401, ["1", "a", None]))
    assert "app.schema" not in [r[0] for r in records]
    assert value(records[1])["source"]["schema_version"] == 1


def test_a_delete_is_followed_by_a_tombstone() -> None:
    records = build(builder(), ACCOUNTS, m.Delete(None, 16_401, ["1", None, None], True))
    delete, tombstone = records[2:4]
    assert value(delete)["op"] == "d" and value(delete)["before"] == {"id": 1}
    assert value(delete)["after"] is None
    assert tombstone == ("app.public.accounts", delete[1], None, None)


def test_an_unchanged_toast_value_is_marked_not_nulled() -> None:
    update = m.Update(None, 16_401, None, False, ["1", "ann", m.UNCHANGED_TOAST])
    change = value(build(builder(), ACCOUNTS, update)[2])
    assert change["op"] == "u"
    assert change["after"] == {"id": 1, "name": "ann", "doc": TOAST_PLACEHOLDER}


def test_a_key_change_forgets_the_old_key_first() -> None:
    update = m.Update(None, 16_401, ["1", None, None], True, ["2", "ann", None])
    records = build(builder(), ACCOUNTS, update)[2:-1]
    assert [(key(r), r[2] is not None) for r in records] == [
        ({"id": 1}, True),
        ({"id": 1}, False),  # the old key's tombstone
        ({"id": 2}, True),
    ]
    assert [value(records[0])["op"], value(records[2])["op"]] == ["d", "u"]


@pytest.mark.parametrize("debezium", [False, True], ids=["default", "debezium"])
def test_without_tombstones_a_transaction_is_the_same_less_its_tombstones(debezium: bool) -> None:
    """``tombstones_on_delete: false``: a delete's record and a key change's delete and new
    row as with tombstones, in the same order and with the same numbers, but no record
    with a null value; the END counts the same events."""

    messages = (
        ACCOUNTS,
        m.Insert(None, 16_401, ["1", "ann", None]),
        m.Update(None, 16_401, ["1", None, None], True, ["2", "ann", None]),
        m.Delete(None, 16_401, ["2", None, None], True),
    )
    with_tombstones = build(builder(debezium=debezium), *messages)
    without = build(builder(debezium=debezium, tombstones=False), *messages)
    deletes = [
        i
        for i, r in enumerate(with_tombstones)
        if r[0] == "app.public.accounts" and r[2] is not None and _stable(r)[2]["op"] == "d"
    ]
    assert len(deletes) == 2  # the key change's and the delete's
    tombstones = [with_tombstones[i + 1] for i in deletes]
    assert [r[1:3] for r in tombstones] == [(with_tombstones[i][1], None) for i in deletes]
    assert sum(r[2] is None for r in with_tombstones) == 2
    assert [_stable(r) for r in without] == [
        _stable(r) for r in with_tombstones if r[2] is not None
    ]


def test_a_truncate_and_a_logical_message_count_in_the_transaction() -> None:
    records = build(
        builder(),
        ACCOUNTS,
        m.Truncate(None, 0, (16_401,)),
        m.LogicalMessage(None, True, 0x150, "app", b"hi"),
    )
    truncate, message, end = records[2:]
    assert truncate[1] is None and value(truncate)["op"] == "t"
    assert message[0] == "app.message" and value(message)["content"] == "aGk="
    assert value(end)["event_count"] == 2


def test_a_json_null_is_named_apart_from_sql_null() -> None:
    change = value(build(builder(), ACCOUNTS, m.Insert(None, 16_401, ["1", None, "null"]))[2])
    assert change["after"]["doc"] is None and change["after"]["name"] is None
    assert change["json_nulls"] == {"after": ["doc"]}


def test_snapshot_rows_are_read_records_numbered_in_their_chunk() -> None:
    b = builder()
    info = b.catalog.apply(ACCOUNTS)
    records = list(b.snapshot_rows(info, [["1", "a", None], ["2", "b", None]], 0x200, TS, 0x1F0))
    assert records[0][0] == "app.schema"
    rows = [value(r) for r in records[1:]]
    assert [(r["op"], r["after"]["id"], r["source"]["snapshot"]) for r in rows] == [
        ("r", 1, "true"),
        ("r", 2, "true"),
    ]
    assert [r["transaction"]["total_order"] for r in rows] == [1, 2]


def test_a_record_over_the_limit_is_refused_with_its_table_and_lsn() -> None:
    with pytest.raises(RowTooLarge, match=r"public\.accounts at LSN 0/101"):
        build(builder(600), ACCOUNTS, m.Insert(None, 16_401, ["1", "x" * 1000, None]))
    b = builder()
    b.catalog.apply(ACCOUNTS)
    with pytest.raises(RowTooLarge, match="refused before building it"):
        b.refuse_oversized(0x101, 16_401, 10_000_000)


def test_transaction_records_are_the_json_of_their_fields() -> None:
    # Written from templates for speed: the same bytes as the encoder makes of the fields.
    txid = b"700:6442450944"
    assert begin_value(txid, 1_700_000_000_123) == orjson.dumps(
        {
            "status": "BEGIN",
            "id": txid.decode(),
            "event_count": None,
            "data_collections": None,
            "ts_ms": 1_700_000_000_123,
        }
    )
    # Twice over the same tables (the second from the first's template), with other counts.
    for orders, quoted in ((3, 1), (1, 7)):
        per_table = {"app.public.orders": orders, 'app.public."100%d ✓"': quoted}
        assert end_value(txid, 1_700_000_000_123, orders + quoted, per_table) == orjson.dumps(
            {
                "status": "END",
                "id": txid.decode(),
                "event_count": orders + quoted,
                "data_collections": [
                    {"data_collection": "public.orders", "event_count": orders},
                    {"data_collection": 'public."100%d ✓"', "event_count": quoted},
                ],
                "ts_ms": 1_700_000_000_123,
            }
        )
