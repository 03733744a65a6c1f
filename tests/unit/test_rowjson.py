"""The compiled row builder writes the very bytes the Python path writes, for every type.

``catalog.row_plan`` turns a row's text values into its JSON object and key in C; the Python
path (``whole_row`` then orjson) is the reference it is held to here, value by value,
including the texts a kind does not recognise and hands back to the column's converter.
"""

from __future__ import annotations

import base64
import dataclasses
import gc
import importlib.util
import itertools
import json
import math
import random
import re
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from decimal import Decimal
from typing import Any, Literal

import orjson
import pytest

from services.bridge.decode import messages as m
from services.bridge.decode.decoder import DecodeError, PgOutputDecoder
from services.bridge.records import _rowjson, events
from services.bridge.records._rowjson import RowPlan
from services.bridge.records.catalog import (
    ColumnFacts,
    RelationCatalog,
    RelationInfo,
    TableFacts,
    row_plan,
)
from services.bridge.records.connect_values import COMPILED_KINDS
from services.bridge.records.debezium import DebeziumEventBuilder, context_headers_of
from services.bridge.records.default import DefaultEventBuilder
from services.bridge.records.events import EventBuilder, Record, RecordChoices, Undecoded, whole_row
from services.bridge.records.masking import HashRule, column_mask
from services.bridge.records.values import TYPE_NAMES, ArrayOf, JsonValue
from services.contract.records import TOAST_PLACEHOLDER
from tests.unit.pgoutput_builder import encode, tuple_data

CONTROL = "".join(chr(i) for i in range(0x20))
# The record formats: the default, Debezium's with Connect schemas, without them, and
# without them and the context headers.
FORMATS = ["slotbridge", "debezium", "debezium-payload", "debezium-lean"]
# Texts per type OID as the server prints them, plus the odd ones a converter must judge.
SAMPLES: dict[int, list[str]] = {
    16: ["t", "f"],
    17: [
        "\\x",
        "\\x00ff10",
        "\\xDEADbeef",
        "\\x" + "0123456789abcdef" * 100,
        "ab\\\\c\\001",
        "\\x0",  # an odd digit count, and not hex: the converter refuses them
        "\\xzz",
    ],
    18: ["a", '"'],
    19: ["pg_class", ""],
    20: ["0", "-1", "9223372036854775807", "-9223372036854775808", "007", "+5", "-0", "-"],
    21: ["32767", "-32768", "10"],
    23: ["2147483647", "-2147483648", "1 "],
    25: ["", "plain", 'quote " back \\ slash /', CONTROL, "\x7f é 😀 \u2028 中文"],
    26: ["4294967295"],
    700: ["1.5", "NaN", "Infinity", "-Infinity", "3.4028235e+38", "1e-45", "-0", "3"],
    701: [
        *("0.1", "1e+20", "-1.7976931348623157e+308", "NaN", "0", "-0", "100", "-1.25"),
        *("0.0001", "0.000123", "0.00001", "123456789012345", "1234567890123456", "99.5"),
        *("0.30000000000000004", "12345678901234.5", "1.50", "01.5", "1.", ".5", "1e5", "1e-05"),
        *("-", "0.", "1.2.3", " 1", "0.0"),
    ],
    790: ["$12.34", "-$1,234.56", "$0.00"],
    1042: ["a   ", " padded "],
    1043: ["x", "line\nbreak"],
    1082: ["2024-02-29", "infinity", "0044-03-15 BC"],
    1083: ["23:59:59.999999", "00:00:00"],
    1114: ["2024-01-02 03:04:05.123456", "infinity", "-infinity", "0044-03-15 10:00:00 BC"],
    1184: [
        "2024-01-02 03:04:05.123456+00",
        "2024-01-02 03:04:05+00",
        "infinity",
        "-infinity",
        "0044-03-15 10:00:00+00 BC",
        "2024-01-02 05:04:05+02",
        "2024-01-02 03:04:05+05:30",
    ],
    1186: ["P1Y2M3DT4H5M6S", "PT0S"],
    1266: ["10:00:00+02", "10:00:00-03:30"],
    1700: ["1.50", "NaN", "Infinity", "-0.000000000000000000001", "123456789012345678901234567890"],
    2950: ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"],
    # Arrays: what the compiled builder writes itself (one dimension, no escapes) and what
    # it leaves to parse_array (bounds, nesting, escapes, malformed or odd elements).
    1000: ["{t,f,NULL}", "{true}"],
    1005: ["{1,-2}", "{01}"],
    1007: ["{}", "{1,2,NULL}", "{{1,2},{3,4}}", "[0:1]={7,8}", '{"3",4}', '{"NULL"}', "{1 }"],
    1009: [
        *('{"a b","NULL",NULL,"q\\"uote"}', "{x,y}", "{NULL}", "{null,Null}", '{""}'),
        *('{"a,b","{c}",d}', "{é,😀,中文}", '{"ctl\x01\t"}', "{a,,b}", "{a,}", "{,}"),
        *("{,a}", '{"a"b}', '{a"b"}', '{"a}', "{a", "a}", "{}}", "{{}}", "{{a},{b}}"),
        *("[1:2]={a,b}", "{a\\,b}", "{ a , b }"),
    ],
    1015: ["{x,NULL}", '{"with space"}'],
    1016: ["{9223372036854775807,-9223372036854775808}", "{-0}"],
    1022: ["{1.5,NULL}", "{NaN}"],
    1115: ['{"2024-01-02 03:04:05.5",infinity}'],
    1182: ["{2024-02-29,NULL}"],
    1185: [
        *('{"2024-01-02 03:04:05+00",NULL}', '{"2024-01-02 05:04:05+02"}'),
        '{"2024-01-02 03:04:05+00","2024-01-02 05:04:05+02"}',
    ],
    1231: ["{1.50,NaN,NULL}"],
    2951: ["{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}"],
    3807: ['{"{\\"a\\": 1}",NULL}'],
    16_385: ["an enum label", "citext value"],  # not in the table: stays text
}


def relation(oids: Sequence[int], key: Sequence[int] = (0,), identity: str = "d") -> m.Relation:
    columns = tuple(
        m.Column(f"c{i}_{TYPE_NAMES.get(oid, 'other')}", oid, -1, i in key)
        for i, oid in enumerate(oids)
    )
    return m.Relation(None, 16_401, "public", "every type", identity, columns)


def info_of(rel: m.Relation, facts: TableFacts | None = None) -> RelationInfo:
    return RelationCatalog("app", lambda oid: facts).apply(rel)


# What the compiled runs put around a row (six pieces, four numbers): nothing, for the tests
# (the same for an insert, an update and a delete).
SIX = (b"",) * 6
# The numbers between them (indexes into lsn, total, order): the lsn twice, the orders.
LSN_TWICE_AND_ORDERS = bytes((0, 0, 1, 2))


