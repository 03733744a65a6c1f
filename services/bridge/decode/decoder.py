"""pgoutput message payloads -> ``services.bridge.decode.messages`` dataclasses (protocol 1-4).

Pure: no sockets, no clocks. This runs once per row change, so the data messages are
decoded with precompiled ``struct.Struct`` objects at explicit offsets and the tuple loop
is inlined: a helper call per column costs more than the column itself.

Two things of the session change how bytes read, and neither is in the bytes themselves:
- inside a streamed block (Stream Start .. Stream Stop) data messages carry the
  (sub)transaction id after the type byte;
- Stream Abort carries the abort LSN and time only with protocol 4 and
  ``streaming 'parallel'``.
So a decoder is created per session with the protocol options it asked for, and follows
the streamed-block state from the Stream Start / Stop messages it decodes. A caller that
replays a spooled data message later knows whether it came from a streamed block and
says so with ``streamed=``; that call neither reads nor changes the followed state. The
daemon still gives the thread reading the stream and the thread replaying spools a decoder
each, so no decoder is used by two threads at once.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from services.bridge.decode import messages as m
from services.common.errors import SlotbridgeError

try:
    from services.bridge.decode._tuples import read as _read_compiled
except ImportError:  # installed where no C compiler was at hand
    _read_compiled = None  # type: ignore[assignment]
COMPILED = _read_compiled is not None

_U16 = struct.Struct("!H")
_U32 = struct.Struct("!I")
_U64 = struct.Struct("!Q")
_BEGIN = struct.Struct("!QqI")
_COMMIT = struct.Struct("!BQQq")
_TWO_U32 = struct.Struct("!II")  # streamed xid + relation oid; Stream Abort xid + subxid
_COLUMN_TYPE = struct.Struct("!Ii")
_TRUNCATE_HEAD = struct.Struct("!IB")
_MESSAGE_HEAD = struct.Struct("!BQ")
_STREAM_START = struct.Struct("!IB")
_STREAM_COMMIT = struct.Struct("!IBQQq")
_STREAM_ABORT_PARALLEL = struct.Struct("!IIQq")
_BEGIN_PREPARE = struct.Struct("!QQqI")
_PREPARE = struct.Struct("!BQQqI")  # Prepare, Commit Prepared, Stream Prepare
_ROLLBACK_PREPARED = struct.Struct("!BQQqqI")

_u16 = _U16.unpack_from
_u32 = _U32.unpack_from

_REPLICA_IDENTITIES = frozenset("dnfi")

# Types each protocol version may send: a byte outside the negotiated set means the
# stream and the decoder disagree on the session, which must not be papered over.
_V1_TYPES = b"BCORYIUDTM"
_STREAM_TYPES = b"SEcA"  # protocol 2
_TWO_PHASE_TYPES = b"bPKrp"  # protocol 3

Handler = Callable[[bytes, bool], m.Message]

_NAMES = {
    "B": "Begin",
    "C": "Commit",
    "O": "Origin",
    "R": "Relation",
    "Y": "Type",
    "I": "Insert",
    "U": "Update",
    "D": "Delete",
    "T": "Truncate",
    "M": "Message",
    "S": "Stream Start",
    "E": "Stream Stop",
    "c": "Stream Commit",
    "A": "Stream Abort",
    "b": "Begin Prepare",
    "P": "Prepare",
    "K": "Commit Prepared",
    "r": "Rollback Prepared",
    "p": "Stream Prepare",
    "!": "oversized change stand-in",
}


class DecodeError(SlotbridgeError, ValueError):
    """A payload is not a well-formed pgoutput message of the negotiated protocol."""

    retryable = False  # the server sends the same bytes again


def _xid_prefix(buf: bytes, streamed: bool) -> tuple[int | None, int]:
    """The streamed (sub)transaction id, and where the message body starts."""
    if streamed:
        return _u32(buf, 1)[0], 5
    return None, 1


def _cstring(buf: bytes, pos: int) -> tuple[str, int]:
    end = buf.index(0, pos)
    return buf[pos:end].decode(), end + 1


def _tuple(buf: bytes, pos: int) -> tuple[m.TupleData, int]:
    """TupleData at ``pos`` -> the column values and the offset after them."""
    # The compiled reader takes the usual messages; what it does not (a binary or unknown
    # column kind, a value past the end) is read here, which says what is wrong.
    if _read_compiled is not None:
        read = _read_compiled(buf, pos, m.UNCHANGED_TOAST)
        if read is not None:
            return read
    ncols = _u16(buf, pos)[0]
    pos += 2
    # Preallocated with None, so a NULL column costs nothing but its offset, and index
    # assignment beats list.append by a few percent per row.
    values: m.TupleData = [None] * ncols
    u32 = _u32
    for i in range(ncols):
        kind = buf[pos]
        # Literal bytes, not named constants: a constant load is cheaper than a global.
        if kind == 116:  # 't' text
            start = pos + 5
            pos = start + u32(buf, pos + 1)[0]
            values[i] = buf[start:pos].decode()
        elif kind == 110:  # 'n' NULL
            pos += 1
        elif kind == 117:  # 'u' unchanged TOAST
            values[i] = m.UNCHANGED_TOAST
            pos += 1
        elif kind == 98:  # 'b' binary
            raise DecodeError(
                f"binary column value at offset {pos}: the bridge asks for text "
                "format (binary 'false'), so the session is misconfigured"
            )
        else:
            raise DecodeError(f"unknown column kind {bytes([kind])!r} at offset {pos}")
    return values, pos


def _overrun(buf: bytes, pos: int) -> DecodeError:
    # Slicing past the end does not fail in Python, so a truncated last column shows
    # up only as an end offset beyond the payload.
    return DecodeError(
        f"{_NAMES[chr(buf[0])]} message ends at offset {pos}, payload has {len(buf)} bytes"
    )


def _end(buf: bytes, pos: int, msg: m.Message) -> m.Message:
    if pos != len(buf):
        raise _overrun(buf, pos)
    return msg


def _begin(buf: bytes, streamed: bool) -> m.Message:
    return _end(buf, 21, m.Begin(*_BEGIN.unpack_from(buf, 1)))


def _commit(buf: bytes, streamed: bool) -> m.Message:
    return _end(buf, 26, m.Commit(*_COMMIT.unpack_from(buf, 1)))


def _origin(buf: bytes, streamed: bool) -> m.Message:
    lsn = _U64.unpack_from(buf, 1)[0]
    name, pos = _cstring(buf, 9)
    return _end(buf, pos, m.Origin(lsn, name))


def _relation(buf: bytes, streamed: bool) -> m.Message:
    xid, pos = _xid_prefix(buf, streamed)
    oid = _u32(buf, pos)[0]
    namespace, pos = _cstring(buf, pos + 4)
    name, pos = _cstring(buf, pos)
    identity = chr(buf[pos])
    if identity not in _REPLICA_IDENTITIES:
        raise DecodeError(f"unknown replica identity {identity!r} at offset {pos}")
    ncols = _u16(buf, pos + 1)[0]
    pos += 3
    columns = []
    for _ in range(ncols):
        flags = buf[pos]
        col_name, pos = _cstring(buf, pos + 1)
        type_oid, typmod = _COLUMN_TYPE.unpack_from(buf, pos)
        pos += 8
        columns.append(m.Column(col_name, type_oid, typmod, bool(flags & 1)))
    return _end(buf, pos, m.Relation(xid, oid, namespace, name, identity, tuple(columns)))


def _oversized(buf: bytes, streamed: bool) -> m.Message:
    xid, pos = _xid_prefix(buf, streamed)
    relid = _u32(buf, pos)[0]
    size = _U64.unpack_from(buf, pos + 4)[0]
    return _end(buf, pos + 12, m.OversizedChange(xid, relid, size))


def _type(buf: bytes, streamed: bool) -> m.Message:
    xid, pos = _xid_prefix(buf, streamed)
    oid = _u32(buf, pos)[0]
    namespace, pos = _cstring(buf, pos + 4)
    name, pos = _cstring(buf, pos)
    return _end(buf, pos, m.TypeMsg(xid, oid, namespace, name))


def _unexpected(buf: bytes, pos: int, wanted: str) -> DecodeError:
    return DecodeError(f"expected {wanted} at offset {pos}, found {buf[pos : pos + 1]!r}")


# Insert, Update and Delete are the row changes: they check markers and the end offset
# inline rather than through helpers, since a call costs as much as a column.


def change_relid_at(streamed: bool) -> int:
    """Where a row change's (Insert, Update, Delete) relation oid starts: after its type
    byte, and inside a streamed transaction after the xid too. A tuple marker and its
    TupleData follow."""
    return 5 if streamed else 1


def _insert(buf: bytes, streamed: bool) -> m.Message:
    if streamed:
        xid, relid = _TWO_U32.unpack_from(buf, 1)
        pos = 9
    else:
        xid, relid = None, _u32(buf, 1)[0]
        pos = 5
    if buf[pos] != 78:  # 'N'
        raise _unexpected(buf, pos, "'N' (new tuple)")
    new, pos = _tuple(buf, pos + 1)
    if pos != len(buf):
        raise _overrun(buf, pos)
    return m.Insert(xid, relid, new)


def _update(buf: bytes, streamed: bool) -> m.Message:
    xid, pos = _xid_prefix(buf, streamed)
    relid = _u32(buf, pos)[0]
    pos += 4
    kind = buf[pos]
    old: m.TupleData | None = None
    if kind == 75 or kind == 79:  # 'K' old key, 'O' old full row
        old, pos = _tuple(buf, pos + 1)
    if buf[pos] != 78:  # 'N'
        raise _unexpected(buf, pos, "'N' (new tuple)")
    new, pos = _tuple(buf, pos + 1)
    if pos != len(buf):
        raise _overrun(buf, pos)
    return m.Update(xid, relid, old, kind == 75, new)


def _delete(buf: bytes, streamed: bool) -> m.Message:
    xid, pos = _xid_prefix(buf, streamed)
    relid = _u32(buf, pos)[0]
    pos += 4
    kind = buf[pos]
    if kind != 75 and kind != 79:  # 'K' old key, 'O' old full row
        raise _unexpected(buf, pos, "'K' or 'O' (old tuple)")
    old, pos = _tuple(buf, pos + 1)
    if pos != len(buf):
        raise _overrun(buf, pos)
    return m.Delete(xid, relid, old, kind == 75)


def _truncate(buf: bytes, streamed: bool) -> m.Message:
    xid, pos = _xid_prefix(buf, streamed)
    count, options = _TRUNCATE_HEAD.unpack_from(buf, pos)
    pos += 5
    oids = struct.unpack_from(f"!{count}I", buf, pos)
    return _end(buf, pos + 4 * count, m.Truncate(xid, options, oids))


def _message(buf: bytes, streamed: bool) -> m.Message:
    xid, pos = _xid_prefix(buf, streamed)
    flags, lsn = _MESSAGE_HEAD.unpack_from(buf, pos)
    prefix, pos = _cstring(buf, pos + 9)
    size = _u32(buf, pos)[0]
    pos += 4
    content = buf[pos : pos + size]
    return _end(buf, pos + size, m.LogicalMessage(xid, bool(flags & 1), lsn, prefix, content))


def _stream_commit(buf: bytes, streamed: bool) -> m.Message:
    return _end(buf, 30, m.StreamCommit(*_STREAM_COMMIT.unpack_from(buf, 1)))


def _stream_abort(buf: bytes, streamed: bool) -> m.Message:
    xid, subxid = _TWO_U32.unpack_from(buf, 1)
    return _end(buf, 9, m.StreamAbort(xid, subxid, None, None))


def _stream_abort_parallel(buf: bytes, streamed: bool) -> m.Message:
    return _end(buf, 25, m.StreamAbort(*_STREAM_ABORT_PARALLEL.unpack_from(buf, 1)))


def _begin_prepare(buf: bytes, streamed: bool) -> m.Message:
    prepare_lsn, end_lsn, prepare_ts, xid = _BEGIN_PREPARE.unpack_from(buf, 1)
    gid, pos = _cstring(buf, 1 + _BEGIN_PREPARE.size)
    return _end(buf, pos, m.BeginPrepare(prepare_lsn, end_lsn, prepare_ts, xid, gid))


def _prepare_like(cls: Callable[[int, int, int, int, int, str], m.Message]) -> Handler:
    """Prepare, Commit Prepared and Stream Prepare share one layout."""

    def decode(buf: bytes, streamed: bool) -> m.Message:
        flags, lsn, end_lsn, ts, xid = _PREPARE.unpack_from(buf, 1)
        gid, pos = _cstring(buf, 1 + _PREPARE.size)
        return _end(buf, pos, cls(flags, lsn, end_lsn, ts, xid, gid))

    return decode


def _rollback_prepared(buf: bytes, streamed: bool) -> m.Message:
    flags, prepare_end, rollback_end, prepare_ts, rollback_ts, xid = _ROLLBACK_PREPARED.unpack_from(
        buf, 1
    )
    gid, pos = _cstring(buf, 1 + _ROLLBACK_PREPARED.size)
    return _end(
        buf,
        pos,
        m.RollbackPrepared(flags, prepare_end, rollback_end, prepare_ts, rollback_ts, xid, gid),
    )


_HANDLERS: dict[int, Handler] = {
    ord("B"): _begin,
    ord("C"): _commit,
    ord("O"): _origin,
    ord("R"): _relation,
    ord("Y"): _type,
    ord("I"): _insert,
    ord("U"): _update,
    ord("D"): _delete,
    ord("T"): _truncate,
    ord("M"): _message,
    ord("c"): _stream_commit,
    ord("b"): _begin_prepare,
    ord("P"): _prepare_like(m.Prepare),
    ord("K"): _prepare_like(m.CommitPrepared),
    ord("r"): _rollback_prepared,
    ord("p"): _prepare_like(m.StreamPrepare),
}


# What the stages before decoding (the assembler spooling a transaction, the publisher
# filtering a spool) ask of a raw payload. They ask here, so that pgoutput's bytes are
# known in this module (and its C readers) alone.

_DATA_TYPES = frozenset(b"RYIUDTM!")
_ROW_CHANGE_TYPES = frozenset(b"IUD")
_CATALOG_TYPES = frozenset(b"RY")
_RELATION = ord("R")
_MESSAGE = ord("M")
_UPDATE = ord("U")
_OLD_KEY = ord("K")
# The tag of the assembler's stand-in for a row change too large to publish (see
# ``oversized_stand_in``). No pgoutput type: the server never sends it.
_OVERSIZED = ord("!")


def is_data(payload: bytes) -> bool:
    """Whether the message is part of a transaction's content (relations, types, row
    changes, logical messages), not of its framing (begin, commit, stream, prepare)."""
    return payload[0] in _DATA_TYPES


def is_catalog(payload: bytes) -> bool:
    """A Relation or Type message: it describes, it changes nothing."""
    return payload[0] in _CATALOG_TYPES


def is_relation(payload: bytes) -> bool:
    return payload[0] == _RELATION


def is_logical_message(payload: bytes) -> bool:
    return payload[0] == _MESSAGE


def is_untied_message(payload: bytes) -> bool:
    """A logical message emitted outside any transaction (``pg_logical_emit_message(false,
    ...)``): it arrives at once and has no commit position."""
    return payload[0] == _MESSAGE and not payload[1] & 1


def message_name(payload: bytes) -> str:
    """The message's type for an error line ("Insert"), or its type byte when unknown."""
    kind = payload[:1].decode("latin-1")
    return _NAMES.get(kind, repr(kind))


