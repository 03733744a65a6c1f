"""Builds pgoutput message payloads from ``services.bridge.decode.messages`` dataclasses.

An encoder written from the "Logical Replication Message Formats" page, independent of
the decoder, so tests (decoder, assembler) can generate byte streams. A column value of
type ``bytes`` is written as a binary ('b') column, which the bridge never asks for.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from services.bridge.decode import messages as m

ColumnValue = m.TupleValue | bytes


def cstring(text: str) -> bytes:
    return text.encode() + b"\0"


def tuple_data(values: Sequence[ColumnValue]) -> bytes:
    out = [struct.pack("!H", len(values))]
    for value in values:
        if value is None:
            out.append(b"n")
        elif value is m.UNCHANGED_TOAST:
            out.append(b"u")
        elif isinstance(value, bytes):
            out.append(b"b" + struct.pack("!I", len(value)) + value)
        else:
            raw = str(value).encode()
            out.append(b"t" + struct.pack("!I", len(raw)) + raw)
    return b"".join(out)


def _xid(xid: int | None) -> bytes:
    return b"" if xid is None else struct.pack("!I", xid)


def encode(msg: m.Message) -> bytes:
    """The payload the server sends for ``msg``.

    Data messages get the streamed xid prefix when their ``xid`` is set; a Stream Abort
    gets the parallel-apply fields when ``abort_lsn`` is set.
    """
    match msg:
        case m.Begin():
            return b"B" + struct.pack("!QqI", msg.final_lsn, msg.commit_ts, msg.xid)
        case m.Commit():
            return b"C" + struct.pack(
                "!BQQq", msg.flags, msg.commit_lsn, msg.end_lsn, msg.commit_ts
            )
        case m.Origin():
            return b"O" + struct.pack("!Q", msg.origin_lsn) + cstring(msg.name)
        case m.Relation():
            cols = b"".join(
                struct.pack("!B", int(c.is_key))
                + cstring(c.name)
                + struct.pack("!Ii", c.type_oid, c.type_modifier)
                for c in msg.columns
            )
            return (
                b"R"
                + _xid(msg.xid)
                + struct.pack("!I", msg.oid)
                + cstring(msg.namespace)
                + cstring(msg.name)
                + msg.replica_identity.encode()
                + struct.pack("!H", len(msg.columns))
                + cols
            )
        case m.TypeMsg():
            return (
                b"Y"
                + _xid(msg.xid)
                + struct.pack("!I", msg.oid)
                + cstring(msg.namespace)
                + cstring(msg.name)
            )
        case m.Insert():
            return (
                b"I"
                + _xid(msg.xid)
                + struct.pack("!I", msg.relation_oid)
                + b"N"
                + tuple_data(msg.new)
            )
        case m.Update():
            old = b""
            if msg.old is not None:
                old = (b"K" if msg.old_is_key_only else b"O") + tuple_data(msg.old)
            return (
                b"U"
                + _xid(msg.xid)
                + struct.pack("!I", msg.relation_oid)
                + old
                + b"N"
                + tuple_data(msg.new)
            )
        case m.Delete():
            return (
                b"D"
                + _xid(msg.xid)
                + struct.pack("!I", msg.relation_oid)
                + (b"K" if msg.old_is_key_only else b"O")
                + tuple_data(msg.old)
            )
        case m.Truncate():
            n = len(msg.relation_oids)
            return (
                b"T" + _xid(msg.xid) + struct.pack(f"!IB{n}I", n, msg.options, *msg.relation_oids)
            )
        case m.LogicalMessage():
            return (
                b"M"
                + _xid(msg.xid)
                + struct.pack("!BQ", int(msg.transactional), msg.lsn)
                + cstring(msg.prefix)
                + struct.pack("!I", len(msg.content))
                + msg.content
            )
        case m.StreamStart():
            return b"S" + struct.pack("!IB", msg.xid, int(msg.first_segment))
        case m.StreamStop():
            return b"E"
        case m.StreamCommit():
            return b"c" + struct.pack(
                "!IBQQq", msg.xid, msg.flags, msg.commit_lsn, msg.end_lsn, msg.commit_ts
            )
        case m.StreamAbort():
            out = b"A" + struct.pack("!II", msg.xid, msg.subxid)
            if msg.abort_lsn is not None:
                out += struct.pack("!Qq", msg.abort_lsn, msg.abort_ts or 0)
            return out
        case m.BeginPrepare():
            return (
                b"b"
                + struct.pack("!QQqI", msg.prepare_lsn, msg.end_lsn, msg.prepare_ts, msg.xid)
                + cstring(msg.gid)
            )
        case m.Prepare() | m.StreamPrepare():
            kind = b"P" if isinstance(msg, m.Prepare) else b"p"
            return (
                kind
                + struct.pack(
                    "!BQQqI", msg.flags, msg.prepare_lsn, msg.end_lsn, msg.prepare_ts, msg.xid
                )
                + cstring(msg.gid)
            )
        case m.CommitPrepared():
            return (
                b"K"
                + struct.pack(
                    "!BQQqI", msg.flags, msg.commit_lsn, msg.end_lsn, msg.commit_ts, msg.xid
                )
                + cstring(msg.gid)
            )
        case m.RollbackPrepared():
            return (
                b"r"
                + struct.pack(
                    "!BQQqqI",
                    msg.flags,
                    msg.prepare_end_lsn,
                    msg.rollback_end_lsn,
                    msg.prepare_ts,
                    msg.rollback_ts,
                    msg.xid,
                )
                + cstring(msg.gid)
            )
    raise TypeError(f"cannot encode {msg!r}")