def one_relation_runs(
    plan: RowPlan,
    items: Iterator[tuple[int, bytes]],
    lsn: int,
    payload: bytes,
    kinds: tuple[tuple[bytes, ...], ...],
    total: int = 0,
    trailing: tuple[int, ...] = (),
    slots: bytes = LSN_TWICE_AND_ORDERS,
    limit: int = 10,
) -> tuple[list[Any], int, int, tuple[int, Any] | None]:
    """``_rowjson.runs`` over changes to relation 16401 alone, whose records go to topic
    "t": (records, total, the topic's order, leftover)."""
    version = object()  # what the catalogue holds: the runs check the plan is still its
    per_table: dict[str, int] = {}
    records, total, leftover = _rowjson.runs(
        items,
        lsn,
        payload,
        1,
        {16_401: (version, plan, kinds, "t")},
        {16_401: version},
        per_table,
        total,
        None,
        1 << 30,
        limit,
        trailing,
        slots,
        True,
    )
    return records, total, per_table.get("t", 0), leftover


def in_place(plan: RowPlan, data: bytes) -> tuple[bytes, bytes | None] | None:
    """The compiled runs' record of one Insert whose TupleData is ``data``: (value, key), or
    None when the plan leaves it to the decoder."""
    message = b"I" + struct.pack("!I", 16_401) + b"N" + data
    records, *_ = one_relation_runs(plan, iter(()), 0, message, (SIX, SIX, SIX, (b"",) * 7))
    return (records[0][2], records[0][1]) if records else None


def built(plan: RowPlan, values: Sequence[str | None]) -> tuple[bytes, bytes | None]:
    """The row and key JSON alone: ``record`` with nothing around the row; ``records`` of
    the same values as pgoutput TupleData (inside an Insert message) must agree."""
    try:
        made = plan.record(values, (b"", b""), ())
    except ValueError as exc:  # a converter refused the text: in place too
        with pytest.raises(ValueError, match=re.escape(str(exc)[:20])):
            in_place(plan, tuple_data(values))
        raise
    assert made is not None
    framed = plan.record(values, SIX, (0, 0, 1, 1))
    assert in_place(plan, tuple_data(values)) == framed, values
    return made


def python_path(info: RelationInfo, values: Sequence[str | None]) -> tuple[bytes, bytes | None]:
    row = whole_row(info, values)
    key = orjson.dumps({n: row[n] for n in info.key_names}) if info.key_names else None
    return orjson.dumps(row), key


def test_the_compiled_builder_is_built() -> None:
    # CI installs with a C compiler: without the extension the benches would measure the
    # slow path while everything else passed.
    assert importlib.util.find_spec("services.bridge.records._rowjson") is not None
    assert row_plan(info_of(relation((20,)))) is not None


@pytest.mark.parametrize("oid", sorted(SAMPLES))
def test_each_type_matches_the_python_path(oid: int) -> None:
    # The column under test next to an integer key and a text column, each sample with
    # NULLs around it.
    info = info_of(relation((20, oid, 25)))
    plan = info.plan
    assert plan is not None
    for text in [*SAMPLES[oid], None]:
        for values in (["1", text, "x"], ["-2", text, None]):
            try:
                expected = python_path(info, values)
            except ValueError as exc:
                with pytest.raises(ValueError, match=str(exc).replace("\\", "\\\\")[:20]):
                    built(plan, values)
                continue
            assert built(plan, values) == expected, (oid, text)


def _server_float(value: float) -> str:
    """A double as PostgreSQL prints it with extra_float_digits > 0: its shortest digits, in
    fixed notation for decimal exponents -4 to 14, else as d.ddde+XX."""
    if value == 0:
        return "-0" if math.copysign(1, value) < 0 else "0"
    shortest = Decimal(repr(value)).normalize()
    sign, digits, exp = shortest.as_tuple()
    assert isinstance(exp, int)
    exponent = len(digits) + exp - 1
    if -4 <= exponent < 15:
        return format(shortest, "f")
    mantissa = "".join(map(str, digits))
    mantissa = mantissa[0] + ("." + mantissa[1:] if len(mantissa) > 1 else "")
    return f"{'-' if sign else ''}{mantissa}e{'-' if exponent < 0 else '+'}{abs(exponent):02d}"


def test_floats_as_postgresql_prints_them_match_the_python_path() -> None:
    # float4/float8 in fixed notation are written by the builder (kind 'f'), the rest by the
    # converter: doubles of every magnitude in the server's form, with 16-17 digits (most
    # random doubles) or rounded to fewer.
    assert [_server_float(v) for v in (100.0, 1e15, 1.5e-7, 0.0001, -0.0)] == [
        *("100", "1e+15", "1.5e-07", "0.0001", "-0"),
    ]
    info = info_of(relation((20, 701, 1022)))
    plan = info.plan
    assert plan is not None
    draw = random.Random(701)
    for _ in range(5_000):
        value = draw.uniform(-1, 1) * 10.0 ** draw.randint(-7, 17)
        if draw.random() < 0.5:
            value = float(f"{value:.{draw.randint(1, 15)}g}")
        text = _server_float(value)
        values = ["1", text, "{" + text + ",NULL}"]
        assert built(plan, values) == python_path(info, values), text


def test_keys_in_key_order_and_keyless_tables() -> None:
    rel = relation((25, 20, 1184, 16), key=(2, 0))
    info = info_of(rel)
    assert info.plan is not None
    values = ['name \\ "q"', "42", "2024-01-02 03:04:05+00", "t"]
    assert built(info.plan, values) == python_path(info, values)
    assert (
        built(info.plan, values)[1]
        == b'{"c0_text":"name \\\\ \\"q\\"","c2_timestamp with time zone":"2024-01-02T03:04:05Z"}'
    )
    keyless = info_of(relation((20, 25), key=()))
    assert keyless.plan is not None and built(keyless.plan, ["1", "a"]) == (
        b'{"c0_bigint":1,"c1_text":"a"}',
        None,
    )


def test_replica_identity_full_keys_on_the_primary_key() -> None:
    rel = relation((20, 25, 23), key=(0, 1, 2), identity="f")
    names = [c.name for c in rel.columns]
    facts = TableFacts({n: ColumnFacts("x", True) for n in names}, (names[2],))
    info = info_of(rel, facts)
    assert info.plan is not None
    assert built(info.plan, ["1", "a", "3"]) == python_path(info, ["1", "a", "3"])
    assert built(info.plan, ["1", "a", "3"])[1] == b'{"c2_integer":3}'


def test_wide_rows_and_long_values() -> None:
    oids = [oid for oid in itertools.islice(itertools.cycle((20, 25, 1184, 16, 1700)), 150)]
    info = info_of(relation(oids))
    assert info.plan is not None
    texts = {20: "7", 25: "é" * 100_000 + CONTROL, 1184: "2024-01-02 03:04:05+00", 16: "f"}
    values = [texts.get(oid, "1.25") for oid in oids]
    assert built(info.plan, values) == python_path(info, values)


def test_texts_escaped_at_every_place_in_a_word() -> None:
    # Text is scanned eight bytes at a time: each byte JSON escapes (and non-ASCII, which the
    # in-place read decodes) at every offset of texts that end inside, on and past a word.
    info = info_of(relation((20, 25)))
    assert info.plan is not None
    for special in ['"', "\\", *CONTROL, "\x7f", "é", "😀"]:
        for length in (7, 8, 9, 16, 23, 24, 25):
            for at in range(length):
                text = ("abcdefghijklmnopqrstuvwxyz" * 2)[:at] + special + "z" * (length - at - 1)
                values = ["1", text]
                assert built(info.plan, values) == python_path(info, values), (special, at)


