from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import TypeVar

import orjson
import pytest
from pgoutput_builder import encode, tuple_data

from services.bridge.decode import messages as m
from services.bridge.decode.decoder import DecodeError, PgOutputDecoder
from services.bridge.records.values import converter_for

LSN = 0x1_6B37_4D48
TS = 785_000_000_123_456  # ~2024-11 in microseconds since 2000-01-01
GID = "gid-\u00e9t\u00e9"  # non-ASCII survives

COLUMNS = (
    m.Column("id", 20, -1, True),
    m.Column("name", 1043, 104, False),
    m.Column("body", 25, -1, False),
)
ROW: m.TupleData = ["42", "h\u00e9llo, w\u00f6rld", None]
KEY: m.TupleData = ["42", None, None]

# Messages the same whether or not they sit inside a streamed block.
CONTROL: list[m.Message] = [
    m.Begin(LSN, TS, 734),
    m.Begin(LSN, -TS, 734),  # commit before 2000-01-01: the timestamp is signed
    m.Commit(0, LSN, LSN + 48, TS),
    m.Origin(LSN - 100, "pg_16400"),
    m.StreamStop(),
    m.StreamCommit(734, 0, LSN, LSN + 48, TS),
    m.BeginPrepare(LSN, LSN + 48, TS, 734, GID),
    m.Prepare(0, LSN, LSN + 48, TS, 734, GID),
    m.CommitPrepared(0, LSN + 96, LSN + 144, TS + 1, 734, GID),
    m.RollbackPrepared(0, LSN + 48, LSN + 144, TS, TS + 1, 734, GID),
    m.StreamPrepare(0, LSN, LSN + 48, TS, 734, GID),
]


def data_messages(xid: int | None) -> list[m.Message]:
    """Data messages as they look outside (xid None) or inside a streamed block."""
    return [
        m.Relation(xid, 16_401, "public", "accounts", "d", COLUMNS),
        m.Relation(xid, 16_402, "sales", "t\u00e4ble", "f", ()),
        m.TypeMsg(xid, 16_500, "public", "mood"),
        m.TypeMsg(xid, 16_501, "", "pg_catalog_type"),  # pg_catalog is sent as ""
        m.Insert(xid, 16_401, ROW),
        m.Insert(xid, 16_401, []),
        m.Update(xid, 16_401, None, False, ROW),
        m.Update(xid, 16_401, KEY, True, ["43", "x", m.UNCHANGED_TOAST]),
        m.Update(xid, 16_401, ROW, False, ["42", "", m.UNCHANGED_TOAST]),
        m.Delete(xid, 16_401, KEY, True),
        m.Delete(xid, 16_401, ROW, False),
        m.Truncate(xid, 0, (16_401,)),
        m.Truncate(xid, 3, (16_401, 16_402, 4_294_967_295)),
        m.LogicalMessage(xid, True, LSN, "app", b"\x00binary\xff"),
        m.LogicalMessage(xid, False, LSN, "", b""),
    ]


@pytest.mark.parametrize("msg", CONTROL + data_messages(None), ids=repr)
def test_round_trip_outside_stream(msg: m.Message) -> None:
    assert PgOutputDecoder(4).decode(encode(msg)) == msg


@pytest.mark.parametrize("msg", data_messages(4_000_000_000), ids=repr)
def test_data_messages_inside_stream_carry_xid(msg: m.Message) -> None:
    decoder = PgOutputDecoder(2)
    decoder.decode(encode(m.StreamStart(4_000_000_000, True)))
    assert decoder.decode(encode(msg)) == msg


def test_stream_start_and_stop_drive_the_xid_prefix() -> None:
    decoder = PgOutputDecoder(4, parallel_abort=True)
    outside = m.Insert(None, 16_401, ROW)
    inside = m.Insert(735, 16_401, ROW)
    assert decoder.decode(encode(outside)) == outside
    assert decoder.decode(encode(m.StreamStart(734, True))) == m.StreamStart(734, True)
    assert decoder.in_stream
    assert decoder.decode(encode(inside)) == inside
    assert decoder.decode(encode(m.StreamStop())) == m.StreamStop()
    assert not decoder.in_stream
    assert decoder.decode(encode(m.StreamStart(734, False))) == m.StreamStart(734, False)
    assert decoder.decode(encode(m.StreamStop())) == m.StreamStop()
    assert decoder.decode(encode(outside)) == outside


