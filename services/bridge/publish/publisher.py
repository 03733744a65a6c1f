"""The publisher thread: sealed transactions in, Kafka transactions out, then progress.

The socket loop must never wait for Kafka (the server would time the walsender out), so
sealed transactions cross to this thread through ``TxnQueue``, which is bounded by the
memory their spools hold; the socket loop stops reading while it is full.

For each batch: produce every record, then the progress record, commit the Kafka
transaction, advance the replication origin, and only then let the socket loop confirm
the position to the slot. A crash between any two steps is covered by the high-water
mark on restart; the failpoints below let tests crash in each window on purpose.

Snapshots meet the stream here, in stream order (``snapshots.StreamSnapshots``: chunks at
their watermarks, signals, tables added to the publication). The progress record of every
batch carries how far each snapshot got.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from services.bridge.assemble.assembler import Transaction
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import is_relation, streamed_xid
from services.bridge.metrics import BridgeMetrics
from services.bridge.progress.confirm import ConfirmTracker
from services.bridge.progress.highwater import ServerIdentity
from services.bridge.progress.record import progress_key, progress_value
from services.bridge.publish.snapshots import Decode, StreamSnapshots
from services.bridge.receive.stream import now_pg_us
from services.bridge.records.events import EventBuilder, Record, Undecoded
from services.bridge.settings import BridgeSettings
from services.bridge.snapshot.chunks import TableName
from services.bridge.snapshot.reader import SnapshotBook
from services.common.errors import SlotbridgeError
from services.common.failpoints import failpoint
from services.common.logs import log_event

log = logging.getLogger(__name__)

_STOP = object()
# An idle bridge asks Kafka this often whether another bridge fenced it: without it a fenced
# bridge with nothing to publish would hold the slot - and keep its successor waiting - until
# the next change.
HEARTBEAT_S = 5.0


class Sink(Protocol):
    """What the publisher needs of Kafka: one transaction at a time, whose records become
    visible together at ``commit`` (``sink.KafkaSink``; tests use one in memory)."""

    def begin(self) -> None: ...

    def produce(self, topic: str, key: bytes | None, value: bytes | None) -> None: ...

    def produce_all(self, records: Iterable[Record], compacted: Container[str]) -> int:
        """Produce each record (creating topics as needed; ``compacted``: those to create
        compacted); returns how many."""
        ...

    def commit(self) -> float:
        """Commit the open transaction; returns the seconds it took."""
        ...

    def abort(self) -> None: ...

    def prove_not_fenced(self) -> None:
        """Raise if another bridge took this slot's transactional id."""
        ...

    def topic_ids(self) -> dict[str, str]:
        """Topic name -> Kafka topic id of every topic written (``sink.topics.TopicIds``)."""
        ...


class OriginProgress(Protocol):
    """Where PostgreSQL records how far Kafka holds the stream (``origin.OriginStore``,
    the replication origin; tests use one in memory)."""

    def advance(self, lsn: int) -> None: ...


class GapError(SlotbridgeError):
    """A transaction we must publish arrived without its content: refuse to paper over it."""

    retryable = False  # the server will not send the content again


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    """Published tables the socket loop found missing from Kafka."""

    tables: tuple[TableName, ...]


# What a queued transaction holds besides its payload bytes (tracemalloc, CPython 3.11):
# about 1.3 KB of objects per transaction (itself, its spool, the decoded Begin and Commit)
# and about 120 B per message its spool keeps (a tuple, an int, a bytes header). Counted,
# so that the queue's bound holds for a backlog of small transactions too: counted by
# payload bytes alone, a backlog of 22k one-row transactions held about 28 MB of objects
# for about 2 MB of payload.
_TXN_OBJECTS = 1_400
_MESSAGE_OBJECTS = 120


def _held(txn: Transaction) -> int:
    return txn.spool.size + _TXN_OBJECTS + _MESSAGE_OBJECTS * txn.spool.count