def test_what_the_builder_refuses() -> None:
    info = info_of(relation((20, 16)))
    assert info.plan is not None
    with pytest.raises(ValueError, match="not a boolean"):
        built(info.plan, ["1", "yes"])
    with pytest.raises(TypeError, match="column 1: text or None expected"):
        info.plan.record(["1", m.UNCHANGED_TOAST], (b"", b""), ())  # type: ignore[list-item]
    with pytest.raises(ValueError, match="1 values for 2 columns"):
        info.plan.record(["1"], (b"", b""), ())


def test_what_is_left_to_the_decoder() -> None:
    # records reads text, NULL and unchanged-TOAST columns (its placeholder); for anything
    # else it builds nothing and the builder decodes the message, whose decoder names what
    # is wrong.
    plan = info_of(relation((20, 25))).plan
    assert plan is not None
    good = tuple_data(["1", "x"])
    assert in_place(plan, good) == plan.record(["1", "x"], SIX, (0, 0, 1, 1))
    toasted = in_place(plan, tuple_data(["1", m.UNCHANGED_TOAST]))
    row = b'{"c0_bigint":1,"c1_text":%b}' % orjson.dumps(TOAST_PLACEHOLDER)
    assert toasted is not None and toasted[0] == row + b"0011"  # in_place's four numbers
    for data in [
        tuple_data(["1"]),  # another column count
        tuple_data(["1", "x", "y"]),
        tuple_data(["1", b"binary"]),
        good[:-1],  # the last value runs past the end
        good + b"\0",  # something after the tuple
        good[:3],
        b"",  # no column count
        good[:1],
        tuple_data(["1", "x"]).replace(b"x", b"\xff"),  # not UTF-8
        tuple_data(["1", "é"]).replace("é".encode(), b"\xc3("),
    ]:
        assert in_place(plan, data) is None, data


def test_a_format_of_its_own_sets_its_own_plan() -> None:
    catalog = RelationCatalog("app", lambda oid: None, encoder=lambda info, rel, facts: None)
    assert catalog.apply(relation((20, 25))).plan is None


def test_a_row_with_a_json_null_is_left_to_the_python_path() -> None:
    # Its record names the column in json_nulls, which the plan does not write.
    plan = info_of(relation((20, 3802))).plan
    assert plan is not None
    assert plan.record(["1", " null "], (b"", b""), ()) is None
    assert in_place(plan, tuple_data(["1", "null"])) is None
    assert plan.record(["1", '{"a":null}'], (b"", b""), ()) == (
        b'{"c0_bigint":1,"c1_jsonb":{"a":null}}',
        b'{"c0_bigint":1}',
    )


@pytest.mark.parametrize("value_format", FORMATS)
def test_records_equal_the_python_path(monkeypatch: pytest.MonkeyPatch, value_format: str) -> None:
    # Decoded inserts and snapshot rows, built by the compiled plan or without it.
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_456_789)
    rel = relation((20, 25, 1184, 1700))
    rows: list[list[str | None]] = [
        [str(i), f"row {i}\n", "2024-01-02 03:04:05+00", None] for i in range(5)
    ]

    def records(compiled: bool) -> list[Record]:
        builder = builder_of(value_format)
        info = builder.catalog.apply(rel)
        assert info.plan is not None
        if not compiled:
            info.plan = None
        changes = iter(
            [
                (0x100 + i, m.Insert(None, rel.oid, list[m.TupleValue](row)))
                for i, row in enumerate(rows)
            ]
        )
        streamed = list(builder.transaction(700, 0x200, 785_000_000_123_456, changes))
        snapshot = list(builder.snapshot_rows(info, rows, 0x300, 785_000_000_123_456, 0x2F0))
        return streamed + snapshot

    compiled = records(True)
    assert compiled == records(False)
    # BEGIN, 5 inserts, END; the schema record (first published with the chunk), 5 rows.
    assert len(compiled) == 7 + 1 + 5


