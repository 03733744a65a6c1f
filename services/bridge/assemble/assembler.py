"""Turns the pgoutput message stream into whole committed transactions, in commit order.

Three shapes of transaction arrive:
- regular: Begin, changes, Commit - contiguous;
- streamed (``streaming on/parallel``): chunks between Stream Start/Stop, interleaved
  with other transactions, ended by Stream Commit or Stream Abort (of the whole thing or
  of one subtransaction);
- prepared (``two_phase``): Begin Prepare ... Prepare (or a streamed one ended by Stream
  Prepare), then much later Commit Prepared or Rollback Prepared.

Only control messages are decoded here; data messages (relations, changes) are kept as
raw payloads in a per-transaction ``Spool`` and decoded once, when published. Streamed
data messages carry their (sub)transaction id in bytes 1-4, which is all a Stream Abort of
a subtransaction needs to drop exactly that subtransaction's changes at replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.bridge.assemble.spool import Spool
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import (
    is_catalog,
    is_data,
    is_relation,
    is_untied_message,
    message_name,
    oversized_stand_in,
    with_streamed_xid,
)
from services.common.errors import SlotbridgeError


class AssemblyError(SlotbridgeError):
    """The stream broke the protocol's ordering rules; the session must restart."""

    retryable = True


@dataclass(slots=True)
class Transaction:
    """A transaction whose fate is sealed: its changes are ready to publish."""

    xid: int
    commit_lsn: int
    end_lsn: int
    commit_ts: int  # microseconds since 2000-01-01, as sent
    spool: Spool
    streamed: bool  # payloads carry an xid prefix
    aborted_subxids: frozenset[int]
    gid: str | None = None  # set for a two-phase transaction
    prepare_lsn: int | None = None
    # Its Relation messages (raw, also in the spool): what it describes is known without
    # reading the spool, which may be on disk, an extra time.
    relations: tuple[bytes, ...] = ()


class _Open:
    """A transaction whose messages are arriving. Made per source transaction, so it holds
    no more than it must: a regular transaction's ``aborted`` is a shared empty set, which
    only a stream's Stream Abort adds to (``_stream_abort`` looks in streams alone), and
    ``relations`` a list only once it describes a relation."""

    __slots__ = ("aborted", "relations", "spool", "streamed", "xid")

    def __init__(self, xid: int, spool: Spool, streamed: bool) -> None:
        self.xid = xid
        self.spool = spool
        self.streamed = streamed
        self.aborted: set[int] | frozenset[int] = set() if streamed else _NONE_ABORTED
        self.relations: list[bytes] | None = None

    def described(self, payload: bytes) -> None:
        """Keep a Relation message (also spooled) for ``Transaction.relations``."""
        if self.relations is None:
            self.relations = [payload]
        else:
            self.relations.append(payload)


_NONE_ABORTED: frozenset[int] = frozenset()


SpoolFactory = Callable[[str], Spool]