def test_explicit_streamed_flag_overrides_and_leaves_state_alone() -> None:
    decoder = PgOutputDecoder(4)
    inside = m.Delete(9, 16_401, KEY, True)
    assert decoder.decode(encode(inside), streamed=True) == inside
    assert not decoder.in_stream
    decoder.decode(encode(m.StreamStart(9, True)))
    outside = m.Delete(None, 16_401, KEY, True)
    assert decoder.decode(encode(outside), streamed=False) == outside
    assert decoder.in_stream


def test_hand_built_bytes() -> None:
    """Bytes written from the manual, not from the test encoder."""
    decoder = PgOutputDecoder(4, parallel_abort=True)
    begin = bytes.fromhex("42000000016b374d480002c9f0e2a3e240000002de")
    assert decoder.decode(begin) == m.Begin(0x16B374D48, 0x0002C9F0E2A3E240, 734)
    insert = b"I\x00\x00\x40\x11N\x00\x03t\x00\x00\x00\x0242nu"
    assert decoder.decode(insert) == m.Insert(None, 0x4011, ["42", None, m.UNCHANGED_TOAST])
    abort = b"A" + bytes.fromhex("000002de000002df00000000000001000000000000000200")
    assert decoder.decode(abort) == m.StreamAbort(734, 735, 0x100, 0x200)
    relation = (
        b"R\x00\x00\x40\x11public\x00t\x00d\x00\x01\x01id\x00\x00\x00\x00\x17\xff\xff\xff\xff"
    )
    assert decoder.decode(relation) == m.Relation(
        None, 0x4011, "public", "t", "d", (m.Column("id", 23, -1, True),)
    )


@pytest.mark.parametrize(
    ("proto", "parallel", "expected"),
    [
        (2, False, m.StreamAbort(734, 735, None, None)),
        (3, True, m.StreamAbort(734, 735, None, None)),  # parallel needs protocol 4
        (4, False, m.StreamAbort(734, 735, None, None)),
        (4, True, m.StreamAbort(734, 735, LSN, TS)),
    ],
)
def test_stream_abort_fields_depend_on_protocol_and_parallel(
    proto: int, parallel: bool, expected: m.StreamAbort
) -> None:
    decoder = PgOutputDecoder(proto, parallel_abort=parallel)
    assert decoder.decode(encode(expected)) == expected
    # The other layout is refused, not misread.
    other = (
        m.StreamAbort(734, 735, None, None)
        if expected.abort_lsn
        else m.StreamAbort(734, 735, LSN, TS)
    )
    with pytest.raises(DecodeError, match="Stream Abort"):
        decoder.decode(encode(other))


@pytest.mark.parametrize(
    ("proto", "msg"),
    [
        (1, m.StreamStart(1, True)),
        (1, m.StreamStop()),
        (1, m.StreamCommit(1, 0, LSN, LSN, TS)),
        (1, m.StreamAbort(1, 1, None, None)),
        (2, m.BeginPrepare(LSN, LSN, TS, 1, "g")),
        (2, m.Prepare(0, LSN, LSN, TS, 1, "g")),
        (2, m.CommitPrepared(0, LSN, LSN, TS, 1, "g")),
        (2, m.RollbackPrepared(0, LSN, LSN, TS, TS, 1, "g")),
        (2, m.StreamPrepare(0, LSN, LSN, TS, 1, "g")),
    ],
    ids=repr,
)
def test_messages_newer_than_the_protocol_are_refused(proto: int, msg: m.Message) -> None:
    with pytest.raises(DecodeError, match=f"not part of pgoutput protocol version {proto}"):
        PgOutputDecoder(proto).decode(encode(msg))