@pytest.mark.parametrize("streamed", [False, True])
def test_undecoded_inserts_make_the_decoded_records(
    monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    # The publisher hands messages over as payloads: runs of inserts the plan reads become
    # records in one call each (at most _RUN of them, 3 here); the rest (a table with a
    # jsonb column has no plan, other messages) is decoded, and a broken message gets the
    # decoder's error.
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    monkeypatch.setattr(events, "_RUN", 3)
    xid = 700 if streamed else None
    plain = m.Relation(xid, 16_401, "public", "plain", "d", relation((20, 25, 1184)).columns)
    docs = m.Relation(
        xid,
        16_402,
        "public",
        "docs",
        "d",
        (m.Column("id", 20, -1, True), m.Column("doc", 3802, -1, False)),
    )
    more = m.Relation(xid, 16_403, "public", "more", "d", relation((20, 25, 1184)).columns)
    changes: list[tuple[int, m.Message]] = [(0x100, plain), (0x101, docs), (0x102, more)]
    for i in range(6):
        row: list[m.TupleValue] = [str(i), f"é {i}\n" if i % 2 else None, "2024-01-02 03:04:05+00"]
        changes.append((0x110 + i, m.Insert(xid, plain.oid, row)))
        changes.append((0x120 + i, m.Insert(xid, docs.oid, [str(i), '{"n": 1e400}'])))
    for i in range(6, 14):  # a run longer than a call's limit
        changes.append((0x130 + i, m.Insert(xid, plain.oid, [str(i), f"run {i}", None])))
    changes.append((0x150, m.Insert(xid, docs.oid, ["99", "[]"])))
    for i in range(4):  # two compiled tables in turn: each run stops at the other's insert
        changes.append(
            (0x160 + i, m.Insert(xid, (plain, more)[i % 2].oid, [str(200 + i), "", None]))
        )
    changes.append((0x170, m.Insert(xid, plain.oid, ["100", "last", None])))
    decoder = PgOutputDecoder()

    def records(undecoded: bool) -> list[Record]:
        builder = DefaultEventBuilder(
            RelationCatalog("app", lambda oid: None), "app", "shop", 1 << 20
        )
        given: list[tuple[int, m.Message | bytes]] = [
            (lsn, encode(msg) if undecoded else msg) for lsn, msg in changes
        ]
        how = Undecoded(streamed, lambda p: decoder.decode(p, streamed))
        return list(
            builder.transaction(
                700, 0x200, 785_000_000_123_456, iter(given), undecoded=how if undecoded else None
            )
        )

    compiled = records(True)
    assert compiled == records(False)
    assert len(compiled) == 2 + 3 + 6 + 6 + 8 + 1 + 4 + 1  # BEGIN, END, 3 schemas; inserts
    # The compiled runs' records are out of the cyclic collector's sight
    # (services.common.collector).
    ran = [r for r in compiled if r[0] in ("app.public.plain", "app.public.more")]
    assert len(ran) == 6 + 8 + 4 + 1
    assert not any(gc.is_tracked(record) for record in ran)
    builder = DefaultEventBuilder(RelationCatalog("app", lambda oid: None), "app", "shop", 1 << 20)
    broken = encode(m.Insert(xid, plain.oid, ["1", "x", None]))[:-1]
    how = Undecoded(streamed, lambda p: decoder.decode(p, streamed))
    with pytest.raises(DecodeError, match="malformed Insert"):
        list(
            builder.transaction(
                700, 0x200, 0, iter([(0x100, plain), (0x110, broken)]), undecoded=how
            )
        )


@pytest.mark.parametrize("streamed", [False, True])
def test_a_run_of_inserts_stops_at_a_record_over_the_limit(
    monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    # The record over max_record_bytes in the middle of a run is refused as the decoded path
    # refuses it, naming its LSN; the rows before it were built.
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    xid = 700 if streamed else None
    plain = m.Relation(xid, 16_401, "public", "plain", "d", relation((20, 25, 1184)).columns)
    changes: list[tuple[int, m.Message]] = [(0x100, plain)]
    for i in range(5):
        note = "x" * 2000 if i == 3 else f"row {i}"
        changes.append((0x110 + i, m.Insert(xid, plain.oid, [str(i), note, None])))
    decoder = PgOutputDecoder()
    how = Undecoded(streamed, lambda p: decoder.decode(p, streamed))

    def refusal(undecoded: bool) -> tuple[int, str]:
        builder = DefaultEventBuilder(RelationCatalog("app", lambda oid: None), "app", "shop", 1500)
        given = iter([(lsn, encode(msg) if undecoded else msg) for lsn, msg in changes])
        made = builder.transaction(700, 0x200, 0, given, undecoded=how if undecoded else None)
        seen = 0
        with pytest.raises(events.RowTooLarge) as refused:
            for _ in made:
                seen += 1
        return seen, str(refused.value)

    seen, message = refusal(True)
    assert (seen, message) == refusal(False)
    assert seen == 1 + 1 + 3  # BEGIN, the schema record, rows 0-2
    assert "at LSN 0/113" in message


def builder_of(value_format: str, tombstones: bool = True) -> EventBuilder:
    """A builder of ``value_format`` (one of ``FORMATS``) over an empty catalogue; the
    Debezium builder's run id (a header of every record) is fixed, so two builders write
    the same records."""
    catalog = RelationCatalog("app", lambda oid: None)
    if value_format == "slotbridge":
        return DefaultEventBuilder(
            catalog, "app", "shop", 1 << 20, choices=RecordChoices(tombstones=tombstones)
        )
    schemas = value_format == "debezium"
    headers = value_format != "debezium-lean"
    builder = DebeziumEventBuilder(
        catalog,
        "app",
        "shop",
        1 << 20,
        None,
        choices=RecordChoices(tombstones=tombstones),
        schemas=schemas,
        context_headers=headers,
    )
    if not headers:
        return builder
    builder.headers = context_headers_of("app", "0190a3b4-0000-7000-8000-000000000000")
    return builder


def row_changes(
    xid: int | None, oids: Sequence[int], row: Sequence[str | None], other: Sequence[str | None]
) -> list[tuple[int, m.Message]]:
    """Every change kind the compiled plan reads in place or leaves to the decoder, on a
    table with a primary key (16_401) and one under REPLICA IDENTITY FULL (16_402), whose
    columns have the type ``oids`` (the first is the key, an int8) and values like ``row``
    and ``other`` (the key column's value replaced)."""
    columns = relation(oids).columns
    plain = m.Relation(xid, 16_401, "public", "plain", "d", columns)
    full = m.Relation(xid, 16_402, "public", "full", "f", columns)
    toast = m.UNCHANGED_TOAST
    changes: list[tuple[int, m.Message]] = [(0x100, plain), (0x101, full)]
    for i in range(8):
        new: list[m.TupleValue] = [str(i), *(row[1:] if i % 2 else [None] * (len(row) - 1))]
        changed: list[m.TupleValue] = [str(i), *other[1:]]
        key: list[m.TupleValue] = [str(i), *[None] * (len(row) - 1)]
        changes += [
            (0x110 + i, m.Insert(xid, plain.oid, new)),
            (0x120 + i, m.Update(xid, plain.oid, None, False, changed)),
            (0x130 + i, m.Delete(xid, plain.oid, key, True)),
            (0x140 + i, m.Update(xid, full.oid, new, False, changed)),
            (0x150 + i, m.Delete(xid, full.oid, new, False)),
        ]
    changes += [
        (0x160, m.Update(xid, plain.oid, None, False, ["1", toast, *other[2:]])),
        (0x163, m.Update(xid, plain.oid, None, False, ["4", *[toast] * (len(row) - 1)])),
        (0x161, m.Update(xid, plain.oid, ["1", *[None] * (len(row) - 1)], True, ["2", *row[1:]])),
        (0x162, m.Update(xid, full.oid, ["3", *row[1:]], False, ["3", toast, *other[2:]])),
    ]
    changes += [
        (0x170 + i, m.Delete(xid, plain.oid, [str(i), *[None] * (len(row) - 1)], True))
        for i in range(7)
    ]
    return changes


def transaction_records(
    value_format: str,
    changes: list[tuple[int, m.Message]],
    streamed: bool,
    undecoded: bool,
    tombstones: bool = True,
) -> tuple[list[Record], EventBuilder]:
    """The records of one transaction of ``changes``, handed over as pgoutput payloads
    (``undecoded``: the compiled plan reads what it can) or as decoded messages."""
    builder = builder_of(value_format, tombstones)
    decoder = PgOutputDecoder()
    given: list[tuple[int, m.Message | bytes]] = [
        (lsn, encode(msg) if undecoded else msg) for lsn, msg in changes
    ]
    how = Undecoded(streamed, lambda p: decoder.decode(p, streamed))
    records = builder.transaction(
        700, 0x200, 785_000_000_123_456, iter(given), undecoded=how if undecoded else None
    )
    return list(records), builder


@pytest.mark.parametrize("value_format", FORMATS)
@pytest.mark.parametrize("streamed", [False, True])
@pytest.mark.parametrize("tombstones", [True, False], ids=["tombstones", "no-tombstones"])
def test_undecoded_updates_and_deletes_make_the_decoded_records(
    monkeypatch: pytest.MonkeyPatch, streamed: bool, value_format: str, tombstones: bool
) -> None:
    # Updates without an old tuple and deletes (old key, or old row under REPLICA IDENTITY
    # FULL) are read in place like inserts, a delete's tombstone included (unless
    # tombstones_on_delete is off); what needs both rows (an update with an old tuple, a
    # key change) or a placeholder (unchanged TOAST) is decoded. Every record equals the
    # decoded path's, in the same order.
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_456_789)
    monkeypatch.setattr(events, "_RUN", 5)
    xid = 700 if streamed else None
    row = ["0", "é 1\n", "2024-01-02 03:04:05+00"]
    changes = row_changes(xid, (20, 25, 1184), row, ["0", "u", None])
    compiled, builder = transaction_records(value_format, changes, streamed, True, tombstones)
    assert compiled == transaction_records(value_format, changes, streamed, False, tombstones)[0]
    assert all(info.plan is not None for info in builder.catalog.by_oid.values())
    # BEGIN, END, 2 schemas; 8 x (insert, update, delete, update, delete); two TOAST
    # updates, the key change (delete, update), the full table's TOAST update; 7 deletes;
    # with tombstones, one after each of the 8 x 2 + 1 + 7 deletes.
    assert len(compiled) == 4 + 8 * 5 + 2 + 2 + 1 + 7 + (8 * 2 + 1 + 7 if tombstones else 0)
    assert sum(r[2] is None for r in compiled) == (8 * 2 + 1 + 7 if tombstones else 0)


# One value of each type the Debezium format encodes its own way, as PostgreSQL prints it.
_DEBEZIUM_TYPES = {
    16: "t",  # boolean
    17: "\\x00ff10",  # bytea
    21: "-7",  # int2
    23: "2147483647",  # int4
    700: "1.5",  # float4
    701: "NaN",  # float8
    790: "$1,234.50",  # money
    1082: "2024-02-29",  # date
    1083: "13:14:15.123456",  # time
    1114: "2024-01-02 03:04:05.5",  # timestamp
    1184: "2024-01-02 03:04:05.123+02",  # timestamptz
    1186: "P1DT2H3M4S",  # interval (IntervalStyle iso_8601, as the bridge sets it)
    1266: "13:14:15+02",  # timetz
    1700: "-12345.6789",  # numeric (no modifier: variable scale)
    2950: "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",  # uuid
    3802: '{"a": [1, null]}',  # jsonb
    1007: "{1,NULL,3}",  # int4[]
    1009: '{a,"b c",NULL}',  # text[]
}


@pytest.mark.parametrize("value_format", FORMATS[1:])
@pytest.mark.parametrize("streamed", [False, True])
def test_debezium_records_of_every_type_read_in_place_equal_the_decoded(
    monkeypatch: pytest.MonkeyPatch, streamed: bool, value_format: str
) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_456_789)
    oids = (20, *_DEBEZIUM_TYPES)
    row = ["0", *_DEBEZIUM_TYPES.values()]
    other = ["0", *[None] * len(_DEBEZIUM_TYPES)]
    changes = row_changes(700 if streamed else None, oids, row, other)
    compiled, builder = transaction_records(value_format, changes, streamed, True)
    assert compiled == transaction_records(value_format, changes, streamed, False)[0]
    assert all(info.plan is not None for info in builder.catalog.by_oid.values())


