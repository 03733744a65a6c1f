"""A slot's stream for unit tests: generated pgoutput through the real decoder and
assembler, with LSNs handed out in order as the server would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from services.bridge.assemble.assembler import Assembler, Transaction
from services.bridge.assemble.spool import Spool, SpoolStats
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder
from tests.unit.pgoutput_builder import encode

TS = 785_000_000_123_456  # µs since 2000-01-01, ~2024-11
STEP = 0x10  # WAL bytes between two messages


class Source:
    """Feeds messages to an ``Assembler`` and keeps the transactions it seals."""

    def __init__(
        self,
        spool_dir: Path,
        on_prepared: Callable[[str, int], None] = lambda gid, lsn: None,
        on_rolled_back: Callable[[str], None] = lambda gid: None,
        memory_limit: int = 1 << 20,
        start: int = 0x1000,
    ) -> None:
        decoder = PgOutputDecoder(4)
        self.stats = SpoolStats()
        self.assembler = Assembler(
            decoder.decode,
            lambda name: Spool(spool_dir, name, memory_limit, self.stats),
            on_prepared=on_prepared,
            on_rolled_back=on_rolled_back,
        )
        self.lsn = start
        self.sealed: list[Transaction] = []

    def send(self, *messages: m.Message) -> None:
        """Each message at the next LSN."""
        for msg in messages:
            self.lsn += STEP
            txn = self.assembler.feed(self.lsn, encode(msg))
            if txn is not None:
                self.sealed.append(txn)

    def next_commit(self, changes: int) -> int:
        """The commit LSN of a transaction of ``changes`` messages sent from now on."""
        return self.lsn + STEP * (changes + 2)

    def commit(self, xid: int, *changes: m.Message) -> Transaction:
        """One regular transaction: Begin, ``changes``, Commit."""
        commit_lsn = self.next_commit(len(changes))
        self.send(
            m.Begin(commit_lsn, TS, xid), *changes, m.Commit(0, commit_lsn, commit_lsn + 8, TS)
        )
        return self.sealed[-1]

    def stream(self, xid: int, *changes: m.Message) -> None:
        """One streamed block of a large in-progress transaction."""
        self.send(m.StreamStart(xid, False), *changes, m.StreamStop())

    def stream_commit(self, xid: int) -> Transaction:
        commit_lsn = self.lsn + STEP
        self.send(m.StreamCommit(xid, 0, commit_lsn, commit_lsn + 8, TS))
        return self.sealed[-1]

    def prepare(self, xid: int, gid: str, *changes: m.Message) -> int:
        """A two-phase transaction up to its PREPARE; returns the prepare LSN."""
        prepare_lsn = self.next_commit(len(changes))
        self.send(
            m.BeginPrepare(prepare_lsn, prepare_lsn + 8, TS, xid, gid),
            *changes,
            m.Prepare(0, prepare_lsn, prepare_lsn + 8, TS, xid, gid),
        )
        return prepare_lsn

    def commit_prepared(self, xid: int, gid: str) -> Transaction:
        commit_lsn = self.lsn + STEP
        self.send(m.CommitPrepared(0, commit_lsn, commit_lsn + 8, TS, xid, gid))
        return self.sealed[-1]