def in_place_change_relation(payload: bytes, streamed: bool) -> int | None:
    """The relation of a row change whose record a compiled plan may read in place (an
    Insert, a Delete, an Update sending no old row or the whole old one); None for any
    other message, and for an Update with an old key (the key changed: three records)."""
    kind = payload[0]
    if kind not in _ROW_CHANGE_TYPES:
        return None
    at = change_relid_at(streamed)
    if kind == _UPDATE and payload[at + 4] == _OLD_KEY:
        return None
    oid: int = _u32(payload, at)[0]
    return oid


def streamed_xid(payload: bytes) -> int:
    """The (sub)transaction id a data message from a streamed block carries."""
    xid: int = _u32(payload, 1)[0]
    return xid


def with_streamed_xid(payload: bytes, xid: int) -> bytes:
    """A data message sent outside a streamed block, as if sent inside one by ``xid``
    (a Relation sent before a stream started, which the stream's spool holds)."""
    return payload[:1] + _U32.pack(xid) + payload[1:]


def oversized_stand_in(payload: bytes, streamed: bool, max_size: int) -> bytes:
    """What to spool for ``payload``: itself, or for a row change over ``max_size`` bytes
    a stand-in naming its relation and size (decoded as ``OversizedChange``). A row of
    hundreds of MB is then neither written to the spool nor read back from it; whether it
    is refused depends on its transaction committing, known only later."""
    if len(payload) <= max_size or payload[0] not in _ROW_CHANGE_TYPES:
        return payload
    end = change_relid_at(streamed) + 4
    return bytes((_OVERSIZED,)) + payload[1:end] + _U64.pack(len(payload))