@pytest.mark.usefixtures("fixed_clock")
@pytest.mark.parametrize("undecoded", [False, True], ids=["decoded", "compiled"])
def test_debezium_records_without_schemas_are_the_payloads_of_those_with(undecoded: bool) -> None:
    # JsonConverter's schemas.enable=false writes what schemas.enable=true puts under
    # "payload", with the same headers (the transaction topic's too; the schema topic's
    # records are the default format's in both). Every type and change kind, on the
    # compiled and the Python path.
    oids = (20, *_DEBEZIUM_TYPES)
    changes = row_changes(
        None, oids, ["0", *_DEBEZIUM_TYPES.values()], ["0", *[None] * len(_DEBEZIUM_TYPES)]
    )
    payloads = transaction_records("debezium-payload", changes, False, undecoded)[0]
    framed = transaction_records("debezium", changes, False, undecoded)[0]

    def unframed(raw: bytes | None) -> Any:
        return None if raw is None else json.loads(raw)["payload"]

    assert len(payloads) == len(framed)
    for ours, theirs in zip(payloads, framed, strict=True):
        if ours[0] == "app.schema":
            assert ours == theirs
            continue
        assert (ours[0], ours[3]) == (theirs[0], theirs[3])
        assert ours[1] is None or json.loads(ours[1]) == unframed(theirs[1])
        assert ours[2] is None or json.loads(ours[2]) == unframed(theirs[2])
        assert (ours[1] is None, ours[2] is None) == (theirs[1] is None, theirs[2] is None)
    transactions = [v for t, _, v, _ in payloads if t == "app.transaction" and v]
    assert [json.loads(v)["status"] for v in transactions] == ["BEGIN", "END"]
    ops = {json.loads(v)["op"] for t, _, v, _ in payloads if v and t == "app.public.plain"}
    assert ops == {"c", "u", "d"}


@pytest.mark.usefixtures("fixed_clock")
@pytest.mark.parametrize("undecoded", [False, True], ids=["decoded", "compiled"])
def test_debezium_records_without_context_headers_carry_only_a_key_changes(
    undecoded: bool,
) -> None:
    # extended.headers.enabled=false: the same keys and values, no __debezium.context.*
    # headers (so the sink may send them in batches), a key change's newkey/oldkey kept.
    changes = row_changes(None, (20, 25), ["0", "x"], ["0", "u"])
    with_headers = transaction_records("debezium-payload", changes, False, undecoded)[0]
    without = transaction_records("debezium-lean", changes, False, undecoded)[0]
    assert [r[:3] for r in without] == [r[:3] for r in with_headers]
    kept = [
        [(name, value) for name, value in r[3] or () if not name.startswith("__debezium.context.")]
        or None
        for r in with_headers
    ]
    assert [r[3] for r in without] == kept
    assert sum(headers is not None for headers in kept) == 3  # the key change's records


def _typmod(precision: int, scale: int) -> int:
    """numeric(precision, scale)'s type modifier."""
    return (precision << 16 | scale) + 4


