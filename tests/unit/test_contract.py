"""Every producer of records holds to the one contract (``services.contract``).

``schemas/`` is what consumers read, so it must be what the models generate. The event
builders write their records as bytes without the models (the hot path), the bridge its
progress record by hand, and the synthetic producer the consumer tests' records, so what
they produce is validated here against the contract's JSON Schemas; the builders' input
is pgoutput generated as the server would send it.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pgoutput_builder import encode
from pydantic import BaseModel

from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder
from services.bridge.progress.highwater import ServerIdentity
from services.bridge.progress.record import ProgressRecordError, parse_progress, progress_value
from services.bridge.records.catalog import ColumnFacts, RelationCatalog, TableFacts
from services.bridge.records.debezium import DebeziumEventBuilder
from services.bridge.records.default import DefaultEventBuilder
from services.bridge.records.events import EventBuilder
from services.contract.debezium import (
    DebeziumChange,
    DebeziumChangeValue,
    DebeziumKey,
    DebeziumKeyPayload,
    DebeziumTransactionValue,
)
from services.contract.records import (
    OPS,
    VERSION,
    ChangeValue,
    EndedSnapshot,
    MessageRecord,
    ProgressRecord,
    TableSchemaRecord,
    TableSnapshot,
    TransactionRecord,
)
from services.contract.schemas import json_schema, schema_texts
from services.contract.topics import message_topic, schema_topic, transaction_topic
from slotbridge_dev.synthetic import SynthColumn, SynthTable

PREFIX = "app"
TYPED, FULL, KEYLESS = 16_401, 16_402, 16_403
_FACTS = {
    TYPED: TableFacts(
        {
            "id": ColumnFacts("integer", False),
            "num": ColumnFacts("numeric(12,3)", True),
            "t": ColumnFacts("text", True),
            "doc": ColumnFacts("jsonb", True),
            "grid": ColumnFacts("integer[]", True, dimensions=2),
            "at": ColumnFacts("timestamp with time zone", True),
            "raw": ColumnFacts("bytea", True),
        },
        ("id",),
    ),
    FULL: TableFacts(
        {"id": ColumnFacts("integer", False), "j": ColumnFacts("json", True)}, ("id",)
    ),
}
_RELATIONS = (
    m.Relation(
        None,
        TYPED,
        "public",
        "typed",
        "d",
        (
            m.Column("id", 23, -1, True),
            m.Column("num", 1700, ((12 << 16) | 3) + 4, False),
            m.Column("t", 25, -1, False),
            m.Column("doc", 3802, -1, False),
            m.Column("grid", 1007, -1, False),
            m.Column("at", 1184, -1, False),
            m.Column("raw", 17, -1, False),
        ),
    ),
    m.Relation(
        None,
        FULL,
        "odd schema",
        "full",
        "f",
        (m.Column("id", 23, -1, True), m.Column("j", 114, -1, True)),
    ),
    m.Relation(None, KEYLESS, "public", "keyless", "d", (m.Column("a", 25, -1, False),)),
)
_TYPED_ROW: tuple[str | None, ...] = (
    "1",
    "123.450",
    'héllo "q"',
    "null",
    "{{1,2},{3,NULL}}",
    "2024-01-02 03:04:05.5+00",
    "\\x00ff",
)
# One transaction with every kind of change the stream can bring.
_CHANGES: tuple[m.Message, ...] = (
    *_RELATIONS,
    m.Insert(None, TYPED, list(_TYPED_ROW)),
    # The key changes: a delete and its tombstone for the old key, then the update.
    m.Update(
        None,
        TYPED,
        ["1", None, None, None, None, None, None],
        True,
        ["2", "1", m.UNCHANGED_TOAST, '{"a": 1}', None, None, None],
    ),
    m.Update(None, TYPED, None, False, ["2", "2", "t", m.UNCHANGED_TOAST, "{}", None, None]),
    m.Insert(None, FULL, ["1", "null"]),
    m.Update(None, FULL, ["1", "null"], False, ["1", m.UNCHANGED_TOAST]),
    m.Delete(None, FULL, ["1", "null"], False),
    m.Delete(None, TYPED, ["2", None, None, None, None, None, None], True),
    m.Insert(None, KEYLESS, ["x"]),
    m.LogicalMessage(None, True, 0x1_0000_0200, "app.audit", b"\x00\xffbytes"),
    m.Truncate(None, 0, (TYPED, KEYLESS)),
)

# The model of each topic but the change topics.
_MODELS: dict[str, type[BaseModel]] = {
    schema_topic(PREFIX): TableSchemaRecord,
    transaction_topic(PREFIX): TransactionRecord,
    message_topic(PREFIX): MessageRecord,
}


def _validator(model: type[BaseModel]) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(json_schema(model))


def _validate(records: Iterable[tuple[str, bytes | None, bytes | None]]) -> list[dict[str, Any]]:
    """Validate each record's value against the model of its topic; the values, in order.
    A tombstone (null value) must follow a delete of the same key."""
    models: set[type[BaseModel]] = {*_MODELS.values(), ChangeValue}
    validators = {model: _validator(model) for model in models}
    values: list[dict[str, Any]] = []
    previous: tuple[str, bytes | None, dict[str, Any]] | None = None
    for topic, key, value in records:
        if value is None:
            assert previous is not None and previous[2].get("op") == "d"
            assert (topic, key) == previous[:2]
            continue
        decoded = json.loads(value)
        validators[_MODELS.get(topic, ChangeValue)].validate(decoded)
        previous = (topic, key, decoded)
        values.append(decoded)
    return values


def _builder() -> EventBuilder:
    return DefaultEventBuilder(RelationCatalog(PREFIX, _FACTS.get), PREFIX, "postgres", 1 << 20)


def _decoded(changes: Iterable[m.Message], first_lsn: int) -> list[tuple[int, m.Message]]:
    """The changes as the publisher gets them: encoded as the server sends them, decoded."""
    decoder = PgOutputDecoder()
    return [
        (first_lsn + 0x100 * n, decoder.decode(encode(msg), False)) for n, msg in enumerate(changes)
    ]


def test_schemas_folder_is_what_the_models_generate() -> None:
    folder = Path(__file__).resolve().parents[2] / "schemas"
    on_disk = {p.name: p.read_text() for p in folder.glob("*.json")}
    assert on_disk == schema_texts(), "regenerate: python -m services.contract.schemas"


def test_event_builder_records_hold_to_the_contract() -> None:
    builder = _builder()
    stream = _decoded(_CHANGES, 0x1_0000_0000)
    records = builder.transaction(7, 0x1_0000_1000, 780_000_000_000_000, iter(stream))
    values = _validate(r[:3] for r in records)
    assert [v["status"] for v in values if "status" in v] == ["BEGIN", "END"]
    assert {v["op"] for v in values if "op" in v} == set(OPS) - {"r"}
    assert any("json_nulls" in v for v in values)
    assert any(v.get("content") == "AP9ieXRlcw==" for v in values)  # the message, base64
    assert sum("columns" in v for v in values) == len(_RELATIONS)
    # Snapshot records (op r) of the table's current shape.
    info = builder.catalog.by_oid[TYPED]
    rows = builder.snapshot_rows(
        info,
        [_TYPED_ROW, ["3", None, None, None, None, None, None]],
        0x1_0000_2000,
        0,
        0x1_0000_1F00,
    )
    snapshot = _validate(r[:3] for r in rows)
    assert [v["op"] for v in snapshot] == ["r", "r"] and snapshot[0]["source"]["txId"] is None


def test_a_schema_record_names_an_array_columns_declared_dimensions() -> None:
    """Spark types an array column by its levels, which only the catalogue knows (the
    Relation message and ``format_type`` hide them): a column declared with more than one
    carries them, every other column nothing."""
    info = RelationCatalog(PREFIX, _FACTS.get).apply(_RELATIONS[0])
    dimensions = {c["name"]: c.get("dimensions") for c in info.schema_record["columns"]}
    assert dimensions == {
        "id": None,
        "num": None,
        "t": None,
        "doc": None,
        "grid": 2,
        "at": None,
        "raw": None,
    }


@pytest.mark.parametrize("schemas", [True, False], ids=["schemas", "payloads"])
def test_debezium_format_holds_to_the_contract(schemas: bool) -> None:
    """Its change and transaction records are Debezium's Connect JSON
    (``contract.debezium``; ``tests/integration/test_debezium_format.py`` holds the real
    connector's records to the same models), or their payloads alone without schemas; its
    schema and message records are the default format's."""
    builder = DebeziumEventBuilder(
        RelationCatalog(PREFIX, _FACTS.get), PREFIX, "postgres", 1 << 20, None, schemas=schemas
    )
    stream = _decoded(_CHANGES, 0x1_0000_0000)
    records = builder.transaction(7, 0x1_0000_1000, 0, iter(stream), end_lsn=0x1_0000_1040)
    models: dict[str, type[BaseModel]] = {
        **_MODELS,
        transaction_topic(PREFIX): DebeziumTransactionValue if schemas else TransactionRecord,
    }
    key_model, change_model = (
        (DebeziumKey, DebeziumChangeValue) if schemas else (DebeziumKeyPayload, DebeziumChange)
    )
    seen: list[str] = []
    for topic, key, value, _ in records:
        if key is not None and topic not in models:
            _validator(key_model).validate(json.loads(key))
        if value is not None:
            model = models.get(topic, change_model)
            _validator(model).validate(json.loads(value))
            seen.append(model.__name__)
    assert set(seen) == {m.__name__ for m in models.values()} | {change_model.__name__}
    assert seen.count(change_model.__name__) >= 5


def test_synthetic_records_hold_to_the_contract() -> None:
    table = SynthTable(
        PREFIX,
        "public",
        "t",
        (
            SynthColumn("id", "integer", 23, key=True, nullable=False),
            SynthColumn("grid", "integer[]", 1007, dimensions=2),
        ),
        version=3,
    )
    records = [
        table.schema_record(),
        *table.change("c", {"id": 1, "grid": [[1]]}, 100, 1, 7),
        *table.change("u", {"id": 1, "grid": None}, 200, 1, 8, before={"id": 1}),
        *table.change("d", {"id": 1}, 300, 1, 9),
        *table.change("r", {"id": 2, "grid": []}, 400, 1),
        *table.change("t", None, 500, 1, 10),
    ]
    values = _validate(records)
    assert [v.get("op") for v in values] == [None, "c", "u", "d", "r", "t"]


@pytest.mark.parametrize(
    ("snapshots", "ended"),
    [
        ((), ()),
        (
            (
                TableSnapshot(schema="public", table="t", id="initial", started_ms=1),
                TableSnapshot(
                    schema="public",
                    table="u",
                    id="r-1",
                    where="id > 3",
                    cursor=["7", None],
                    chunks=2,
                    rows=2048,
                    started_ms=2,
                ),
            ),
            (),
        ),
        (
            (),
            (
                EndedSnapshot(
                    schema="public",
                    table="t",
                    id="r-2",
                    chunks=1,
                    rows=1000,
                    started_ms=3,
                    outcome="done",
                    ended_ms=4,
                ),
            ),
        ),
    ],
)
def test_progress_record_holds_to_the_contract(
    snapshots: tuple[TableSnapshot, ...], ended: tuple[EndedSnapshot, ...]
) -> None:
    value = progress_value("slot_a", 300, 280, ServerIdentity("7301", 2), snapshots, ended)
    _validator(ProgressRecord).validate(json.loads(value))
    record = parse_progress(value, "p")
    assert (record.end_lsn, record.commit_lsn, record.timeline) == (300, 280, 2)
    assert record.snapshots == list(snapshots) and record.ended == list(ended)


def test_records_name_the_release_that_wrote_them() -> None:
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert project["project"]["version"] == VERSION


@pytest.mark.parametrize(
    ("value", "names"),
    [
        (b"not json", "value"),
        (b'{"slot": "s", "end_lsn": "far"}', "end_lsn"),
        (
            b'{"slot": "s", "end_lsn": 1, "commit_lsn": 1, "system_identifier": "7", '
            b'"timeline": 1, "ts_ms": 1, "written_by": "other"}',
            "written_by",
        ),
    ],
)
def test_a_value_that_is_no_progress_record_is_refused_in_one_line(
    value: bytes, names: str
) -> None:
    with pytest.raises(ProgressRecordError) as caught:
        parse_progress(value, "app.progress")
    message = str(caught.value)
    assert "\n" not in message and "app.progress" in message and names in message
    assert "progress_topic of its own" in message
