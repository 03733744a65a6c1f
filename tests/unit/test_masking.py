"""Column transforms: each transform's output, and records of every change kind in both
formats, compiled and decoded, holding only the transformed values."""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from pathlib import Path

import orjson
import pytest
from pydantic import TypeAdapter

from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder
from services.bridge.records.catalog import RelationCatalog, known_versions
from services.bridge.records.debezium import DebeziumEventBuilder, context_headers_of
from services.bridge.records.default import DefaultEventBuilder
from services.bridge.records.events import EventBuilder, Record, Undecoded
from services.bridge.records.masking import (
    Masking,
    MaskingRefused,
    PublishedColumn,
    Rule,
    TransformRule,
    column_mask,
)
from services.bridge.settings import MASKING_KEY_ENV, BridgeSettings
from services.common.settings import SettingsError, load_settings
from tests.unit.pgoutput_builder import encode

KEY = b"0123456789abcdef0123456789abcdef"
_RULE: TypeAdapter[Rule] = TypeAdapter(TransformRule)


def rule(**fields: object) -> Rule:
    return _RULE.validate_python({"tables": ["public.*"], **fields})


def test_each_transform_writes_what_its_settings_say() -> None:
    # RFC 4231 test case 2: HMAC-SHA-256 with the key "Jefe".
    hashed = column_mask(rule(columns=["c"], transform="hash"), b"Jefe").convert
    assert hashed("what do ya want for nothing?") == (
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    )
    assert hashed("what do ya want for nothing?") == hashed("what do ya want for nothing?")
    b64 = column_mask(rule(columns=["c"], transform="hash", encoding="base64"), b"Jefe").convert
    digest = base64.b64decode(str(b64("what do ya want for nothing?")))
    assert digest.hex() == "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    assert column_mask(rule(columns=["c"], transform="redact"), None).convert("x") is None
    redacted = column_mask(rule(columns=["c"], transform="redact", replacement="***"), None)
    assert redacted.convert("secret") == "***"
    assert not redacted.nulls
    truncated = column_mask(rule(columns=["c"], transform="truncate", length=3), None)
    assert [truncated.convert(t) for t in ("abcdef", "ab", "")] == ["abc", "ab", ""]
    masked = column_mask(rule(columns=["c"], transform="mask", keep_last=4), None).convert
    assert [masked(t) for t in ("4111111111111111", "123", "")] == ["************1111", "123", ""]
    hashes = column_mask(rule(columns=["c"], transform="mask", keep_last=0, mask_char="#"), None)
    assert hashes.convert("abc") == "###"
    assert column_mask(rule(columns=["c"], transform="drop"), None).drops
    with pytest.raises(MaskingRefused, match="hash transform needs a key"):
        column_mask(rule(columns=["c"], transform="hash"), None)


# A table whose every change kind the tests build: an int8 key, then email (hashed),
# notes (dropped), card (masked), a timestamp with time zone (as it is) and a jsonb
# document (redacted).
COLUMNS = (
    m.Column("id", 20, -1, True),
    m.Column("email", 25, -1, False),
    m.Column("notes", 25, -1, False),
    m.Column("card", 1043, -1, False),
    m.Column("at", 1184, -1, False),
    m.Column("doc", 3802, -1, False),
)
RULES = [
    rule(columns=["email"], transform="hash"),
    rule(columns=["notes"], transform="drop"),
    rule(columns=["card"], transform="mask", keep_last=4),
    rule(columns=["doc"], transform="redact"),
]
PII = ("jane@example.com", "private note", "4111111111111111", '{"ssn": "078-05-1120"}')


def masking() -> Masking:
    return Masking(RULES, ["email", "card*"], KEY)


def builder_of(value_format: str) -> EventBuilder:
    catalog = RelationCatalog("app", lambda oid: None, masking=masking())
    if value_format == "slotbridge":
        return DefaultEventBuilder(catalog, "app", "shop", 1 << 20)
    builder = DebeziumEventBuilder(catalog, "app", "shop", 1 << 20, None)
    builder.headers = context_headers_of("app", "0190a3b4-0000-7000-8000-000000000000")
    return builder


def changes(xid: int | None) -> list[tuple[int, m.Message]]:
    """Every change kind on a keyed table (16_401) and one under REPLICA IDENTITY FULL
    (16_402), each row holding the PII values; unchanged TOAST values of both."""
    plain = m.Relation(xid, 16_401, "public", "people", "d", COLUMNS)
    full = m.Relation(xid, 16_402, "public", "people_full", "f", COLUMNS)
    toast = m.UNCHANGED_TOAST
    out: list[tuple[int, m.Message]] = [(0x100, plain), (0x101, full)]

    def row(i: int) -> list[m.TupleValue]:
        return [str(i), *PII[:3], "2024-01-02 03:04:05+00", PII[3]]

    for i in range(6):
        key: list[m.TupleValue] = [str(i), None, None, None, None, None]
        out += [
            (0x110 + i, m.Insert(xid, plain.oid, row(i))),
            (0x120 + i, m.Update(xid, plain.oid, None, False, row(i))),
            (0x130 + i, m.Delete(xid, plain.oid, key, True)),
            (0x140 + i, m.Insert(xid, full.oid, row(i))),
            (0x150 + i, m.Update(xid, full.oid, row(i), False, row(i))),
            (0x160 + i, m.Delete(xid, full.oid, row(i), False)),
        ]
    out += [
        (0x170, m.Update(xid, plain.oid, None, False, ["1", toast, toast, toast, None, toast])),
        (0x171, m.Update(xid, full.oid, row(2), False, ["2", toast, toast, toast, None, toast])),
        # A key change: the delete of the old key, its tombstone, the insert.
        (0x172, m.Update(xid, plain.oid, ["1", None, None, None, None, None], True, row(9))),
    ]
    return out