class Assembler:
    def __init__(
        self,
        decode: Callable[[bytes], m.Message],
        new_spool: SpoolFactory,
        on_prepared: Callable[[str, int], None] = lambda gid, lsn: None,
        on_rolled_back: Callable[[str], None] = lambda gid: None,
        max_change_bytes: int | None = None,
        on_untied_message: Callable[[m.LogicalMessage], None] = lambda msg: None,
    ) -> None:
        """``on_prepared``/``on_rolled_back`` tell the confirm tracker which PREPAREs must
        hold back the slot's confirmed position until they are published or dropped. A
        row change over ``max_change_bytes`` is spooled as a stand-in (``oversized_stand_in``).
        ``on_untied_message`` hears of each non-transactional logical message, which is
        not published (see ``_data``)."""
        self._decode = decode
        self._on_untied_message = on_untied_message
        self._max_change = max_change_bytes
        self._new_spool = new_spool
        self._on_prepared = on_prepared
        self._on_rolled_back = on_rolled_back
        self._current: _Open | None = None  # the open regular or begin-prepare transaction
        self._streams: dict[int, _Open] = {}  # streamed transactions by top-level xid
        self._in_stream: _Open | None = None
        self._prepared: dict[str, tuple[_Open, int]] = {}  # gid -> (txn, prepare_lsn)
        self._orphans: list[tuple[int, bytes]] = []  # relation/type outside a transaction

    @property
    def mid_transaction(self) -> bool:
        """A regular transaction's messages are arriving: its Commit is on its way (the
        server sends a transaction only once it committed, unless it streams it)."""
        return self._current is not None

    @property
    def between_transactions(self) -> bool:
        """No regular transaction is open, no stream block under way and no relation waits
        for the next transaction: a whole regular transaction may be read around the
        assembler (``regular``)."""
        return self._current is None and self._in_stream is None and not self._orphans

    @property
    def idle(self) -> bool:
        """No transaction is open, streaming or prepared: confirming WAL end loses nothing."""
        return self._current is None and not self._streams and not self._prepared

    def feed(self, lsn: int, payload: bytes) -> Transaction | None:
        """Take one message; return a transaction when this message sealed one."""
        if is_data(payload):
            self._data(lsn, payload)
            return None
        msg = self._decode(payload)
        match msg:
            case m.Begin(xid=xid):
                self._open_regular(xid)
            case m.Commit(commit_lsn=commit_lsn, end_lsn=end_lsn, commit_ts=ts):
                txn = self._take_current("Commit")
                return self._seal(txn, commit_lsn, end_lsn, ts)
            case m.StreamStart(xid=xid):
                if self._in_stream is not None:
                    raise AssemblyError("Stream Start inside a stream block")
                self._in_stream = self._streams.get(xid) or self._start_stream(xid)
            case m.StreamStop():
                self._in_stream = None
            case m.StreamCommit(xid=xid, commit_lsn=commit_lsn, end_lsn=end_lsn, commit_ts=ts):
                txn = self._take_stream(xid, "Stream Commit")
                return self._seal(txn, commit_lsn, end_lsn, ts)
            case m.StreamAbort(xid=xid, subxid=subxid):
                self._stream_abort(xid, subxid)
            case m.BeginPrepare(xid=xid):
                self._open_regular(xid)
            case m.Prepare(gid=gid, prepare_lsn=prepare_lsn):
                self._prepared[gid] = (self._take_current("Prepare"), prepare_lsn)
                self._on_prepared(gid, prepare_lsn)
            case m.StreamPrepare(xid=xid, gid=gid, prepare_lsn=prepare_lsn):
                self._prepared[gid] = (self._take_stream(xid, "Stream Prepare"), prepare_lsn)
                self._on_prepared(gid, prepare_lsn)
            case m.CommitPrepared(gid=gid, commit_lsn=commit_lsn, end_lsn=end_lsn, commit_ts=ts):
                entry = self._prepared.pop(gid, None)
                if entry is None:
                    # Its content went by before our start position: the caller decides
                    # (already published, or a gap it must refuse to paper over).
                    return Transaction(
                        0,
                        commit_lsn,
                        end_lsn,
                        ts,
                        self._new_spool(f"gid-{gid}"),
                        False,
                        frozenset(),
                        gid,
                        None,
                    )
                txn, prepare_lsn = entry
                sealed = self._seal(txn, commit_lsn, end_lsn, ts)
                sealed.gid, sealed.prepare_lsn = gid, prepare_lsn
                return sealed
            case m.RollbackPrepared(gid=gid):
                entry = self._prepared.pop(gid, None)
                if entry is not None:
                    entry[0].spool.discard()
                self._on_rolled_back(gid)
            case m.Origin():
                pass  # we publish every origin's changes; the name is not part of a record
            case _:
                raise AssemblyError(f"unexpected message {type(msg).__name__}")
        return None

    def regular(
        self,
        xid: int,
        commit_lsn: int,
        end_lsn: int,
        commit_ts: int,
        entries: list[tuple[int, bytes]],
        memory: int,
    ) -> Transaction:
        """A regular transaction read whole (``decode._runs``: Begin, row changes within
        ``max_change_bytes`` and the spool's memory, Commit), as ``feed`` would have sealed
        it; only ``between_transactions``."""
        spool = self._holding(xid, entries, memory)
        return Transaction(xid, commit_lsn, end_lsn, commit_ts, spool, False, _NONE_ABORTED)

    def opened(self, xid: int, entries: list[tuple[int, bytes]], memory: int) -> None:
        """A regular transaction whose Begin and first changes were read around the
        assembler (``decode._runs``), left to ``feed`` from here; as ``regular``."""
        if self._current is not None:
            raise AssemblyError(f"Begin of {xid} while {self._current.xid} is still open")
        self._current = _Open(xid, self._holding(xid, entries, memory), False)

    def _holding(self, xid: int, entries: list[tuple[int, bytes]], memory: int) -> Spool:
        """A regular transaction's spool, holding what was read of it around the assembler."""
        spool = self._new_spool(f"txn-{xid}")
        spool.hold(entries, memory)
        return spool

    @property
    def max_change(self) -> int | None:
        """The largest row change spooled as it is (``oversized_stand_in``)."""
        return self._max_change

    def discard_all(self) -> None:
        """Drop every buffered transaction (the session ends; the slot will resend them)."""
        spools = [t.spool for t in self._streams.values()]
        spools += [t.spool for t, _ in self._prepared.values()]
        if self._current is not None:
            spools.append(self._current.spool)
        for spool in spools:
            spool.discard()
        self._current, self._in_stream = None, None
        self._streams.clear()
        self._prepared.clear()

    def _data(self, lsn: int, payload: bytes) -> None:
        target = self._in_stream or self._current
        if target is None:
            if is_catalog(payload):
                self._orphans.append((lsn, payload))
                return
            if is_untied_message(payload):
                # pg_logical_emit_message(false, ...): sent at once, in no transaction, so
                # it has no commit position in the exactly-once order (a replay could not
                # tell it was published) and is not published; other tools (heartbeats,
                # watermarks) emit such messages into the same WAL.
                message = self._decode(payload)
                assert isinstance(message, m.LogicalMessage)
                self._on_untied_message(message)
                return
            raise AssemblyError(f"{message_name(payload)} message outside a transaction")
        if self._max_change is not None and len(payload) > self._max_change:
            payload = oversized_stand_in(payload, target.streamed, self._max_change)
        if is_relation(payload):
            target.described(payload)
        target.spool.append(lsn, payload)

    def _open_regular(self, xid: int) -> None:
        if self._current is not None:
            raise AssemblyError(f"Begin of {xid} while {self._current.xid} is still open")
        txn = self._current = _Open(xid, self._new_spool(f"txn-{xid}"), False)
        if self._orphans:
            self._adopt_orphans(txn)

    def _start_stream(self, xid: int) -> _Open:
        txn = self._streams[xid] = _Open(xid, self._new_spool(f"stream-{xid}"), True)
        if self._orphans:
            self._adopt_orphans(txn)
        return txn

    def _adopt_orphans(self, txn: _Open) -> None:
        for lsn, payload in self._orphans:
            # A streamed transaction's payloads carry an xid; give orphans the top xid.
            if txn.streamed:
                payload = with_streamed_xid(payload, txn.xid)
            if is_relation(payload):
                txn.described(payload)
            txn.spool.append(lsn, payload)
        self._orphans.clear()

    def _take_current(self, what: str) -> _Open:
        if self._current is None:
            raise AssemblyError(f"{what} without an open transaction")
        txn, self._current = self._current, None
        return txn

    def _take_stream(self, xid: int, what: str) -> _Open:
        txn = self._streams.pop(xid, None)
        if txn is None:
            raise AssemblyError(f"{what} for unknown streamed transaction {xid}")
        if self._in_stream is txn:
            self._in_stream = None
        return txn

    def _stream_abort(self, xid: int, subxid: int) -> None:
        if xid == subxid:
            txn = self._streams.pop(xid, None)
            if txn is not None:
                txn.spool.discard()
            return
        txn = self._streams.get(xid)
        if txn is not None:
            aborted = txn.aborted
            assert isinstance(aborted, set)  # a stream's own
            aborted.add(subxid)

    @staticmethod
    def _seal(txn: _Open, commit_lsn: int, end_lsn: int, ts: int) -> Transaction:
        aborted, relations = txn.aborted, txn.relations
        return Transaction(
            txn.xid,
            commit_lsn,
            end_lsn,
            ts,
            txn.spool,
            txn.streamed,
            frozenset(aborted) if aborted else _NONE_ABORTED,
            None,
            None,
            tuple(relations) if relations else (),
        )
