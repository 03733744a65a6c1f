"""The pgoutput logical replication messages, as plain data.

These are what the decoder produces and the transaction assembler consumes. They mirror
"Logical Replication Message Formats" in the PostgreSQL manual (protocol versions 1-4).
LSNs are ints, timestamps are microseconds since 2000-01-01 (PostgreSQL's epoch) as sent.

Column values inside a tuple are kept as the server sent them (text format):
``None`` for NULL, ``UNCHANGED_TOAST`` for an unchanged TOASTed value the server did not
send, ``str`` for a text value. Typing them is the event builder's job, not the decoder's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


class _UnchangedToast:
    """Marker for a column the server left out because its TOASTed value did not change."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"


UNCHANGED_TOAST: Final = _UnchangedToast()

TupleValue = str | None | _UnchangedToast
# A row's values in column order: pgoutput's TupleData, held in a list.
TupleData = list[TupleValue]


@dataclass(slots=True, frozen=True)
class Column:
    name: str
    type_oid: int
    type_modifier: int
    is_key: bool


@dataclass(slots=True, frozen=True)
class Begin:
    final_lsn: int  # LSN of the commit record
    commit_ts: int
    xid: int


@dataclass(slots=True, frozen=True)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(slots=True, frozen=True)
class Origin:
    origin_lsn: int
    name: str


@dataclass(slots=True, frozen=True)
class Relation:
    xid: int | None  # set only inside a streamed transaction
    oid: int
    namespace: str
    name: str
    replica_identity: str  # 'd' default, 'n' nothing, 'f' full, 'i' index
    columns: tuple[Column, ...]


@dataclass(slots=True, frozen=True)
class TypeMsg:
    xid: int | None
    oid: int
    namespace: str
    name: str


# The row changes are built once per row on the hot path: a frozen dataclass pays for
# object.__setattr__ on every field, a fifth of the decoder's time. Nothing mutates them.
@dataclass(slots=True)
class Insert:
    xid: int | None
    relation_oid: int
    new: TupleData


@dataclass(slots=True)
class Update:
    xid: int | None
    relation_oid: int
    old: TupleData | None  # present with REPLICA IDENTITY FULL ('O') or a changed key ('K')
    old_is_key_only: bool
    new: TupleData


@dataclass(slots=True)
class Delete:
    xid: int | None
    relation_oid: int
    old: TupleData
    old_is_key_only: bool


@dataclass(slots=True, frozen=True)
class Truncate:
    xid: int | None
    options: int  # bit 1 CASCADE, bit 2 RESTART IDENTITY
    relation_oids: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class LogicalMessage:
    xid: int | None
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


@dataclass(slots=True, frozen=True)
class StreamStart:
    xid: int
    first_segment: bool


@dataclass(slots=True, frozen=True)
class StreamStop:
    pass


@dataclass(slots=True, frozen=True)
class StreamCommit:
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int


@dataclass(slots=True, frozen=True)
class StreamAbort:
    xid: int  # top-level transaction
    subxid: int  # the (sub)transaction aborted; equals xid when the whole thing aborted
    abort_lsn: int | None  # protocol 4 with streaming 'parallel' only
    abort_ts: int | None


@dataclass(slots=True, frozen=True)
class BeginPrepare:
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str


@dataclass(slots=True, frozen=True)
class Prepare:
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str


@dataclass(slots=True, frozen=True)
class CommitPrepared:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int
    xid: int
    gid: str


@dataclass(slots=True, frozen=True)
class RollbackPrepared:
    flags: int
    prepare_end_lsn: int
    rollback_end_lsn: int
    prepare_ts: int
    rollback_ts: int
    xid: int
    gid: str


@dataclass(slots=True, frozen=True)
class StreamPrepare:
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_ts: int
    xid: int
    gid: str


@dataclass(slots=True, frozen=True)
class OversizedChange:
    """A row change too large to publish, as the assembler spooled it: its relation and
    its size in the stream, never its row (see ``decoder.oversized_stand_in``)."""

    xid: int | None
    relation_oid: int
    size: int


Message = (
    Begin
    | Commit
    | Origin
    | Relation
    | TypeMsg
    | Insert
    | Update
    | Delete
    | Truncate
    | LogicalMessage
    | StreamStart
    | StreamStop
    | StreamCommit
    | StreamAbort
    | BeginPrepare
    | Prepare
    | CommitPrepared
    | RollbackPrepared
    | StreamPrepare
    | OversizedChange
)