class TxnQueue:
    """FIFO of sealed transactions (and snapshot requests, which keep their place in the
    stream), 'full' when the transactions hold too much memory.

    One producer (the socket loop) and one consumer (the publisher), a get per source
    transaction and a put per read of the stream: each item is kept with the bytes it
    counts for, worked out once, and a put wakes the consumer only when it waits."""

    def __init__(self, max_bytes: int) -> None:
        self._items: collections.deque[tuple[object, int]] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._bytes = 0
        self._max = max_bytes
        self._waiting = False  # the consumer waits in get (under the lock)

    @property
    def full(self) -> bool:
        return self._bytes >= self._max

    @property
    def empty(self) -> bool:
        return not self._items

    def put(self, item: Transaction | SnapshotRequest) -> None:
        held = _held(item) if isinstance(item, Transaction) else 0
        with self._cond:
            self._items.append((item, held))
            self._bytes += held
            if self._waiting:
                self._cond.notify()

    def put_all(self, txns: list[Transaction]) -> None:
        """``put`` each, under the lock once: the socket loop reads many at a time."""
        items = [(txn, _held(txn)) for txn in txns]
        with self._cond:
            self._items.extend(items)
            self._bytes += sum(held for _, held in items)
            if self._waiting:
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._items.append((_STOP, 0))
            self._cond.notify()

    def get(self, timeout: float) -> object | None:
        with self._cond:
            if not self._items:
                self._waiting = True
                try:
                    self._cond.wait(timeout)
                finally:
                    self._waiting = False
                if not self._items:
                    return None
            item, held = self._items.popleft()
            self._bytes -= held
            return item


@dataclass
class _Batch:
    started: float
    events: int = 0
    last: Transaction | None = None
    # Source commit times (µs since 2000) of the transactions published in it.
    commit_ts: list[int] = field(default_factory=list)


def _decoding(decode: Decode, streamed: bool) -> Callable[[bytes], m.Message]:
    """``decode`` for the messages of a transaction streamed or not."""
    return lambda payload: decode(payload, streamed)


# How often a publisher waiting for a transaction on its way in looks again.
_ARRIVING_POLL_S = 0.002