def records(
    value_format: str, streamed: bool, undecoded: bool
) -> tuple[list[Record], EventBuilder]:
    builder = builder_of(value_format)
    decoder = PgOutputDecoder()
    given: list[tuple[int, m.Message | bytes]] = [
        (lsn, encode(msg) if undecoded else msg) for lsn, msg in changes(700 if streamed else None)
    ]
    how = Undecoded(streamed, lambda p: decoder.decode(p, streamed))
    made = builder.transaction(
        700, 0x200, 785_000_000_123_456, iter(given), undecoded=how if undecoded else None
    )
    return list(made), builder


def every_byte(made: Sequence[Record]) -> bytes:
    return b"\n".join(
        b"".join(
            [
                topic.encode(),
                key or b"",
                value or b"",
                *(str(h).encode() for h in headers or ()),
            ]
        )
        for topic, key, value, headers in made
    )


@pytest.mark.usefixtures("fixed_clock")
@pytest.mark.parametrize("value_format", ["slotbridge", "debezium"])
@pytest.mark.parametrize("streamed", [False, True])
def test_records_hold_only_the_transformed_values(value_format: str, streamed: bool) -> None:
    compiled, builder = records(value_format, streamed, True)
    # A masked column keeps its table on the compiled path, which writes what the
    # decoded path writes.
    assert all(info.plan is not None for info in builder.catalog.by_oid.values())
    assert compiled == records(value_format, streamed, False)[0]
    written = every_byte(compiled)
    for raw in (*PII, "078-05-1120", "private"):
        assert raw.encode() not in written, raw
    hashed = column_mask(RULES[0], KEY).convert(PII[0])
    assert isinstance(hashed, str) and hashed.encode() in written
    assert b"************1111" in written
    assert b'"notes"' not in written  # dropped: not in rows, nor in the Connect schemas


@pytest.mark.parametrize("value_format", ["slotbridge", "debezium"])
def test_a_hashed_key_column_keys_the_records_by_its_hash(value_format: str) -> None:
    builder = builder_of(value_format)
    builder.catalog.masking = Masking([rule(columns=["email"], transform="hash")], [], KEY)
    rel = m.Relation(None, 16_403, "public", "by_email", "d", (m.Column("email", 25, -1, True),))
    made = list(
        builder.transaction(
            701, 0x300, 0, iter([(0x301, rel), (0x302, m.Insert(None, rel.oid, [PII[0]]))])
        )
    )
    (change,) = [r for r in made if r[0] == "app.public.by_email"]
    hashed = column_mask(RULES[0], KEY).convert(PII[0])
    assert change[1] is not None
    key = orjson.loads(change[1])
    assert (key if value_format == "slotbridge" else key["payload"]) == {"email": hashed}
    assert PII[0].encode() not in every_byte(made)


def test_snapshot_rows_are_transformed() -> None:
    builder = builder_of("slotbridge")
    info = builder.catalog.apply(m.Relation(None, 16_401, "public", "people", "d", COLUMNS))
    rows = [["7", *PII[:3], None, PII[3]]]
    made = list(builder.snapshot_rows(info, rows, 0x500, 0, 0x4FF))
    assert info.plan is not None
    written = every_byte(made)
    assert not any(raw.encode() in written for raw in PII)
    row = orjson.loads(made[-1][2] or b"")["after"]
    assert row == {
        "id": 7,
        "email": column_mask(RULES[0], KEY).convert(PII[0]),
        "card": "************1111",
        "at": None,
        "doc": None,
    }


def test_the_schema_record_types_the_output_and_names_the_transform() -> None:
    catalog = RelationCatalog("app", lambda oid: None, masking=masking())
    rel = m.Relation(None, 16_401, "public", "people", "d", COLUMNS)
    record = catalog.apply(rel).schema_record
    columns = {c["name"]: c for c in record["columns"]}
    assert list(columns) == ["id", "email", "card", "at", "doc"]
    assert columns["email"]["type"] == "text" and columns["email"]["type_oid"] == 25
    assert columns["email"]["transform"]["kind"] == "hash"
    assert columns["doc"]["transform"]["source_type"] == "jsonb"
    assert columns["doc"]["nullable"] is True
    assert "transform" not in columns["at"]
    # A restart that reads the record back reuses its version; a new hash key is a new
    # version (consumers must not join old hashes with new ones unawares).
    again = RelationCatalog(
        "app", lambda oid: None, known=known_versions([record]), masking=masking()
    )
    assert again.apply(rel).version == 1
    rotated = RelationCatalog(
        "app",
        lambda oid: None,
        known=known_versions([record]),
        masking=Masking(RULES, [], b"another key of 32 bytes........."),
    )
    assert rotated.apply(rel).version == 2


