"""The Debezium format's column values: server text (the bridge's session settings) in,
the payload values Debezium 3.7.0.Final wrote through JsonConverter for the same rows out.

Every expected value below was read off records of the real connector (pgoutput, defaults)
on PostgreSQL 17; ``tests/integration/test_debezium_format.py`` repeats the comparison
live."""

from __future__ import annotations

import random

import orjson
import pytest

from services.bridge.decode import messages as m
from services.bridge.records import connect_values
from services.bridge.records.catalog import ColumnFacts, RelationCatalog, TableFacts
from services.bridge.records.connect_values import ColumnType, column_encoding, placeholder
from services.bridge.records.debezium import DebeziumEventBuilder, run_id
from services.common.lsn import PG_EPOCH_UNIX_US

NUMERIC_10_2 = ((10 << 16) | 2) + 4
NUMERIC_7 = (7 << 16) + 4


def _value(oid: int, text: str, typmod: int = -1) -> object:
    return column_encoding(ColumnType(oid, typmod))[1](text)


@pytest.mark.parametrize(
    ("oid", "typmod", "text", "expected"),
    [
        (21, -1, "1", 1),
        (20, -1, "3", 3),
        (26, -1, "42", 42),
        (1700, NUMERIC_10_2, "12.50", "BOI="),
        (1700, NUMERIC_10_2, "-0.50", "zg=="),
        (1700, NUMERIC_7, "1234567", "EtaH"),
        (1700, -1, "1.23456789012345678901", {"scale": 20, "value": "BrFOn4EvNmw1"}),
        (1700, -1, "100", {"scale": 0, "value": "ZA=="}),
        (1700, -1, "NaN", None),
        (700, -1, "NaN", "NaN"),
        (701, -1, "-Infinity", "-Infinity"),
        (701, -1, "2.25", 2.25),
        (16, -1, "t", True),
        (1042, -1, "ab   ", "ab   "),
        (17, -1, "\\xdeadbeef", "3q2+7w=="),
        (17, -1, "\\x00", "AA=="),
        (1082, -1, "2024-02-29", 19782),
        (1082, -1, "1900-01-01", -25567),
        (1082, -1, "0044-03-15 BC", -735160),
        (1082, -1, "infinity", 2146033979),
        (1083, -1, "13:14:15.123456", 47655123456),
        (1083, -1, "24:00:00", 86400000000),
        (1083, 3, "13:14:15.123", 47655123),
        (1266, -1, "13:14:15.5+02", "11:14:15.5Z"),
        (1266, -1, "10:00:00+00", "10:00:00Z"),
        (1114, -1, "2024-02-29 13:14:15.123456", 1709212455123456),
        (1114, -1, "1900-01-01 00:00:00", -2208988800000000),
        (1114, -1, "infinity", 9223372036854775807),
        (1114, 3, "2024-02-29 13:14:15.123", 1709212455123),
        (1184, -1, "2024-02-29 12:14:15.654321+00", "2024-02-29T12:14:15.654321Z"),
        (1184, -1, "1900-01-01 00:00:00+00", "1900-01-01T00:00:00.000000Z"),
        (1184, -1, "-infinity", "-infinity"),
        (1184, -1, "infinity", "infinity"),
        (1186, -1, "P1Y2M3DT4H5M6.789S", 37091106789000),
        (1186, -1, "P-1DT-2H", -93600000000),
        (2950, -1, "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        (114, -1, '{"a": 1, "a": 2}', '{"a": 1, "a": 2}'),
        (790, -1, "$12.34", "BNI="),
        (790, -1, "-$1,234.56", "/h3A"),
        (
            600,
            -1,
            "(1.5,-2.25)",
            {"x": 1.5, "y": -2.25, "wkb": "AQEAAAAAAAAAAAD4PwAAAAAAAALA", "srid": None},
        ),
        (1007, -1, "{1,NULL,3}", [1, None, 3]),
        (1009, -1, '{"x y","NULL",z}', ["x y", "NULL", "z"]),
        (1231, -1, "{1.5,NULL}", [{"scale": 1, "value": "Dw=="}, None]),
        (142, -1, "<a>1</a>", "<a>1</a>"),
    ],
)
def test_values_as_debezium_wrote_them(oid: int, typmod: int, text: str, expected: object) -> None:
    assert _value(oid, text, typmod) == expected


@pytest.mark.parametrize(
    ("column", "schema"),
    [
        (
            ColumnType(1700, NUMERIC_10_2),
            {
                "type": "bytes",
                "name": "org.apache.kafka.connect.data.Decimal",
                "version": 1,
                "parameters": {"scale": "2", "connect.decimal.precision": "10"},
            },
        ),
        (ColumnType(1083, 3), {"type": "int32", "name": "io.debezium.time.Time", "version": 1}),
        (
            ColumnType(1114, -1),
            {"type": "int64", "name": "io.debezium.time.MicroTimestamp", "version": 1},
        ),
        (
            ColumnType(790, -1),
            {
                "type": "bytes",
                "name": "org.apache.kafka.connect.data.Decimal",
                "version": 1,
                "parameters": {"scale": "2"},
            },
        ),
        (
            ColumnType(99_999, -1, ("sad", "ok", "happy")),
            {
                "type": "string",
                "name": "io.debezium.data.Enum",
                "version": 1,
                "parameters": {"allowed": "sad,ok,happy"},
            },
        ),
        (
            ColumnType(99_998, -1, ("a", "b"), enum_array=True),
            {
                "type": "array",
                "items": {
                    "type": "string",
                    "name": "io.debezium.data.Enum",
                    "version": 1,
                    "parameters": {"allowed": "a,b"},
                    "optional": True,
                },
            },
        ),
        (ColumnType(1007, -1), {"type": "array", "items": {"type": "int32", "optional": True}}),
        # No mapping in the connector (it leaves the column out): the server's text.
        (ColumnType(1187, -1), {"type": "string"}),
        (ColumnType(99_997, -1), {"type": "string"}),
    ],
)
def test_schemas(column: ColumnType, schema: dict[str, object]) -> None:
    assert column_encoding(column)[0] == schema


def test_unchanged_toast_placeholders() -> None:
    assert placeholder(ColumnType(25, -1)) == "__debezium_unavailable_value"
    assert placeholder(ColumnType(17, -1)) == "X19kZWJleml1bV91bmF2YWlsYWJsZV92YWx1ZQ=="
    assert placeholder(ColumnType(1009, -1)) == ["__debezium_unavailable_value"]
    assert placeholder(ColumnType(1007, -1))[:3] == [95, 95, 100]  # type: ignore[index]


def test_run_id_is_a_version_7_uuid() -> None:
    run = run_id(0x01A20527A3E5, bytes(range(10)))
    assert run.startswith("01a20527-a3e5-7")
    assert run[19] in "89ab"


def _builder() -> DebeziumEventBuilder:
    facts = TableFacts(
        {"id": ColumnFacts("integer", False), "t": ColumnFacts("text", True)}, ("id",)
    )
    return DebeziumEventBuilder(
        RelationCatalog("dbz", lambda oid: facts), "dbz", "dbzt", 1 << 20, None
    )


def _relation() -> m.Relation:
    return m.Relation(
        None,
        16_400,
        "public",
        "t",
        "d",
        (m.Column("id", 23, -1, True), m.Column("t", 25, -1, False)),
    )


def test_records_of_a_key_change() -> None:
    builder = _builder()
    changes: list[tuple[int, m.Message]] = [
        (100, _relation()),
        (120, m.Update(None, 16_400, ["1", None], True, ["2", "x"])),
    ]
    records = list(builder.transaction(7, 200, 0, iter(changes), end_lsn=248))
    change = [r for r in records if r[0] == "dbz.public.t"]
    assert [r[2] is None for r in change] == [False, True, False]
    delete, create = orjson.loads(change[0][2]), orjson.loads(change[2][2])  # type: ignore[arg-type]
    assert delete["payload"]["op"] == "d"
    assert delete["payload"]["before"] == {"id": 1, "t": None}
    assert create["payload"]["op"] == "c" and create["payload"]["before"] is None
    assert create["payload"]["source"]["sequence"] == '[null,"120"]'
    assert change[0][3][0] == ("__debezium.newkey", b'{"id":2}')  # type: ignore[index]
    assert change[2][3][0] == ("__debezium.oldkey", b'{"id":1}')  # type: ignore[index]
    assert orjson.loads(change[2][1])["payload"] == {"id": 2}  # type: ignore[arg-type]
    # The next transaction names this one's end as the previous commit.
    changes = [(300, m.Insert(None, 16_400, ["3", "y"]))]
    record = next(
        r
        for r in builder.transaction(8, 320, 0, iter(changes), end_lsn=360)
        if r[0] == "dbz.public.t"
    )
    assert orjson.loads(record[2])["payload"]["source"]["sequence"] == '["248","300"]'  # type: ignore[arg-type]


@pytest.mark.parametrize("width", range(7))
def test_zoned_timestamps_through_datetime_equal_the_exact_path(width: int) -> None:
    # The usual timestamptz goes through datetime (C); the exact path, which every other
    # value takes, is the reference. Values as PostgreSQL prints them, days and years
    # crossed by the offset included.
    fast = connect_values._zoned_timestamp(width)
    exact = connect_values._zoned_timestamp_exact(width)
    generator = random.Random(width)
    texts = [
        "0001-01-01 00:30:00+01",  # before year 1 in UTC: the exact path
        "9999-12-31 23:30:00-01",  # after 9999 in UTC
        "2024-02-29 23:59:59.999999-15:59:59",
        "2000-01-01 00:00:00+00",
        "infinity",
        "-infinity",
        "0044-03-15 12:00:00+01 BC",
        "12345-01-01 00:00:00+00",
    ]
    for _ in range(3000):
        year = generator.choice(
            [1, 2, 99, 1000, 1969, 1970, 2024, 9999, generator.randint(1, 9999)]
        )
        month, day = generator.randint(1, 12), generator.randint(1, 28)
        clock = f"{generator.randint(0, 23):02d}:{generator.randint(0, 59):02d}:"
        clock += f"{generator.randint(0, 59):02d}"
        fraction = generator.choice(
            ["", ".5", ".000001", ".120", f".{generator.randint(0, 999999):06d}"]
        )
        sign = generator.choice("+-")
        offset = f"{sign}{generator.randint(0, 15):02d}"
        offset += generator.choice(["", ":30", ":45", f":{generator.randint(0, 59):02d}:07"])
        texts.append(f"{year:04d}-{month:02d}-{day:02d} {clock}{fraction}{offset}")
    for text in texts:
        assert fast(text) == exact(text), text


def test_the_source_block_names_its_relation_whatever_the_names_hold() -> None:
    # Its pieces are templates made once per relation version: a % in a name is text.
    builder = DebeziumEventBuilder(
        RelationCatalog("db%z", lambda oid: None), "db%z", "d%sb", 1 << 20, 40
    )
    relation = m.Relation(None, 16_400, "pub%dlic", "t%b", "d", (m.Column("id", 23, -1, True),))
    commit_ts = 785_000_000_123_456
    changes: list[tuple[int, m.Message]] = [(100, relation), (120, m.Insert(None, 16_400, ["1"]))]
    records = list(builder.transaction(7, 200, commit_ts, iter(changes), end_lsn=250))
    info = builder.catalog.by_oid[16_400]
    streamed = [r for r in records if r[0] == info.topic]
    snapshot = list(builder.snapshot_rows(info, [["2"]], 300, commit_ts, 290))
    us = commit_ts + PG_EPOCH_UNIX_US
    for record, xid, lsn, flag, sequence in (
        (streamed[0], 7, 120, "false", '["40","120"]'),
        (snapshot[0], None, 290, "true", '["250","290"]'),
    ):
        source = orjson.loads(record[2])["payload"]["source"]  # type: ignore[arg-type]
        assert source == {
            "version": source["version"],
            "connector": "postgresql",
            "name": "db%z",
            "ts_ms": us // 1000,
            "snapshot": flag,
            "db": "d%sb",
            "sequence": sequence,
            "ts_us": us,
            "ts_ns": us * 1000,
            "schema": "pub%dlic",
            "table": "t%b",
            "txId": xid,
            "lsn": lsn,
            "xmin": None,
            "origin": None,
            "origin_lsn": None,
        }