class Publisher(threading.Thread):
    def __init__(
        self,
        *,
        settings: BridgeSettings,
        sink: Sink,
        origin: OriginProgress,
        builder: EventBuilder,
        tracker: ConfirmTracker,
        identity: ServerIdentity,
        high_water: int,
        last_commit_lsn: int,
        queue: TxnQueue,
        decode: Decode,
        metrics: BridgeMetrics,
        book: SnapshotBook,
        snapshot_added: bool,
        published: Callable[[], set[TableName]],
        receiving: Callable[[], bool] = lambda: False,
    ) -> None:
        """``snapshot_added`` and ``published``: see ``StreamSnapshots``."""
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
        self._book = book
        # Whether the receiving thread is in the middle of a transaction the server is
        # sending: the queue is empty only for the moment it takes to arrive.
        self._receiving = receiving
        self._compacted = (builder.schema_topic,)
        self.snapshots = StreamSnapshots(
            slot_name=settings.slot_name,
            builder=builder,
            book=book,
            decode=decode,
            produce=self._produce,
            snapshot_added=snapshot_added,
            published=published,
        )
        self._gids: list[str] = []
        # What each transaction's records are built and produced with, made once rather
        # than per source transaction: how the builder decodes what it reads undecoded
        # (by whether the transaction was streamed), and the topics created compacted.
        self._undecoded = {
            streamed: Undecoded(streamed, _decoding(decode, streamed)) for streamed in (False, True)
        }
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
        # A batch is committed as soon as nothing more is ready (once it is this old) and
        # no transaction is on its way in: on a quiet stream each transaction goes out at
        # once; under backlog the next transaction is always arriving (a thousand-row one
        # takes longer to arrive than to publish), so batches grow to the budgets instead
        # of a Kafka commit per transaction; in between, what arrives while a Kafka commit
        # runs makes the next batch.
        linger_s = min(self._settings.batch_linger_ms / 1000, max_s)
        batch: _Batch | None = None
        while True:
            wait = max_s if batch is None else max(0.0, batch.started + linger_s - time.monotonic())
            if batch is not None and not wait and self._receiving():
                wait = _ARRIVING_POLL_S  # it may also end without a transaction (a PREPARE)
            item = self._queue.get(wait)
            if item is _STOP:
                if batch is not None:
                    self._commit(batch)
                return
            if isinstance(item, SnapshotRequest):
                for table in item.tables:
                    self.snapshots.add_if_missing(table)
            elif isinstance(item, Transaction) and not self._skip(item):
                batch = batch or self._begin()
                published = self.snapshots.control(item)
                if published is None:
                    batch.events += self._publish(item)
                    batch.commit_ts.append(item.commit_ts)
                    failpoint("after_produce")
                else:
                    batch.events += published
                batch.last = item
                self.snapshots.watch.committed(item.xid)
            if batch is not None:
                age = time.monotonic() - batch.started
                if (
                    batch.events >= self._settings.batch_max_events
                    or age >= max_s
                    or (age >= linger_s and self._queue.empty and not self._receiving())
                ):
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
                    "history and re-snapshot the affected tables"
                )
            return False
        # The server sends a relation's description once per session, possibly inside a
        # transaction we skip; later transactions rely on it, so learn it anyway.
        for relation in self.snapshots.relations(txn):
            self._builder.catalog.apply(relation)
        txn.spool.discard()
        self._tracker.published(txn.end_lsn)
        if txn.gid is not None:
            self._tracker.finished(txn.gid)
        self._metrics.skipped.inc()
        return True

    def _produce(self, records: Iterable[Record]) -> int:
        return self._sink.produce_all(records, self._compacted)

    def _publish(self, txn: Transaction) -> int:
        """Plan which tables need a snapshot, start those snapshots, then build and produce
        the transaction's records: while the builder pulls its messages, only the stream
        watch hears of them (a snapshot started then would change what is being built)."""
        self.snapshots.start_described(txn)
        # Messages go to the builder undecoded (it reads row changes in place, and decodes
        # the rest), unless a snapshot's watch must see them decoded.
        undecoded = None
        if self._builder.reads_undecoded and not self.snapshots.watch:
            undecoded = self._undecoded[txn.streamed]
        try:
            count = self._produce(
                self._builder.transaction(
                    txn.xid,
                    txn.commit_lsn,
                    txn.commit_ts,
                    self._changes(txn, undecoded is not None),
                    end_lsn=txn.end_lsn,
                    undecoded=undecoded,
                )
            )
        finally:
            txn.spool.discard()
        if txn.gid is not None:
            self._gids.append(txn.gid)
        self.last_commit_ts = txn.commit_ts
        return count

    def _changes(self, txn: Transaction, raw: bool) -> Iterator[tuple[int, m.Message | bytes]]:
        """The transaction's messages less its aborted subtransactions' changes: as spooled
        with ``raw`` (the spool itself when nothing is aborted), else decoded, a table being
        snapshotted having its changes noted on the way (``StreamSnapshots.note``)."""
        if raw and not txn.aborted_subxids:
            return iter(txn.spool)
        return self._filtered(txn, raw)

    def _filtered(self, txn: Transaction, raw: bool) -> Iterator[tuple[int, m.Message | bytes]]:
        streamed = txn.streamed
        aborted = txn.aborted_subxids
        # Which tables are watched changes only between transactions (see _publish).
        snapshots = self.snapshots
        watching = bool(snapshots.watch)
        relation = m.Relation
        for lsn, payload in txn.spool:
            # A relation described inside an aborted subtransaction still describes it for
            # the rest of the transaction: the server will not send it again.
            if aborted and not is_relation(payload) and streamed_xid(payload) in aborted:
                continue
            if raw:
                yield lsn, payload
                continue
            msg = self._decode(payload, streamed)
            if watching and msg.__class__ is not relation:
                snapshots.note(msg, txn.xid)
            yield lsn, msg

    def _commit(self, batch: _Batch) -> None:
        last = batch.last
        end_lsn = last.end_lsn if last is not None else self.high_water
        if last is not None:
            self._last_commit_lsn = last.commit_lsn
        self._sink.produce(
            self._settings.progress_topic,
            progress_key(self._settings.slot_name),
            progress_value(
                self._settings.slot_name,
                end_lsn,
                self._last_commit_lsn,
                self._identity,
                self._book.states(),
                self._book.ended(),
                self._sink.topic_ids(),
            ),
        )
        failpoint("before_kafka_commit")
        seconds = self._sink.commit()
        visible = now_pg_us()
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
        # A bridge clock behind the server's would make a delay negative: counted as 0.
        self._metrics.commit_to_visible.observe_until(visible, batch.commit_ts)
        self._metrics.events.inc(batch.events)
        # Counted per batch: a counter's lock per source transaction was a cost of its own.
        self._metrics.transactions.inc(len(batch.commit_ts))
        self._metrics.published_lsn.set(end_lsn)
        self.snapshots.unwatch_given_up()
        log_event(
            log,
            logging.DEBUG,
            "batch committed",
            events=batch.events,
            end_lsn=end_lsn,
            kafka_commit_s=round(seconds, 4),
        )
