"""The publisher thread: sealed transactions in, Kafka transactions out, then progress.

The socket loop must never wait for Kafka (the server would time the walsender out), so
sealed transactions cross to this thread through ``TxnQueue``, which is bounded by the
memory their spools hold; the socket loop stops reading while it is full.

For each batch: produce every record, then the progress record, commit the Kafka
transaction, advance the replication origin, and only then let the socket loop confirm
the position to the slot. A crash between any two steps is covered by the high-water
mark on restart; the failpoints below let tests crash in each window on purpose.

A table published but not yet in Kafka (added to the publication after the initial
snapshot) is snapshotted here, in stream order, inside the open batch: when the socket
loop asks (``SnapshotRequest``) or when the stream first describes it, whichever comes
first. ``coverage.py`` then drops the stream's changes that snapshot already holds.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from services.bridge import messages as m
from services.bridge.assembler import OVERSIZED, Transaction, oversized
from services.bridge.coverage import SnapshotCoverage, TableName
from services.bridge.decoder import DecodeError
from services.bridge.events import EventBuilder
from services.bridge.metrics import BridgeMetrics
from services.bridge.progress import (
    ConfirmTracker,
    OriginStore,
    ServerIdentity,
    progress_key,
    progress_value,
)
from services.bridge.settings import BridgeSettings
from services.bridge.sink import KafkaSink
from services.common.failpoints import failpoint
from services.common.logs import log_event

log = logging.getLogger(__name__)

_STOP = object()
# An idle bridge asks Kafka this often whether another bridge fenced it: without it a fenced
# bridge with nothing to publish would hold the slot - and keep its successor waiting - until
# the next change.
HEARTBEAT_S = 5.0


class GapError(Exception):
    """A transaction we must publish arrived without its content: refuse to paper over it."""


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    """Published tables the socket loop found missing from Kafka."""

    tables: tuple[TableName, ...]


class TxnQueue:
    """FIFO of sealed transactions (and snapshot requests, which keep their place in the
    stream), 'full' when the transactions' spools hold too much memory."""

    def __init__(self, max_bytes: int) -> None:
        self._items: collections.deque[object] = collections.deque()
        self._cond = threading.Condition()
        self._bytes = 0
        self._max = max_bytes

    @property
    def full(self) -> bool:
        return self._bytes >= self._max

    @property
    def empty(self) -> bool:
        return not self._items

    def put(self, item: Transaction | SnapshotRequest) -> None:
        with self._cond:
            self._items.append(item)
            if isinstance(item, Transaction):
                self._bytes += item.spool.size
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._items.append(_STOP)
            self._cond.notify()

    def get(self, timeout: float) -> object | None:
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            if not self._items:
                return None
            item = self._items.popleft()
            if isinstance(item, Transaction):
                self._bytes -= item.spool.size
            return item


@dataclass
class _Batch:
    started: float
    events: int = 0
    last: Transaction | None = None
    snapshotted: list[TableName] = field(default_factory=list)


Decode = Callable[[bytes, bool], m.Message]


class TableSnapshots(Protocol):
    def take(self, tables: Sequence[TableName]) -> tuple[int, list[TableName]]:
        """Snapshot ``tables`` into the open Kafka transaction; returns the snapshot's
        consistent point and the tables it read: those the publication publishes."""

    def published(self, tables: Sequence[TableName]) -> None:
        """Their Kafka transaction committed."""


