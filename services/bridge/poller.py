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
import threading

import psycopg

from services.bridge.chunks import TableName
from services.bridge.metrics import BridgeMetrics
from services.bridge.publisher import Publisher, SnapshotRequest, TxnQueue
from services.bridge.source import published_tables
from services.common.logs import log_event

log = logging.getLogger(__name__)

POLL_EVERY_S = 10.0
# The poll connection's options: wait at most a second for a lock.
POLL_OPTIONS = "-c lock_timeout=1000"
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


class CatalogPoller(threading.Thread):
    """Polls every ``POLL_EVERY_S`` until stopped; an error ends the thread and is kept in
    ``error`` for the socket loop to raise (the session ends, as with any other)."""

    def __init__(
        self,
        conn: psycopg.Connection[tuple[object, ...]],
        slot: str,
        publication: str,
        metrics: BridgeMetrics,
        publisher: Publisher,
        queue: TxnQueue,
    ) -> None:
        super().__init__(name="catalog-poller", daemon=True)
        self._conn = conn
        self._slot = slot
        self._publication = publication
        self._metrics = metrics
        self._publisher = publisher
        self._queue = queue
        self._requested: set[TableName] = set()  # tables this session asked to snapshot
        self._stop = threading.Event()
        self.error: BaseException | None = None

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        try:
            while True:
                self._slot_stats()
                if self._publisher.snapshot_added:
                    missing = self._added_tables()
                    if missing:
                        self._queue.put(SnapshotRequest(tuple(missing)))
                        self._requested.update(missing)
                if self._stop.wait(POLL_EVERY_S):
                    return
        except BaseException as exc:
            self.error = exc

    def _added_tables(self) -> list[TableName]:
        """Published tables missing from Kafka that this session has not asked to snapshot
        yet; none this round if a table's lock is held (asked again next round)."""
        try:
            published = published_tables(self._conn, self._publication)
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
            if self._publisher.is_missing(p.name) and p.name not in self._requested
        ]

    def _slot_stats(self) -> None:
        with self._conn.cursor() as cur:
            cur.execute(
                f"SELECT {', '.join(_SLOT_STATS)} FROM pg_stat_replication_slots "
                "WHERE slot_name = %s",
                (self._slot,),
            )
            row = cur.fetchone()
        if row is not None:
            for name, value in zip(_SLOT_STATS, row, strict=True):
                self._metrics.slot_stats.labels(self._slot, name).set(float(str(value or 0)))