@pytest.mark.parametrize("proto", [1, 2, 3, 4])
def test_version_1_messages_decode_in_every_version(proto: int) -> None:
    decoder = PgOutputDecoder(proto)
    for msg in [*CONTROL[:4], *data_messages(None)]:
        assert decoder.decode(encode(msg)) == msg


def test_memoryview_and_bytearray_payloads() -> None:
    msg = m.Update(None, 16_401, KEY, True, ROW)
    raw = encode(msg)
    decoder = PgOutputDecoder()
    assert decoder.decode(memoryview(b"xx" + raw)[2:]) == msg
    assert decoder.decode(bytearray(raw)) == msg


def test_unicode_text_value() -> None:
    value = "\u65e5\u672c\U0001f600 \u00fc"
    decoded = PgOutputDecoder().decode(encode(m.Insert(None, 1, [value, ""])))
    assert isinstance(decoded, m.Insert)
    assert decoded.new == [value, ""]


def test_binary_column_is_refused() -> None:
    payload = b"I\x00\x00\x00\x01N" + tuple_data(["1", b"\x00\x01"])
    with pytest.raises(DecodeError, match="binary column value at offset 14"):
        PgOutputDecoder().decode(payload)


def test_unknown_column_kind() -> None:
    payload = b"I\x00\x00\x00\x01N\x00\x01x"
    with pytest.raises(DecodeError, match=r"unknown column kind b'x' at offset 8"):
        PgOutputDecoder().decode(payload)


def test_unknown_message_type_names_byte_and_offset() -> None:
    with pytest.raises(DecodeError, match=r"unknown pgoutput message type b'Z' at offset 0"):
        PgOutputDecoder().decode(b"Z\x00\x00")
    with pytest.raises(DecodeError, match="empty"):
        PgOutputDecoder().decode(b"")


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(DecodeError, ValueError)


def test_bad_markers() -> None:
    decoder = PgOutputDecoder()
    with pytest.raises(DecodeError, match=r"expected 'N' \(new tuple\) at offset 5"):
        decoder.decode(b"I\x00\x00\x00\x01X\x00\x00")
    with pytest.raises(DecodeError, match=r"expected 'N' \(new tuple\) at offset 5"):
        decoder.decode(b"U\x00\x00\x00\x01X\x00\x00")
    with pytest.raises(DecodeError, match=r"expected 'K' or 'O' \(old tuple\) at offset 5"):
        decoder.decode(b"D\x00\x00\x00\x01N\x00\x00")
    relation = encode(m.Relation(None, 1, "s", "t", "d", ()))
    with pytest.raises(DecodeError, match="unknown replica identity 'z'"):
        decoder.decode(relation.replace(b"\x00d\x00", b"\x00z\x00"))


def test_invalid_utf8_is_a_decode_error() -> None:
    payload = b"I\x00\x00\x00\x01N\x00\x01t\x00\x00\x00\x02\xc3\x28"
    with pytest.raises(DecodeError, match="malformed Insert message"):
        PgOutputDecoder().decode(payload)


def test_trailing_bytes_are_refused() -> None:
    for msg in [m.Begin(LSN, TS, 1), m.Insert(None, 1, ROW), m.StreamStop()]:
        with pytest.raises(DecodeError, match="ends at offset"):
            PgOutputDecoder().decode(encode(msg) + b"\x00")


@pytest.mark.parametrize(
    "msg",
    CONTROL + data_messages(None) + [m.StreamStart(1, True), m.StreamAbort(1, 2, LSN, TS)],
    ids=repr,
)
def test_every_truncation_is_a_decode_error(msg: m.Message) -> None:
    payload = encode(msg)
    for cut in range(len(payload)):
        decoder = PgOutputDecoder(4, parallel_abort=True)
        with pytest.raises(DecodeError):
            decoder.decode(payload[:cut])
        assert not decoder.in_stream  # a refused Stream Start does not open a block


def test_protocol_version_is_checked() -> None:
    with pytest.raises(ValueError, match="not 1-4"):
        PgOutputDecoder(5)