_BIG = "12345678901234567890123456789012345678"  # 38 digits: the compiled builder's most
# The texts of the types the Debezium format writes its own way in the compiled builder (the
# decimals, dates and times), by (type oid, modifier), with those it hands to the converter.
_CONNECT_SAMPLES: dict[tuple[int, int], list[str]] = {
    (1700, -1): [
        *("0", "-0", "1.50", "100", "100.000", "-12345.6789", "0.000001", "-0.000000000000001"),
        *("127", "128", "-128", "-129", "255", "256", "32767", "-32768", "-32769", "65536"),
        *(_BIG, "-" + _BIG, "1" + _BIG, "9" * 38, "-" + "9" * 38, "1234567890.1234567890"),
        *("NaN", "Infinity", "-Infinity", "1.", ".5", "1.2.3", "-", "1e5"),
    ],
    (1700, _typmod(10, 2)): ["1.50", "-1.50", "0.00", "-0.01", "12345678.90", "127.00", "NaN"],
    (1700, _typmod(38, 0)): ["0", _BIG, "-" + _BIG, "-1"],
    (1700, _typmod(38, 10)): ["1.5", "-1234567890123456789012345678.1234567891", "1.12345678901"],
    (1700, _typmod(1000, 500)): ["1.5", "-2"],
    **{
        (1184, typmod): [
            *(
                "2024-01-02 03:04:05.123456+00",
                "2024-01-02 03:04:05+00",
                "2024-01-02 03:04:05.5+02",
            ),
            *("2024-01-01 01:00:00+05:30", "2024-03-01 00:30:00+01", "2023-03-01 00:30:00+01"),
            *(
                "2024-02-28 23:30:00-01",
                "2024-01-02 03:04:05+05:30:15",
                "2024-01-02 03:04:05-00:30",
            ),
            *("1969-12-31 23:59:59.999999-00:30", "1900-01-01 00:00:00.000001+00"),
            *("0001-01-01 00:00:00+01", "0001-01-01 00:00:00-01", "9999-12-31 23:00:00-02"),
            *("2024-01-02 03:04:05.1+00", "2024-01-02 03:04:05.100+00", "2000-02-29 12:00:00+14"),
            *("infinity", "-infinity", "0044-03-15 10:00:00+00 BC", "12024-01-01 00:00:00+00"),
            *("2024-01-02 03:04:05", "2024-01-02 03:04:05+5", "2024-01-02T03:04:05+00"),
        ]
        for typmod in (-1, 0, 3)
    },
    **{
        (1114, typmod): [
            *("2024-01-02 03:04:05.5", "2024-01-02 03:04:05", "1969-12-31 23:59:59.9995"),
            *("1969-12-31 23:59:59.999999", "1900-01-01 00:00:00", "0001-01-01 00:00:00.000001"),
            *("infinity", "-infinity", "0044-03-15 10:00:00 BC", "294276-12-31 23:59:59.999999"),
            *("2024-01-02 03:04:05.1234567", "2024-01-02 3:04:05"),
        ]
        for typmod in (-1, 3, 6)
    },
    (1082, -1): [
        *("2024-02-29", "1970-01-01", "1969-12-31", "0001-01-01", "9999-12-31", "1900-03-01"),
        *("infinity", "-infinity", "0044-03-15 BC", "10000-01-01"),
    ],
    **{
        (1083, typmod): ["00:00:00", "23:59:59.999999", "24:00:00", "12:34:56.7", "13:14:15.123"]
        for typmod in (-1, 3)
    },
    (17, -1): ["\\x", "\\x00ff10", "\\x" + "ff" * 1001, "ab\\\\c\\001"],
}


@pytest.mark.parametrize(("oid", "typmod"), sorted(_CONNECT_SAMPLES))
def test_each_debezium_type_matches_the_python_path(oid: int, typmod: int) -> None:
    # connect_values.py is the reference; the compiled kinds read the texts PostgreSQL
    # prints and hand any other to it (which may refuse it), so both paths agree on all.
    columns = (m.Column("id", 20, -1, True), m.Column("v", oid, typmod, False))
    builder = builder_of("debezium")
    info = builder.catalog.apply(m.Relation(None, 16_401, "public", "t", "d", columns))
    plan = info.plan
    assert plan is not None
    for text in [*_CONNECT_SAMPLES[(oid, typmod)], None]:
        values = ["1", text]
        try:
            expected = orjson.dumps(whole_row(info, values))
        except ValueError as exc:
            with pytest.raises(ValueError, match=re.escape(str(exc)[:20])):
                built(plan, values)
            continue
        assert built(plan, values)[0] == expected, (oid, typmod, text)


def test_the_compiled_kinds_write_what_the_server_prints_without_the_converter() -> None:
    # The test above would pass on the converters alone: here they refuse every text, so
    # what the kinds read themselves comes out, and the rest reaches the converter.
    def refuse(text: str) -> str:
        raise ValueError(f"converter called for {text!r}")

    texts = {
        b"D": ("-1.50", "NaN"),
        b"V": ("1.50", "Infinity"),
        b"Z": ("2024-01-02 03:04:05.5+02", "infinity"),
        b"M": ("2024-01-02 03:04:05.5", "infinity"),
        b"m": ("1969-12-31 23:59:59.9995", "-infinity"),
        b"d": ("2024-02-29", "0044-03-15 BC"),
        b"U": ("23:59:59.999999", "25:00"),
        b"u": ("13:14:15.123", "1:2:3"),
        b"B": ("\\x00ff10", "ab\\\\c"),
    }
    for kind, (read, handed_over) in texts.items():
        plan = RowPlan(
            (b'"v":',), kind, (), (refuse,), orjson.dumps, b"", b"", False, None, None, (3,)
        )
        assert plan.record([read], (b"", b""), ()) is not None
        with pytest.raises(ValueError, match="converter called"):
            plan.record([handed_over], (b"", b""), ())
    with_scale = RowPlan(
        (b'"v":',), b"Z", (), (refuse,), orjson.dumps, b"", b"", False, None, None, (3,)
    )
    assert with_scale.record(["2024-01-02 03:04:05.5+02"], (b"", b""), ()) == (
        b'{"v":"2024-01-02T01:04:05.500Z"}',
        None,
    )


@pytest.mark.parametrize("value_format", ["slotbridge", "debezium"])
def test_arrays_of_the_compiled_kinds_are_written_without_the_converter(value_format: str) -> None:
    # The samples above would pass on parse_array alone: here each array's converter refuses
    # every text, so the arrays the builder writes itself come out (equal to the Python
    # path's), and the forms it leaves to parse_array reach the converter.
    class Refusing(ArrayOf):
        __slots__ = ()

        def __call__(self, text: str) -> JsonValue:
            raise ValueError(f"converter called for {text!r}")

    oids = (20, 1007, 1009, 1182, 1185)
    columns = tuple(m.Column(f"c{i}", oid, -1, i == 0) for i, oid in enumerate(oids))
    info = builder_of(value_format).catalog.apply(
        m.Relation(None, 16_401, "public", "t", "d", columns)
    )
    refusing = tuple(Refusing(c.element) if isinstance(c, ArrayOf) else c for c in info.converters)
    plan = row_plan(dataclasses.replace(info, converters=refusing), own_kinds=COMPILED_KINDS)
    assert plan is not None
    values = ["1", "{1,NULL,-3}", '{a,"b, c",NULL,"NULL"}', "{2024-02-29,NULL}", None]
    assert built(plan, values)[0] == orjson.dumps(whole_row(info, values))
    # Bounds, nesting, an escape, an element the kind does not read (here, Debezium's
    # timestamptz elements: its kind takes a width, so the array stays with the converter).
    for column, text in ((1, "[0:1]={7,8}"), (1, "{{1}}"), (2, '{"q\\"x"}'), (1, "{01}")):
        with pytest.raises(ValueError, match="converter called"):
            built(plan, [*values[:column], text, *values[column + 1 :]])
    zoned = [*values[:4], '{"2024-01-02 03:04:05+00"}']
    if value_format == "slotbridge":
        assert built(plan, zoned)[0] == orjson.dumps(whole_row(info, zoned))
    else:
        with pytest.raises(ValueError, match="converter called"):
            built(plan, zoned)