class Publisher(threading.Thread):
    def __init__(self, *, settings: BridgeSettings, sink: KafkaSink, origin: OriginStore,
                 builder: EventBuilder, tracker: ConfirmTracker, identity: ServerIdentity,
                 high_water: int, last_commit_lsn: int, queue: TxnQueue, decode: Decode,
                 metrics: BridgeMetrics, coverage: SnapshotCoverage | None = None,
                 snapshots: TableSnapshots | None = None) -> None:
        """Without ``coverage`` no table is ever snapshotted here (``snapshot_mode: never``,
        or a FOR ALL TABLES publication, whose new tables stream from their creation)."""
        super().__init__(name="publisher", daemon=True)
        self._settings = settings
        self._sink = sink
        self._origin = origin
        self._builder = builder
        self._tracker = tracker
        self._identity = identity
        self.high_water = high_water
        self._last_commit_lsn = last_commit_lsn
        self._queue = queue
        self._decode = decode
        self._metrics = metrics
        self._coverage = coverage
        self._snapshots = snapshots
        # Tables the stream described that the publication does not publish: the
        # partitions a change went through, described next to the root that
        # publish_via_partition_root publishes them as. Asked about once per session.
        self._not_published: set[TableName] = set()
        self._gids: list[str] = []
        self.error: BaseException | None = None
        self.last_commit_ts = 0  # µs since 2000 of the last published transaction
        self._committed_at = 0.0  # monotonic; 0: first thing, prove we are not fenced

    def stop(self) -> None:
        """Finish the open batch (commit it) and end the thread."""
        self._queue.stop()

    def run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:
            self.error = exc
            self._sink.abort()

    def _loop(self) -> None:
        max_s = self._settings.batch_max_ms / 1000
        batch: _Batch | None = None
        while True:
            wait = max_s if batch is None else max(0.0, batch.started + max_s - time.monotonic())
            item = self._queue.get(wait)
            if item is _STOP:
                if batch is not None:
                    self._commit(batch)
                return
            if isinstance(item, SnapshotRequest):
                assert self._coverage is not None
                missing = self._coverage.missing(item.tables)
                if missing:
                    batch = batch or self._begin()
                    self._snapshot(missing, batch)
            elif isinstance(item, Transaction) and not self._skip(item):
                batch = batch or self._begin()
                batch.events += self._publish(item, batch)
                batch.last = item
                failpoint("after_produce")
            if batch is not None and (batch.events >= self._settings.batch_max_events
                                      or time.monotonic() - batch.started >= max_s):
                self._commit(batch)
                batch = None
            if batch is None and time.monotonic() - self._committed_at >= HEARTBEAT_S:
                self._sink.prove_not_fenced()
                self._committed_at = time.monotonic()

    def _begin(self) -> _Batch:
        self._sink.begin()
        return _Batch(time.monotonic())

    def _skip(self, txn: Transaction) -> bool:
        if txn.end_lsn > self.high_water:
            if txn.gid is not None and txn.prepare_lsn is None:
                raise GapError(
                    f"COMMIT PREPARED '{txn.gid}' arrived without its PREPARE content, past "
                    "the published position: refusing to skip it; check the slot's two_phase "
                    "history and re-snapshot the affected tables")
            return False
        # The server sends a relation's description once per session, possibly inside a
        # transaction we skip; later transactions rely on it, so learn it anyway.
        for _lsn, payload in txn.spool:
            if payload[0] == 0x52:  # 'R'
                relation = self._decode(payload, txn.streamed)
                assert isinstance(relation, m.Relation)
                self._builder.catalog.apply(relation)
        txn.spool.discard()
        self._tracker.published(txn.end_lsn)
        if txn.gid is not None:
            self._tracker.finished(txn.gid)
        self._metrics.skipped.inc()
        return True

    def _publish(self, txn: Transaction, batch: _Batch) -> int:
        sink = self._sink
        count = 0
        try:
            for topic, key, value in self._builder.transaction(
                    txn.xid, txn.commit_lsn, txn.commit_ts, self._changes(txn, batch)):
                if topic not in sink.known_topics:
                    sink.ensure_topics({topic: topic == self._builder.schema_topic})
                sink.produce(topic, key, value)
                count += 1
        finally:
            txn.spool.discard()
        if txn.gid is not None:
            self._gids.append(txn.gid)
        self.last_commit_ts = txn.commit_ts
        self._metrics.transactions.inc()
        return count

    def _changes(self, txn: Transaction, batch: _Batch) -> Iterator[tuple[int, m.Message]]:
        decode = self._decode
        streamed = txn.streamed
        aborted = txn.aborted_subxids
        coverage = self._coverage
        relation = m.Relation
        for lsn, payload in txn.spool:
            # A relation described inside an aborted subtransaction still describes it for
            # the rest of the transaction: the server will not send it again.
            if aborted and payload[0] != 0x52 and int.from_bytes(payload[1:5], "big") in aborted:
                continue
            try:
                msg = decode(payload, streamed)
            except DecodeError:
                # The assembler's stand-in for a change too large to publish is no pgoutput
                # message: found here, off the path every other message takes.
                if payload[0] == OVERSIZED:
                    self._builder.refuse_oversized(lsn, *oversized(payload, streamed))
                raise
            if coverage is not None:
                if msg.__class__ is relation:
                    name = (msg.namespace, msg.name)
                    if not coverage.covers(name) and name not in self._not_published:
                        # The stream describes a table before its first change: the last
                        # moment to snapshot it ahead of that change. The snapshot's
                        # records go into the open batch, before this transaction's.
                        self._snapshot([name], batch)
                elif coverage.dropping:
                    kept = self._not_in_snapshot(msg, txn.commit_lsn, coverage)
                    if kept is None:
                        continue
                    msg = kept
            yield lsn, msg

    def _not_in_snapshot(self, msg: m.Message, commit_lsn: int,
                         coverage: SnapshotCoverage) -> m.Message | None:
        """``msg`` less what a snapshot taken after ``commit_lsn`` already holds."""
        by_oid = self._builder.catalog.by_oid
        if isinstance(msg, m.Insert | m.Update | m.Delete):
            info = by_oid[msg.relation_oid]
            return None if coverage.drops((info.schema, info.table), commit_lsn) else msg
        if isinstance(msg, m.Truncate):
            oids = tuple(oid for oid in msg.relation_oids
                         if not coverage.drops((by_oid[oid].schema, by_oid[oid].table),
                                               commit_lsn))
            return replace(msg, relation_oids=oids) if oids else None
        return msg

    def _snapshot(self, tables: Sequence[TableName], batch: _Batch) -> None:
        assert self._coverage is not None and self._snapshots is not None
        point, read = self._snapshots.take(tables)
        self._not_published.update(set(tables) - set(read))
        self._coverage.add(read, point)
        batch.snapshotted.extend(read)

    def _commit(self, batch: _Batch) -> None:
        last = batch.last
        end_lsn = last.end_lsn if last is not None else self.high_water
        if last is not None:
            self._last_commit_lsn = last.commit_lsn
        pending = []
        if self._coverage is not None:
            # Every later transaction ends past end_lsn: points at or below it are done.
            self._coverage.settle(end_lsn)
            pending = self._coverage.pending()
        self._sink.produce(self._settings.progress_topic, progress_key(self._settings.slot_name),
                           progress_value(self._settings.slot_name, end_lsn,
                                          self._last_commit_lsn, self._identity, pending))
        failpoint("before_kafka_commit")
        seconds = self._sink.commit()
        self._committed_at = time.monotonic()
        failpoint("after_kafka_commit")
        self._origin.advance(end_lsn)
        failpoint("after_origin_advance")
        self.high_water = end_lsn
        self._tracker.published(end_lsn)
        for gid in self._gids:
            self._tracker.finished(gid)
        self._gids.clear()
        self._metrics.kafka_commit.observe(seconds)
        self._metrics.events.inc(batch.events)
        self._metrics.published_lsn.set(end_lsn)
        if batch.snapshotted:
            log_event(log, logging.INFO, "snapshot of added tables published",
                      tables=[f"{s}.{t}" for s, t in batch.snapshotted])
            assert self._snapshots is not None
            self._snapshots.published(batch.snapshotted)
            failpoint("after_snapshot_commit")
        log_event(log, logging.DEBUG, "batch committed", events=batch.events,
                  end_lsn=end_lsn, kafka_commit_s=round(seconds, 4))