def published(*columns: tuple[str, str, bool]) -> list[PublishedColumn]:
    return [PublishedColumn(*c) for c in columns]


@pytest.mark.parametrize(
    ("rules", "pii", "columns", "refusal"),
    [
        ([], ["email"], [("email", "text", False)], "matches pii_columns but no transform"),
        (
            [rule(columns=["n"], transform="truncate", length=2)],
            [],
            [("n", "integer", False)],
            "truncate does not fit column public.t.n of type integer",
        ),
        (
            [rule(columns=["id"], transform="redact")],
            [],
            [("id", "bigint", True)],
            "cannot apply to key column public.t.id",
        ),
        (
            [rule(columns=["e*"], transform="redact"), rule(columns=["email"], transform="drop")],
            [],
            [("email", "text", False)],
            "matched by transforms 1 and 2",
        ),
    ],
)
def test_settings_that_do_not_fit_a_table_are_refused_in_one_line(
    rules: list[Rule], pii: list[str], columns: list[tuple[str, str, bool]], refusal: str
) -> None:
    found = Masking(rules, pii, KEY).refusal("public", "t", published(*columns))
    assert found is not None and refusal in found and "\n" not in found


def test_a_rule_matching_no_published_column_is_refused() -> None:
    tables = {("public", "t"): published(("email", "text", False))}
    assert Masking([rule(columns=["email"], transform="drop")], [], None).unmatched(tables) is None
    typo = Masking([rule(columns=["emial"], transform="drop")], [], None).unmatched(tables)
    assert typo == (
        "transform 1 (drop of emial) matches no published column emial in public.*; "
        "fix its tables or columns"
    )
    # A name without a pattern must be there; a pattern must match something.
    some = Masking([rule(columns=["email", "emial"], transform="drop")], [], None)
    assert "no published column emial" in str(some.unmatched(tables))
    assert Masking([rule(columns=["e*"], transform="drop")], [], None).unmatched(tables) is None
    assert "no published column in" in str(
        Masking([rule(columns=["x*"], transform="drop")], [], None).unmatched(tables)
    )
    table = _RULE.validate_python(
        {"tables": ["public.tt"], "columns": ["email"], "transform": "drop"}
    )
    assert Masking([table], [], None).unmatched(tables) == (
        "transform 1 (drop of email) names public.tt, which the publication does not publish"
    )


def test_a_pii_column_added_mid_stream_stops_the_bridge_before_its_records() -> None:
    catalog = RelationCatalog("app", lambda oid: None, masking=masking())
    catalog.apply(m.Relation(None, 16_401, "public", "people", "d", COLUMNS))
    added = (*COLUMNS, m.Column("card_2", 25, -1, False))
    with pytest.raises(MaskingRefused, match=re.escape("public.people.card_2 matches pii_columns")):
        catalog.apply(m.Relation(None, 16_401, "public", "people", "d", added))


def settings_file(tmp_path: Path, extra: str) -> Path:
    path = tmp_path / "bridge.yaml"
    path.write_text(
        "source_dsn: host=localhost dbname=app\nkafka_bootstrap: localhost:9092\n"
        "transforms:\n  - {tables: [public.people], columns: [email], transform: hash}\n" + extra
    )
    return path


def test_the_hash_key_comes_from_the_environment_or_a_file_and_never_the_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(MASKING_KEY_ENV, raising=False)
    # Commands that build no record (status) load the settings without the key.
    keyless = load_settings(BridgeSettings, settings_file(tmp_path, ""))
    with pytest.raises(MaskingRefused, match="a hash transform needs a key: set SLOTBRIDGE_"):
        keyless.masking()
    with pytest.raises(SettingsError, match="masking_key: unknown setting"):
        load_settings(BridgeSettings, settings_file(tmp_path, "masking_key: x\n"))
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY + b"\n")
    from_file = settings_file(tmp_path, f"masking_key_file: {key_file}\n")
    assert load_settings(BridgeSettings, from_file).masking_key() == KEY
    missing = settings_file(tmp_path, f"masking_key_file: {tmp_path / 'none'}\n")
    with pytest.raises(MaskingRefused, match="cannot read masking_key_file"):
        load_settings(BridgeSettings, missing).masking()
    monkeypatch.setenv(MASKING_KEY_ENV, "short")
    with pytest.raises(MaskingRefused, match="the masking key has 5 bytes; use at least 16"):
        load_settings(BridgeSettings, settings_file(tmp_path, "")).masking()
    monkeypatch.setenv(MASKING_KEY_ENV, "k" * 40)
    assert load_settings(BridgeSettings, settings_file(tmp_path, "")).masking_key() == b"k" * 40