RECORDING = json.loads((Path(__file__).parent / "data" / "pgoutput_pg17.json").read_text())
M = TypeVar("M", bound=m.Message)


def decode_recording(name: str) -> list[m.Message]:
    decoder = PgOutputDecoder(4, parallel_abort=True)
    return [decoder.decode(bytes.fromhex(payload)) for payload in RECORDING[name]]


def of(kind: type[M], msg: m.Message) -> M:
    assert isinstance(msg, kind), msg
    return msg


def test_recorded_regular_stream() -> None:
    """PostgreSQL 17's own bytes (see data/record_pgoutput.py), typed by values.py."""
    msgs = decode_recording("regular")
    assert [type(x).__name__ for x in msgs] == [
        "Begin",
        "TypeMsg",
        "Relation",
        "Insert",
        "Commit",
        "Begin",
        "Insert",
        "Commit",
        "Begin",
        "Update",
        "Commit",
        "Begin",
        "Update",
        "Commit",
        "Begin",
        "Relation",
        "Insert",
        "Insert",
        "Commit",
        "Begin",
        "Update",
        "Commit",
        "Begin",
        "Delete",
        "Commit",
        "Begin",
        "Delete",
        "Commit",
        "Begin",
        "Relation",
        "Relation",
        "Truncate",
        "Commit",
        "Begin",
        "LogicalMessage",
        "Commit",
        "LogicalMessage",
        "Begin",
        "Origin",
        "Relation",
        "Insert",
        "Commit",
        "BeginPrepare",
        "Insert",
        "Prepare",
        "CommitPrepared",
        "BeginPrepare",
        "Insert",
        "Prepare",
        "RollbackPrepared",
    ]
    begin, commit = of(m.Begin, msgs[0]), of(m.Commit, msgs[4])
    assert (commit.commit_lsn, commit.commit_ts) == (begin.final_lsn, begin.commit_ts)
    mood = of(m.TypeMsg, msgs[1])
    assert (mood.xid, mood.namespace, mood.name) == (None, "public", "mood")
    rel, insert = of(m.Relation, msgs[2]), of(m.Insert, msgs[3])
    assert (rel.namespace, rel.name, rel.replica_identity) == ("public", "t", "d")
    assert [c.name for c in rel.columns if c.is_key] == ["id"]
    assert rel.columns[8].type_modifier == 14  # varchar(10): typmod is length + 4
    typed = {
        c.name: converter_for(c.type_oid)(v) if isinstance(v, str) else v
        for c, v in zip(rel.columns, insert.new, strict=True)
    }
    big = typed.pop("big")
    assert isinstance(big, str) and len(big) == 12_800
    # json and jsonb go into records as the text the server printed.
    assert (
        orjson.dumps([typed.pop("j"), typed.pop("jb")])
        == b'[ [1, "two"] ,{"a": "x", "b": [1, 2.5, null]}]'
    )
    assert typed == {
        "id": 1,
        "i2": -32768,
        "i4": 2147483647,
        "num": "-12.340",
        "f4": "NaN",
        "f8": "-Infinity",
        "b": True,
        "txt": 'h\u00e9llo "q" \\ ,{}',
        "vc": "NULL",
        "bp": "ab ",
        "u": "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "by": "AP8K",
        "d": "0044-03-15 BC",
        "tm": "23:59:59.999999",
        "ttz": "12:00:00+05:30",
        "ts": "infinity",
        "tstz": "2024-11-21T00:43:10.5Z",
        "iv": "P1Y2M3DT4H5M6.5S",
        "ia": [1, None, 3],
        "ta": ["plain", "with space", 'q"uote', "back\\slash", "NULL", None, ""],
        "m": "happy",
    }
    toast_update = of(m.Update, msgs[9])
    assert toast_update.old is None
    assert toast_update.new[7] == "changed" and toast_update.new[-1] is m.UNCHANGED_TOAST
    key_update = of(m.Update, msgs[12])
    assert key_update.old_is_key_only and key_update.old is not None
    assert (key_update.old[0], key_update.new[0]) == ("2", "3")
    full_t = of(m.Relation, msgs[15]).oid
    assert msgs[20] == m.Update(None, full_t, ["1", "one"], False, ["1", "uno"])
    assert msgs[23] == m.Delete(None, full_t, ["2", "two"], False)
    key_delete = of(m.Delete, msgs[26])
    assert key_delete.old_is_key_only and key_delete.old == ["3"] + [None] * 23
    bulk = of(m.Relation, msgs[30]).oid
    assert msgs[31] == m.Truncate(None, 3, (full_t, bulk))  # CASCADE | RESTART IDENTITY
    transactional, plain = of(m.LogicalMessage, msgs[34]), of(m.LogicalMessage, msgs[36])
    assert (transactional.transactional, transactional.content) == (True, b"transactional")
    assert (plain.transactional, plain.prefix, plain.content) == (False, "app", b"\x00\xff")
    assert msgs[38] == m.Origin(0xABCDEF, "upstream")
    begin_prepare, prepare = of(m.BeginPrepare, msgs[42]), of(m.Prepare, msgs[44])
    commit_prepared = of(m.CommitPrepared, msgs[45])
    assert begin_prepare.gid == prepare.gid == commit_prepared.gid == "gid-1"
    assert begin_prepare.prepare_lsn == prepare.prepare_lsn
    assert commit_prepared.xid == prepare.xid == begin_prepare.xid
    rollback = of(m.RollbackPrepared, msgs[49])
    assert rollback.gid == "gid-2"
    assert rollback.prepare_end_lsn == of(m.Prepare, msgs[48]).end_lsn
    assert rollback.rollback_ts > rollback.prepare_ts