@pytest.mark.usefixtures("fixed_clock")
@pytest.mark.parametrize("value_format", FORMATS)
def test_transactions_after_the_first_read_in_place_equal_the_decoded(value_format: str) -> None:
    # The compiled pieces are a relation version's, the transaction's numbers slotted in;
    # a Debezium record's sequence names the previous commit from the second on.
    changes = row_changes(
        None, (20, 25, 1184), ["0", "x", "2024-01-02 03:04:05+00"], ["0", "u", None]
    )
    decoder = PgOutputDecoder()
    how = Undecoded(False, lambda p: decoder.decode(p, False))

    def records(undecoded: bool) -> list[Record]:
        builder = builder_of(value_format)
        made: list[Record] = []
        for n in range(3):
            given: list[tuple[int, m.Message | bytes]] = [
                (lsn, encode(msg) if undecoded else msg) for lsn, msg in changes
            ]
            made += builder.transaction(
                700 + n,
                0x200 + n,
                785_000_000_123_456 + n,
                iter(given),
                end_lsn=0x210 + n,
                undecoded=how if undecoded else None,
            )
        return made

    compiled = records(True)
    assert compiled == records(False)
    if value_format == "debezium":
        sequences = {
            orjson.loads(v)["payload"]["source"]["sequence"].split(",")[0]
            for t, _, v, _ in compiled
            if v is not None and t.endswith(".plain")
        }
        assert sequences == {"[null", '["528"', '["529"'}


def test_updates_and_deletes_are_read_in_place() -> None:
    # The compiled runs build them (the test above would pass on the decoder alone).
    info = info_of(relation((20, 25, 1184)))
    assert info.plan is not None
    kinds = ((b"",) * 6, (b"U",) + (b"",) * 5, (b"D",) + (b"",) * 5, (b"F",) + (b"",) * 6)
    relid = struct.pack("!I", 16_401)
    update = b"U" + relid + b"N" + tuple_data(["7", "x", None])
    delete = b"D" + relid + b"K" + tuple_data(["7", None, None])
    # REPLICA IDENTITY FULL: the old row, then the new one, whose unchanged TOAST value is
    # the old row's.
    full = b"U" + relid + b"O" + tuple_data(["7", "o", None])
    full += b"N" + tuple_data(["7", m.UNCHANGED_TOAST, "2024-01-02 03:04:05+00"])
    made, total, order, leftover = one_relation_runs(
        info.plan, iter([(2, delete), (3, full)]), 1, update, kinds
    )
    key = b'{"c0_bigint":7}'
    # After the row: the lsn twice, total and per-table order (empty pieces between).
    assert made == [
        ("t", key, b'U{"c0_bigint":7,"c1_text":"x","c2_timestamp with time zone":null}1111', None),
        ("t", key, b"D" + key + b"2222", None),
        ("t", key, None, None),
        (
            "t",
            key,
            b'F{"c0_bigint":7,"c1_text":"o","c2_timestamp with time zone":null}'
            b'{"c0_bigint":7,"c1_text":"o","c2_timestamp with time zone":"2024-01-02T03:04:05Z"}'
            b"3333",
            None,
        ),
    ]
    assert (total, order, leftover) == (3, 3, None)
    # The slots pick each number from the record's (lsn, total, order) and the run's own.
    slots = bytes((3, 0, 4, 3, 2))
    numbered = ((b"<",) + (b"|",) * 6,) * 3 + ((b"<",) + (b"|",) * 7,)
    made, *_ = one_relation_runs(info.plan, iter(()), 5, update, numbered, 6, (70, 80), slots)
    row = b'{"c0_bigint":7,"c1_text":"x","c2_timestamp with time zone":null}'
    assert made == [("t", key, b"<" + row + b"|70|5|80|70|1|", None)]
    for wrong in (bytes((5,)), bytes(17)):
        with pytest.raises((ValueError, TypeError)):
            one_relation_runs(info.plan, iter(()), 5, update, numbered, 6, (70, 80), wrong)


def test_runs_go_on_across_relations_and_stop_where_no_current_plan_reads() -> None:
    # One call builds a transaction's runs one after the other, each relation's records
    # numbered in its own topic, and stops at a relation without a plan, or whose plan is
    # not the catalogue's version any more (a Relation message changed it): the caller's.
    plan = info_of(relation((20, 25))).plan
    assert plan is not None
    kinds = (SIX, SIX, SIX, (b"",) * 7)
    a, b, c = (struct.pack("!I", oid) for oid in (1, 2, 3))

    def insert(relid: bytes, i: int) -> bytes:
        return b"I" + relid + b"N" + tuple_data([str(i), "x"])

    va, vb, vc = object(), object(), object()
    plans = {1: (va, plan, kinds, "ta"), 2: (vb, plan, kinds, "tb"), 3: (vc, plan, kinds, "tc")}
    changes = [(2, insert(b, 2)), (3, insert(a, 3)), (4, insert(c, 4)), (5, insert(a, 5))]
    per_table = {"ta": 7}
    relations: dict[int, object] = {1: va, 2: vb, 3: object()}  # relation 3 changed since
    made, total, leftover = _rowjson.runs(
        iter(changes),
        1,
        insert(a, 1),
        1,
        plans,
        relations,
        per_table,
        10,
        None,
        1 << 30,
        100,
        (),
        LSN_TWICE_AND_ORDERS,
        True,
    )
    # After each row (empty pieces): its lsn twice, its total order and its topic's order.
    assert [(t, v.rsplit(b"}", 1)[1]) for t, _, v, _ in made] == [
        ("ta", b"11118"),
        ("tb", b"22121"),
        ("ta", b"33139"),
    ]
    assert (total, per_table, leftover) == (13, {"ta": 9, "tb": 1}, changes[2])
    # A relation the plans do not name: nothing built, the caller's own change.
    made, total, leftover = _rowjson.runs(
        iter(changes),
        1,
        insert(b"\0\0\0\x09", 1),
        1,
        plans,
        relations,
        {},
        0,
        None,
        1 << 30,
        100,
        (),
        LSN_TWICE_AND_ORDERS,
        True,
    )
    assert (made, total, leftover) == ([], 0, None)
    with pytest.raises(TypeError, match="a plan is"):
        _rowjson.runs(
            iter(()),
            1,
            insert(a, 1),
            1,
            {1: (va, plan, (SIX,), "ta")},
            relations,
            {},
            0,
            None,
            1 << 30,
            100,
            (),
            LSN_TWICE_AND_ORDERS,
            True,
        )


@pytest.mark.parametrize("value_format", FORMATS)
def test_changes_alternating_between_tables_are_all_read_in_place(
    monkeypatch: pytest.MonkeyPatch, value_format: str
) -> None:
    # An OLTP transaction touches a row of each of several tables: each run is one change
    # long, and the next run starts where the last stopped, without the decoder.
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_456_789)
    columns = relation((20, 25, 1184)).columns
    accounts = m.Relation(None, 16_401, "public", "accounts", "d", columns)
    history = m.Relation(None, 16_402, "public", "history", "d", columns)
    changes: list[tuple[int, m.Message]] = [(0x100, accounts), (0x101, history)]
    for i in range(6):
        row: list[m.TupleValue] = [str(i), f"v{i}", "2024-01-02 03:04:05+00"]
        changes += [
            (0x110 + 3 * i, m.Update(None, accounts.oid, None, False, row)),
            (0x111 + 3 * i, m.Insert(None, history.oid, row)),
            (0x112 + 3 * i, m.Delete(None, accounts.oid, [str(i), None, None], True)),
        ]
    decoded: list[bytes] = []
    decoder = PgOutputDecoder()

    def decode(payload: bytes) -> m.Message:
        decoded.append(payload)
        return decoder.decode(payload, False)

    builder = builder_of(value_format)
    given: list[tuple[int, m.Message | bytes]] = [(lsn, encode(msg)) for lsn, msg in changes]
    compiled = list(
        builder.transaction(
            700, 0x200, 785_000_000_123_456, iter(given), None, Undecoded(False, decode)
        )
    )
    assert compiled == transaction_records(value_format, changes, False, False)[0]
    assert decoded == [encode(accounts), encode(history)]