class PgOutputDecoder:
    """Decodes the pgoutput messages of one replication session."""

    def __init__(self, proto_version: int = 4, parallel_abort: bool = False) -> None:
        """``parallel_abort``: the session asked for ``streaming 'parallel'``, so with
        protocol 4 a Stream Abort carries the abort LSN and time."""
        if not 1 <= proto_version <= 4:
            raise ValueError(f"pgoutput protocol version {proto_version} is not 1-4")
        self.proto_version = proto_version
        self.parallel_abort = parallel_abort and proto_version >= 4
        self.in_stream = False
        allowed = _V1_TYPES
        if proto_version >= 2:
            allowed += _STREAM_TYPES
        if proto_version >= 3:
            allowed += _TWO_PHASE_TYPES
        handlers = {kind: h for kind, h in _HANDLERS.items() if kind in allowed}
        handlers[_OVERSIZED] = _oversized  # the assembler's own, whatever the protocol
        if proto_version >= 2:
            handlers[ord("S")] = self._stream_start
            handlers[ord("E")] = self._stream_stop
            handlers[ord("A")] = _stream_abort_parallel if self.parallel_abort else _stream_abort
        self._handlers = handlers

    def decode(
        self, payload: bytes | bytearray | memoryview, streamed: bool | None = None
    ) -> m.Message:
        """One message payload (after the XLogData header) -> its dataclass.

        ``streamed``: whether the payload came from inside a streamed block; ``None``
        means "as the Stream Start / Stop messages decoded so far say".
        """
        buf = payload if isinstance(payload, bytes) else bytes(payload)
        try:
            handler = self._handlers[buf[0]]
        except (KeyError, IndexError):
            raise self._unknown(buf) from None
        try:
            return handler(buf, self.in_stream if streamed is None else streamed)
        except DecodeError:
            raise
        except (IndexError, ValueError, struct.error) as exc:  # UnicodeDecodeError too
            name = _NAMES[chr(buf[0])]
            raise DecodeError(f"malformed {name} message ({len(buf)} bytes): {exc}") from exc

    def _unknown(self, buf: bytes) -> DecodeError:
        if not buf:
            return DecodeError("empty message payload")
        kind = buf[:1]
        name = _NAMES.get(kind.decode("latin-1"))
        if name is None:
            return DecodeError(f"unknown pgoutput message type {kind!r} at offset 0")
        return DecodeError(
            f"{name} message {kind!r} at offset 0 is not part of pgoutput "
            f"protocol version {self.proto_version}"
        )

    def _stream_start(self, buf: bytes, streamed: bool) -> m.Message:
        xid, first = _STREAM_START.unpack_from(buf, 1)
        msg = _end(buf, 6, m.StreamStart(xid, first == 1))
        self.in_stream = True
        return msg

    def _stream_stop(self, buf: bytes, streamed: bool) -> m.Message:
        msg = _end(buf, 1, m.StreamStop())
        self.in_stream = False
        return msg
