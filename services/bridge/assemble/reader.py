"""Sealed transactions off the replication stream, for the socket loop.

Two paths give the same transactions. The reference reads the stream one message at a
time (``ReplicationConnection.next_message``) into the ``Assembler``. The compiled one
(``decode._runs``) reads whole regular transactions of row changes in one call, which is
what a busy source mostly sends, and hands everything else back as messages for the
reference path: a relation, a stream block, a prepared transaction, a keepalive, a change
over ``max_change_bytes`` or a transaction larger than the spool's memory (the transaction
it interrupts goes to the assembler as opened with the changes read so far). A transaction
still arriving when libpq's buffer runs out stays with the reader until the next read.
``tests/unit/test_reader.py`` holds the two paths to the same result.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.bridge.assemble.assembler import Assembler, Transaction
from services.bridge.receive.stream import ReplicationConnection

if TYPE_CHECKING:
    from services.bridge.decode._runs import Partial
try:
    from services.bridge.decode._runs import read as _read_runs
except ImportError:  # installed where no C compiler was at hand
    _read_runs = None  # type: ignore[assignment]
COMPILED = _read_runs is not None

# A message as the stream frames it: ("w", data_start, wal_end, payload) or
# ("k", wal_end, 0, reply).
Message = tuple[str, int, int, bytes | bool]

# What stopped a compiled read (decode/_runs.c).
_DRAINED, _STOPPED, _ENDED, _FULL = range(4)


@dataclass
class Received:
    """What one ``TransactionReader.read`` took off the stream."""

    transactions: list[Transaction] = field(default_factory=list)
    # The highest WAL position the server reported (XLogData's and keepalives' WAL end).
    wal_end: int = 0
    # A keepalive's (WAL end, reply requested), read last: the loop answers it first.
    keepalive: tuple[int, bool] | None = None
    # What the transactions' spools hold, which bounds a read.
    sealed_bytes: int = 0


class TransactionReader:
    """Reads the stream of one session into its assembler."""

    def __init__(
        self,
        repl: ReplicationConnection,
        assembler: Assembler,
        spool_memory: int,
        compiled: bool = COMPILED,
    ) -> None:
        """``spool_memory``: what a spool holds in memory before it spills (a larger
        transaction takes the reference path, which spills it); ``compiled``: whether to
        read regular transactions whole (where ``decode._runs`` is built)."""
        self._repl = repl
        self._assembler = assembler
        self._spool_memory = spool_memory
        self._compiled = compiled and _read_runs is not None
        max_change = assembler.max_change
        self._max_change = -1 if max_change is None else max_change
        # A regular transaction the compiled path is reading, between two reads: at most
        # ``spool_memory`` bytes (``unsealed_bytes``).
        self._partial: Partial | None = None

    @property
    def unsealed_bytes(self) -> int:
        """The payload bytes of the transaction the compiled path holds between two reads,
        not yet in a spool (``SpoolStats.count_unsealed``)."""
        partial = self._partial  # one read: the metrics' thread asks
        return 0 if partial is None else partial[2]

    @property
    def mid_transaction(self) -> bool:
        """A regular transaction's messages are arriving (``Assembler.mid_transaction``,
        or one the compiled path is reading)."""
        return self._partial is not None or self._assembler.mid_transaction

    @property
    def idle(self) -> bool:
        """No transaction is open, streaming, prepared or being read: confirming the WAL
        end loses nothing (``Assembler.idle``)."""
        return self._partial is None and self._assembler.idle

    def read(self, timeout_s: float, max_bytes: int) -> Received:
        """What the server sent, waiting at most ``timeout_s`` for it: until libpq holds no
        more, a keepalive, or transactions of ``max_bytes`` spooled bytes."""
        got = Received()
        waited = False
        while got.keepalive is None and got.sealed_bytes < max_bytes:
            if self._compiled and self._assembler.between_transactions:
                drained = self._read_compiled(got, max_bytes - got.sealed_bytes) == _DRAINED
            else:
                drained = self._feed(iter(self._repl.next_message, None), got, max_bytes)
            if not drained:
                continue
            if waited or not self._repl.wait(timeout_s):
                break
            waited = True
        return got

    def _feed(self, messages: Iterator[Message], got: Received, max_bytes: int) -> bool:
        """Messages one by one into the assembler (the reference path): until a keepalive,
        ``max_bytes``, or, where the compiled path may take over, a sealed transaction;
        True when ``messages`` ran out (libpq holds no more)."""
        feed = self._assembler.feed
        transactions = got.transactions
        wal_end = got.wal_end
        try:
            for kind, a, b, payload in messages:
                if kind != "w":
                    wal_end = max(wal_end, a)
                    got.keepalive = (a, bool(payload))
                    return False
                if b > wal_end:
                    wal_end = b
                txn = feed(a, payload)  # type: ignore[arg-type]
                if txn is not None:
                    transactions.append(txn)
                    got.sealed_bytes += txn.spool.size
                    if self._compiled or got.sealed_bytes >= max_bytes:
                        return False
            return True
        finally:
            got.wal_end = wal_end

    def _read_compiled(self, got: Received, max_bytes: int) -> int:
        """One compiled read of what libpq holds: its sealed transactions into ``got``, a
        transaction it left to the assembler there, the message that stopped it through
        ``_feed``; returns what stopped it."""
        assert _read_runs is not None
        items, state, wal_end, self._partial = _read_runs(
            self._repl.copy_data, self._spool_memory, self._max_change, max_bytes, self._partial
        )
        if wal_end > got.wal_end:
            got.wal_end = wal_end
        for item in items:
            kind = item[0]
            if kind == "T":
                _, xid, commit_lsn, end_lsn, ts, entries, memory = item
                txn = self._assembler.regular(xid, commit_lsn, end_lsn, ts, entries, memory)  # type: ignore[arg-type]
                got.transactions.append(txn)
                got.sealed_bytes += txn.spool.size
            elif kind == "B":
                _, xid, entries, memory = item
                self._assembler.opened(xid, entries, memory)  # type: ignore[arg-type]
            else:  # the frame that stopped the read, the last item
                self._feed(iter((item,)), got, max_bytes)  # type: ignore[arg-type]
        if state == _ENDED:
            raise self._repl.stream_ended()
        return state