# json and jsonb texts as the server prints them: a JSON null (json keeps its blanks) is
# named in the record's json_nulls, which the Python path writes (the plan leaves the row).
_JSON_TEXTS = ['{"a": [1, 2.50, null], "b": "é\\n"}', "null", " null\n", "[]", '"s"', "1e400"]


@pytest.mark.parametrize("streamed", [False, True])
def test_json_columns_read_in_place_equal_the_python_path(
    monkeypatch: pytest.MonkeyPatch, streamed: bool
) -> None:
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    oids = (20, 3802, 114, 25)
    columns = relation(oids).columns
    rel = m.Relation(700 if streamed else None, 16_401, "public", "docs", "d", columns)
    changes: list[tuple[int, m.Message]] = [(0x100, rel)]
    for i, text in enumerate([*_JSON_TEXTS, None]):
        row: list[m.TupleValue] = [str(i), text, text, "x"]
        changes += [
            (0x110 + 3 * i, m.Insert(rel.xid, rel.oid, row)),
            (0x111 + 3 * i, m.Update(rel.xid, rel.oid, None, False, row)),
            (0x112 + 3 * i, m.Delete(rel.xid, rel.oid, [str(i), None, None, None], True)),
        ]
    compiled, builder = transaction_records("slotbridge", changes, streamed, True)
    assert builder.catalog.by_oid[rel.oid].plan is not None
    python = builder_of("slotbridge")
    python.catalog.apply(rel).plan = None
    given: list[tuple[int, m.Message | bytes]] = list(changes)
    assert compiled == list(python.transaction(700, 0x200, 785_000_000_123_456, iter(given)))
    nulls = [json.loads(v)["json_nulls"] for _, _, v, _ in compiled if v and b"json_nulls" in v]
    assert nulls == [{"after": ["c1_jsonb", "c2_json"]}] * 4


@pytest.mark.usefixtures("fixed_clock")
@pytest.mark.parametrize("value_format", FORMATS)
@pytest.mark.parametrize("streamed", [False, True])
def test_a_key_change_under_replica_identity_full_forgets_the_old_key(
    streamed: bool, value_format: str
) -> None:
    # The whole old row comes with every update under REPLICA IDENTITY FULL, the key changed
    # or not: a changed key must still make the old key's delete and tombstone, or a
    # compacted topic (and a consumer's current state) keeps the old row for ever.
    xid = 700 if streamed else None
    full = m.Relation(xid, 16_402, "public", "full", "f", relation((20, 25)).columns)
    changes: list[tuple[int, m.Message]] = [
        (0x100, full),
        (0x101, m.Update(xid, full.oid, ["1", "a"], False, ["2", "a"])),
        (0x102, m.Update(xid, full.oid, ["2", "a"], False, ["2", "b"])),
    ]
    compiled, _ = transaction_records(value_format, changes, streamed, True)
    assert compiled == transaction_records(value_format, changes, streamed, False)[0]
    rows = [
        (json.loads(k)["payload"] if value_format == "debezium" else json.loads(k), v is None)
        for t, k, v, _ in compiled
        if t == "app.public.full" and k is not None
    ]
    # The key change: the old key's delete and tombstone, the new key's record; then an
    # update that keeps its key: one record.
    assert rows == [
        ({"c0_bigint": 1}, False),
        ({"c0_bigint": 1}, True),
        ({"c0_bigint": 2}, False),
        ({"c0_bigint": 2}, False),
    ]


# RFC 4231's HMAC-SHA-256 cases 1, 2, 4 and 6 (a key longer than a block): key, data, MAC.
RFC_4231 = [
    (b"\x0b" * 20, b"Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"),
    (
        b"Jefe",
        b"what do ya want for nothing?",
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
    ),
    (
        bytes(range(1, 26)),
        b"\xcd" * 50,
        "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
    ),
    (
        b"\xaa" * 131,
        b"Test Using Larger Than Block-Size Key - Hash Key First",
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
    ),
]


@pytest.fixture(params=[False, True], ids=["portable", "sha-extensions"])
def sha256_path(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each SHA-256 of the compiled builder in turn: the portable code, and the CPU's SHA
    extensions (skipped where the CPU has none); the default is put back afterwards."""
    if not _rowjson.accelerate_sha256(request.param) and request.param:
        pytest.skip("this CPU has no SHA extensions")
    yield
    _rowjson.accelerate_sha256(True)


@pytest.mark.usefixtures("sha256_path")
@pytest.mark.parametrize("encoding", ["hex", "base64"])
def test_the_compiled_hash_transform_writes_what_python_hmac_does(
    encoding: Literal["hex", "base64"],
) -> None:
    # The compiled builder's own HMAC-SHA-256 (_hmac.h) against the RFC's vectors and, over
    # texts of every length around the block boundaries and beyond, against the transform
    # the Python path runs (OpenSSL's HMAC).
    rule = HashRule(tables=["public.t"], columns=["c"], transform="hash", encoding=encoding)

    def plans(key: bytes) -> tuple[RowPlan, Callable[[str], Any]]:
        mask = column_mask(rule, key)
        assert mask.compiled is not None
        plan = RowPlan(
            (b'"c":',), mask.compiled, (), (mask.convert,), orjson.dumps, b"", b"", False, None, key
        )
        return plan, mask.convert

    for key, data, mac in RFC_4231:
        plan, convert = plans(key)
        digest = bytes.fromhex(mac)
        expected = mac if encoding == "hex" else base64.b64encode(digest).decode()
        text = data.decode("latin-1")  # the RFC's bytes as UTF-8 text's bytes where ASCII
        if data.isascii():
            assert built(plan, [text]) == (b'{"c":"%s"}' % expected.encode(), None)
            assert convert(text) == expected
    rng = random.Random(4231)
    alphabet = 'aZ09 .@-_é中😀\n"'
    for key_length in (16, 32, 64, 65, 200):
        plan, convert = plans(bytes(rng.randrange(256) for _ in range(key_length)))
        for length in [*range(0, 130), 1000, 5000]:
            text = "".join(rng.choice(alphabet) for _ in range(length))
            assert built(plan, [text])[0] == orjson.dumps({"c": convert(text)})
    # Without a key the plan calls the transform itself, which writes the same.
    keyless = RowPlan((b'"c":',), b"h", (), (plans(b"k" * 32)[1],), orjson.dumps)
    assert built(keyless, ["x"])[0] == orjson.dumps({"c": plans(b"k" * 32)[1]("x")})
