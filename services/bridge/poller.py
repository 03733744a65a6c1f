"""Catalog polling, off the socket thread: slot statistics and tables added to the
publication.

The socket loop must answer the server and read the stream without pause; these queries
need not run there. They run on a thread of their own, with a connection of its own that
gives up on a lock rather than wait: DDL holding a published table's ACCESS EXCLUSIVE lock
would otherwise hold the poll until it commits. A table found missing from Kafka is
queued as a ``SnapshotRequest`` behind what the socket loop has queued so far; where it
lands does not matter for the snapshot's correctness (its chunks are reconciled with the
stream from the moment the publisher starts watching the table, see ``chunks.py``).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field

import psycopg

from services.bridge.metrics import BridgeMetrics
from services.bridge.publish.publisher import Publisher, SnapshotRequest, TxnQueue
from services.bridge.snapshot.chunks import TableName
from services.bridge.source import published_tables
from services.common.logs import log_event

log = logging.getLogger(__name__)

POLL_EVERY_S = 10.0
# The poll connection's options: wait at most a second for a lock.
POLL_OPTIONS = "-c lock_timeout=1000"
_WAL_STATUSES = ("reserved", "extended", "unreserved", "lost")
_SLOT_STATS = (
    "spill_txns",
    "spill_count",
    "spill_bytes",
    "stream_txns",
    "stream_count",
    "stream_bytes",
    "total_txns",
    "total_bytes",
)


@dataclass
class CatalogPoller:
    """Polls every ``POLL_EVERY_S`` on a thread of its own until stopped; an error ends
    the thread and is kept in ``error`` for the socket loop to raise (the session ends,
    as with any other)."""

    conn: psycopg.Connection[tuple[object, ...]]
    slot: str
    publication: str
    metrics: BridgeMetrics
    publisher: Publisher
    queue: TxnQueue
    error: BaseException | None = field(default=None, init=False)
    # Tables this session asked to snapshot.
    _requested: set[TableName] = field(default_factory=set, init=False)
    _stopping: threading.Event = field(default_factory=threading.Event, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="catalog-poller", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """End the thread; waits for a poll under way at most ``timeout_s``."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                self._slot_stats()
                if self.publisher.snapshots.snapshot_added:
                    missing = self._added_tables()
                    if missing:
                        self.queue.put(SnapshotRequest(tuple(missing)))
                        self._requested.update(missing)
                if self._stopping.wait(POLL_EVERY_S):
                    return
        except BaseException as exc:
            self.error = exc

    def _added_tables(self) -> list[TableName]:
        """Published tables missing from Kafka that this session has not asked to snapshot
        yet; none this round if a table's lock is held (asked again next round)."""
        try:
            published = published_tables(self.conn, self.publication)
        except psycopg.errors.LockNotAvailable:
            log_event(
                log,
                logging.INFO,
                "publication check skipped: a published table is "
                "locked (DDL running?); checking again shortly",
            )
            return []
        return [
            p.name
            for p in published
            if self.publisher.snapshots.is_missing(p.name) and p.name not in self._requested
        ]

    def _slot_stats(self) -> None:
        with self.conn.cursor() as cur:
            # How close the slot is to invalidation (max_slot_wal_keep_size): alerts fire on
            # these before the WAL it needs is removed.
            cur.execute(
                "SELECT wal_status, safe_wal_size FROM pg_replication_slots WHERE slot_name = %s",
                (self.slot,),
            )
            reserve = cur.fetchone()
            cur.execute(
                f"SELECT {', '.join(_SLOT_STATS)} FROM pg_stat_replication_slots "
                "WHERE slot_name = %s",
                (self.slot,),
            )
            row = cur.fetchone()
        if reserve is not None:
            status, safe = reserve
            for known in _WAL_STATUSES:
                self.metrics.wal_status.labels(self.slot, known).set(int(status == known))
            self.metrics.safe_wal_bytes.set(math.inf if safe is None else float(str(safe)))
        if row is not None:
            for name, value in zip(_SLOT_STATS, row, strict=True):
                self.metrics.slot_stats.labels(self.slot, name).set(float(str(value or 0)))