def test_recorded_streamed_transactions() -> None:
    msgs = decode_recording("streamed")
    starts = [x for x in msgs if isinstance(x, m.StreamStart)]
    assert starts[0].first_segment and not any(s.first_segment for s in starts[1:-2])
    top = starts[0].xid
    data = [
        x
        for x in msgs
        if isinstance(
            x, m.Insert | m.Update | m.Delete | m.Truncate | m.LogicalMessage | m.Relation
        )
    ]
    assert all(x.xid is not None for x in data)  # every data message carries its xid
    sub_abort, whole_abort = [x for x in msgs if isinstance(x, m.StreamAbort)]
    rolled_back = next(x for x in data if isinstance(x, m.Insert) and x.new[0] == "32")
    assert sub_abort.xid == top and sub_abort.subxid == rolled_back.xid != top
    assert sub_abort.abort_lsn is not None and sub_abort.abort_ts is not None
    assert whole_abort.xid == whole_abort.subxid != top
    message = next(x for x in data if isinstance(x, m.LogicalMessage))
    assert (message.xid, message.content) == (top, b"in stream")
    assert next(x for x in msgs if isinstance(x, m.StreamCommit)).xid == top
    stream_prepare, commit_prepared = of(m.StreamPrepare, msgs[-2]), of(m.CommitPrepared, msgs[-1])
    assert stream_prepare.gid == commit_prepared.gid == "gid-3"
    assert stream_prepare.xid == commit_prepared.xid


def test_the_compiled_tuple_reader_matches_the_python_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # CI installs with a C compiler; the Python loop is the reference the reader is held to.
    assert importlib.util.find_spec("services.bridge.decode._tuples") is not None
    values: list[m.TupleValue] = [
        "42",
        None,
        m.UNCHANGED_TOAST,
        "",
        "h\u00e9llo \U0001f600",
        "x" * 70_000,
        "\x00\x7f",
    ]
    messages = [
        m.Insert(None, 7, [*values]),
        m.Update(None, 7, ["42", None], True, values[::-1]),
        m.Delete(None, 7, values[:2], False),
        m.Insert(None, 7, []),
    ]
    compiled = [PgOutputDecoder().decode(encode(msg)) for msg in messages]
    monkeypatch.setattr("services.bridge.decode.decoder._read_compiled", None)
    assert compiled == [PgOutputDecoder().decode(encode(msg)) for msg in messages] == messages
