"""The publisher against an in-memory Kafka and origin: the exactly-once rules of
ARCHITECTURE.md, checked on what ends up in Kafka and in the origin.

- a transaction at or below the high-water mark is a replay: dropped, but its relation
  descriptions are learnt;
- a batch is one Kafka transaction with its progress record; the origin advances only
  after Kafka committed it, and the slot may be confirmed only after that;
- a crash in any window is covered by ``high_water(origin, Kafka progress)`` on restart:
  every transaction ends up in Kafka exactly once;
- streamed transactions lose only their aborted subtransactions' changes; aborted and
  rolled-back transactions publish nothing; a PREPARE holds the slot back until its
  COMMIT PREPARED is in Kafka;
- a COMMIT PREPARED above the high-water mark without its content is a gap, refused.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.bridge.assemble.assembler import Transaction
from services.bridge.assemble.spool import Spool, SpoolStats
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder
from services.bridge.metrics import BridgeMetrics
from services.bridge.progress.confirm import ConfirmTracker
from services.bridge.progress.highwater import ServerIdentity, high_water
from services.bridge.publish import publisher as publisher_module
from services.bridge.publish import snapshots as snapshots_module
from services.bridge.publish.publisher import GapError, Publisher, TxnQueue
from services.bridge.records.catalog import RelationCatalog
from services.bridge.records.default import DefaultEventBuilder
from services.bridge.settings import BridgeSettings
from services.bridge.snapshot.chunks import TableName, XidSnapshot
from services.bridge.snapshot.reader import WATERMARK, Chunk, SnapshotBook
from services.common import failpoints
from services.common.failpoints import FailpointError
from tests.unit.memory import Journal, MemoryOrigin, MemorySink
from tests.unit.replication import TS, Source

SLOT = "s1"
TOPIC = "app.public.accounts"
IDENTITY = ServerIdentity("7301", 1)
ACCOUNTS = m.Relation(
    None,
    16_401,
    "public",
    "accounts",
    "d",
    (m.Column("id", 20, -1, True), m.Column("v", 25, -1, False)),
)


def ins(key: int, xid: int | None = None) -> m.Insert:
    return m.Insert(xid, 16_401, [str(key), f"v{key}"])


class Kafka:
    """What survives a bridge's crash: Kafka and the origin (and the journal of both)."""

    def __init__(self) -> None:
        self.journal: Journal = []
        self.settings = BridgeSettings(
            source_dsn="host=a",
            kafka_bootstrap="k:9092",
            slot_name=SLOT,
            topic_prefix="app",
            batch_linger_ms=0,
        )
        self.sink = MemorySink(self.settings.progress_topic, self.journal)
        self.origin = MemoryOrigin(self.journal)

    def high_water(self) -> int:
        """What a new session starts from."""
        return high_water(self.origin.lsn, self.sink.progress())

    def keys(self) -> list[int]:
        """The ``id`` of every change record committed to the table's topic."""
        return [json.loads(k)["id"] for _, k, v, _ in self.sink.records(TOPIC) if k and v]


def publish(
    kafka: Kafka,
    txns: list[Transaction],
    *,
    tracker: ConfirmTracker | None = None,
    batch_max_events: int = 20_000,
    book: SnapshotBook | None = None,
    published: Callable[[], set[TableName]] | None = None,
) -> Publisher:
    """One session's publisher, run on this thread until it has published ``txns``."""
    queue = TxnQueue(1 << 30)
    for txn in txns:
        queue.put(txn)
    queue.stop()
    publisher = session(kafka, queue, tracker, batch_max_events, book, published)
    publisher.run()
    return publisher


def session(
    kafka: Kafka,
    queue: TxnQueue,
    tracker: ConfirmTracker | None = None,
    batch_max_events: int = 20_000,
    book: SnapshotBook | None = None,
    published: Callable[[], set[TableName]] | None = None,
    receiving: Callable[[], bool] = lambda: False,
) -> Publisher:
    """A publisher that starts from what Kafka and the origin hold, as the daemon's
    session does; given ``published`` (the publication's tables), tables missing from
    Kafka get snapshots; ``receiving``: whether a transaction is on its way in."""
    replay = PgOutputDecoder(4)
    mark = kafka.high_water()
    return Publisher(
        settings=kafka.settings.model_copy(update={"batch_max_events": batch_max_events}),
        sink=kafka.sink,
        origin=kafka.origin,
        builder=DefaultEventBuilder(
            RelationCatalog("app", lambda oid: None), "app", "shop", 1 << 20
        ),
        tracker=tracker or ConfirmTracker(0),
        identity=IDENTITY,
        high_water=mark,
        last_commit_lsn=mark,
        queue=queue,
        decode=lambda payload, streamed: replay.decode(payload, streamed),
        metrics=BridgeMetrics(SLOT, SpoolStats()),
        book=book or SnapshotBook(),
        snapshot_added=published is not None,
        published=published or set,
        receiving=receiving,
    )


@pytest.fixture
def crash_at(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Arm a failpoint (``name``, on its ``nth`` pass) to raise, as a crash would stop us.

    The publisher bound ``failpoint`` at import to the empty function of an unarmed
    process; arming swaps in the real one, as starting with ``SLOTBRIDGE_FAILPOINTS`` would.
    """

    def arm(name: str, nth: int = 1) -> None:
        monkeypatch.setattr(failpoints, "_POINTS", {name: (nth, "error")})
        monkeypatch.setattr(failpoints, "_HITS", {})
        monkeypatch.setattr(publisher_module, "failpoint", failpoints._fire)
        monkeypatch.setattr(snapshots_module, "failpoint", failpoints._fire)

    yield arm


def test_a_batch_is_one_kafka_transaction_with_its_progress(tmp_path: Path) -> None:
    source, kafka = Source(tmp_path), Kafka()
    source.commit(700, ACCOUNTS, ins(1), ins(2))
    last = source.commit(701, ins(3))
    publisher = publish(kafka, source.sealed)
    assert publisher.error is None
    (txn,) = kafka.sink.transactions
    assert [r[0] for r in txn] == [
        "app.transaction",
        "app.schema",
        TOPIC,
        TOPIC,
        "app.transaction",
        "app.transaction",
        TOPIC,
        "app.transaction",
        kafka.settings.progress_topic,
    ]
    assert kafka.keys() == [1, 2, 3]
    progress = kafka.sink.progress()
    assert progress is not None
    assert (progress.slot, progress.end_lsn, progress.commit_lsn) == (
        SLOT,
        last.end_lsn,
        last.commit_lsn,
    )
    assert (progress.system_identifier, progress.timeline) == ("7301", 1)
    assert kafka.origin.lsn == last.end_lsn


def test_the_origin_advances_only_after_kafka_committed(tmp_path: Path) -> None:
    source, kafka = Source(tmp_path), Kafka()
    ends = [
        source.commit(700 + n, *([ACCOUNTS] if n == 0 else []), ins(n)).end_lsn for n in range(3)
    ]
    tracker = ConfirmTracker(0)
    publish(kafka, source.sealed, tracker=tracker, batch_max_events=1)
    assert kafka.journal == [
        event for end in ends for event in (("kafka commit", end), ("origin", end))
    ]
    assert tracker.confirmable() == ends[-1]


def test_a_replay_at_or_below_the_high_water_mark_is_dropped(tmp_path: Path) -> None:
    source, kafka = Source(tmp_path), Kafka()
    first = source.commit(700, ACCOUNTS, ins(1))
    publish(kafka, [first])
    # The next session: the slot sends the transaction again (it was not confirmed yet),
    # and the relation is described only there - later transactions rely on it.
    again = Source(tmp_path, start=0x1000)
    replay = again.commit(700, ACCOUNTS, ins(1))
    later = again.commit(701, ins(2))
    assert replay.end_lsn == first.end_lsn
    tracker = ConfirmTracker(0)
    publisher = publish(kafka, [replay, later], tracker=tracker)
    assert publisher.error is None
    assert kafka.keys() == [1, 2]
    assert kafka.origin.lsn == tracker.confirmable() == later.end_lsn


def test_only_a_replay_is_dropped_not_the_transaction_after_it(tmp_path: Path) -> None:
    source, kafka = Source(tmp_path), Kafka()
    kafka.origin.lsn = source.commit(700, ACCOUNTS, ins(1)).end_lsn
    tracker = ConfirmTracker(0)
    source.commit(701, ins(2))
    publish(kafka, source.sealed, tracker=tracker)
    assert kafka.keys() == [2]


@pytest.mark.parametrize(
    "window", ["after_produce", "before_kafka_commit", "after_kafka_commit", "after_origin_advance"]
)
def test_a_crash_in_any_window_publishes_every_transaction_once(
    tmp_path: Path, crash_at: Any, window: str
) -> None:
    """The second batch dies in ``window``; the next session, started from what Kafka and
    the origin hold, gets the slot's resend of everything not confirmed."""
    # Each describes the table: the resend is a new session, and the server describes a
    # table again before its first change in a session.
    source, kafka = Source(tmp_path), Kafka()
    for n in range(3):
        source.commit(700 + n, ACCOUNTS, ins(n + 1))
    sent = list(source.sealed)
    tracker = ConfirmTracker(0)
    crash_at(window, 2)
    crashed = publish(kafka, sent, tracker=tracker, batch_max_events=1)
    assert isinstance(crashed.error, FailpointError)
    # Nothing past the first batch may be confirmed to the slot.
    confirmed = tracker.confirmable()
    assert confirmed == sent[0].end_lsn
    crash_at("after_chunk", 99)  # disarmed
    resent = Source(tmp_path)
    for n in range(3):
        resent.commit(700 + n, ACCOUNTS, ins(n + 1))
    assert [t.end_lsn for t in resent.sealed] == [t.end_lsn for t in sent]
    # The slot resends from the confirmed position on (a transaction ending after it).
    replayed = [t for t in resent.sealed if t.end_lsn > confirmed]
    again = publish(kafka, replayed, tracker=ConfirmTracker(0))
    assert again.error is None
    assert kafka.keys() == [1, 2, 3]
    assert kafka.origin.lsn == sent[-1].end_lsn


def test_a_streamed_transaction_loses_only_its_aborted_subtransaction(tmp_path: Path) -> None:
    source, kafka = Source(tmp_path), Kafka()
    source.stream(801, m.Relation(801, *_fields(ACCOUNTS)), ins(1, 801), ins(2, 901))
    source.commit(700, ACCOUNTS, ins(10))  # committed while 801 streams: published first
    source.stream(801, ins(3, 902))
    source.send(m.StreamAbort(801, 901, None, None))
    source.stream_commit(801)
    source.stream(802, ins(4, 802))
    source.send(m.StreamAbort(802, 802, None, None))  # the whole transaction rolled back
    publisher = publish(kafka, source.sealed)
    assert publisher.error is None
    assert kafka.keys() == [10, 1, 3]
    (end,) = [json.loads(v) for t, _, v, _ in kafka.sink.records("app.transaction") if v][-1:]
    assert end["status"] == "END" and end["event_count"] == 2


def test_a_relation_described_in_an_aborted_subtransaction_still_applies(tmp_path: Path) -> None:
    source, kafka = Source(tmp_path), Kafka()
    source.stream(801, m.Relation(901, *_fields(ACCOUNTS)), ins(1, 901), ins(2, 801))
    source.send(m.StreamAbort(801, 901, None, None))
    source.stream_commit(801)
    publisher = publish(kafka, source.sealed)
    assert publisher.error is None
    assert kafka.keys() == [2]


def test_a_prepared_transaction_holds_the_slot_until_it_is_in_kafka(tmp_path: Path) -> None:
    tracker = ConfirmTracker(0)
    source, kafka = Source(tmp_path, tracker.prepared, tracker.finished), Kafka()
    prepare_lsn = source.prepare(700, "g1", ACCOUNTS, ins(1))
    other = source.commit(701, ACCOUNTS, ins(2))
    publish(kafka, [other], tracker=tracker)
    assert kafka.origin.lsn == other.end_lsn  # Kafka holds 701 ...
    assert tracker.confirmable() == prepare_lsn - 1  # ... but the slot keeps g1's content
    committed = source.commit_prepared(700, "g1")
    publish(kafka, [committed], tracker=tracker)
    assert kafka.keys() == [2, 1]
    assert tracker.confirmable() == committed.end_lsn


def test_a_rolled_back_prepared_transaction_publishes_nothing(tmp_path: Path) -> None:
    tracker = ConfirmTracker(0)
    source, kafka = Source(tmp_path, tracker.prepared, tracker.finished), Kafka()
    source.prepare(700, "g1", ACCOUNTS, ins(1))
    source.send(m.RollbackPrepared(0, source.lsn, source.lsn + 8, TS, TS, 700, "g1"))
    last = source.commit(701, ACCOUNTS, ins(2))
    publish(kafka, source.sealed, tracker=tracker)
    assert kafka.keys() == [2]
    assert tracker.confirmable() == last.end_lsn


def test_a_commit_prepared_already_published_is_skipped(tmp_path: Path) -> None:
    """Its content went by before the start position because it is in Kafka already."""
    tracker = ConfirmTracker(0)
    source, kafka = Source(tmp_path), Kafka()
    committed = source.commit_prepared(700, "g1")
    kafka.origin.lsn = committed.end_lsn
    tracker.prepared("g1", committed.commit_lsn - 0x40)
    publisher = publish(kafka, [committed], tracker=tracker)
    assert publisher.error is None and kafka.sink.transactions == []
    assert tracker.confirmable() == committed.end_lsn  # no longer held by g1


def test_a_commit_prepared_without_its_content_is_a_gap(tmp_path: Path) -> None:
    source, kafka = Source(tmp_path), Kafka()
    source.commit(700, ACCOUNTS, ins(1))
    source.commit_prepared(701, "g1")  # its PREPARE was never received
    tracker = ConfirmTracker(0)
    publisher = publish(kafka, source.sealed, tracker=tracker)
    assert isinstance(publisher.error, GapError)
    assert "COMMIT PREPARED 'g1' arrived without its PREPARE content" in str(publisher.error)
    # The open batch (with 700) was aborted: nothing reached Kafka, nothing is confirmed.
    assert kafka.sink.transactions == [] and kafka.origin.lsn == 0
    assert tracker.confirmable() == 0


def test_an_idle_publisher_commits_nothing(tmp_path: Path) -> None:
    kafka = Kafka()
    publisher = publish(kafka, [])
    assert publisher.error is None
    assert kafka.sink.transactions == [] and kafka.journal == []


def test_a_table_new_to_kafka_is_snapshotted_from_its_first_description(tmp_path: Path) -> None:
    """A table added to the publication: its snapshot starts before the transaction that
    first describes it is built, so its changes there are watched, and a chunk read
    before them does not publish a row the stream already carried."""
    source, kafka = Source(tmp_path), Kafka()
    asked: list[None] = []

    def published() -> set[TableName]:
        asked.append(None)
        return {("public", "accounts")}

    book, queue = SnapshotBook(), TxnQueue(1 << 30)
    publisher = session(kafka, queue, book=book, published=published)
    publisher.start()
    queue.put(source.commit(700, ACCOUNTS, ins(1), ins(3)))
    # A chunk reader's part: it gets the table once its snapshot is requested, and reads
    # a chunk in a snapshot that does not see transaction 700.
    state = book.claim(timeout=30)
    assert state is not None and (state.schema_, state.table, state.id) == (
        "public",
        "accounts",
        "added",
    )
    chunk = Chunk(
        token="c1",
        table=("public", "accounts"),
        relation=ACCOUNTS,
        rows=[["1", "stale"], ["2", "v2"]],
        keyed=True,
        xmins=None,
        snapshot=XidSnapshot(700, 701, frozenset({700})),
        start=None,
        cursor=["2"],
        last=True,
        estimate=2,
    )
    assert book.offer(chunk)
    book.release(chunk.table)
    mark = json.dumps({"slot": SLOT, "chunk": "c1"}).encode()
    watermark = source.commit(701, m.LogicalMessage(None, True, source.lsn, WATERMARK, mark))
    queue.put(watermark)
    queue.stop()
    publisher.join(30)
    assert not publisher.is_alive() and publisher.error is None
    # Row 1 of the chunk is older than what the stream published: dropped.
    assert kafka.keys() == [1, 3, 2]
    rows = [json.loads(v) for _, _, v, _ in kafka.sink.records(TOPIC) if v]
    assert [r["op"] for r in rows] == ["c", "c", "r"]
    assert book.tables() == [] and kafka.origin.lsn == watermark.end_lsn
    assert len(asked) == 1  # the publication is asked once per table, not per change


def test_a_table_the_publication_leaves_out_gets_no_snapshot(tmp_path: Path) -> None:
    """A partition described next to the root the publication publishes it as."""
    source, kafka = Source(tmp_path), Kafka()
    source.commit(700, ACCOUNTS, ins(1))
    book = SnapshotBook()
    publish(kafka, source.sealed, book=book, published=set)
    assert book.tables() == [] and kafka.keys() == [1]


def _fields(rel: m.Relation) -> tuple[Any, ...]:
    """A relation's fields after its xid (to describe it inside a streamed transaction)."""
    return (rel.oid, rel.namespace, rel.name, rel.replica_identity, rel.columns)


def test_a_batch_waits_for_a_transaction_on_its_way_in(tmp_path: Path) -> None:
    # Under backlog the queue is empty only while the next transaction arrives: committing
    # then would make a Kafka transaction per source transaction. (Were the publisher too
    # slow to take the first one before the second came, the test would pass without the
    # rule; it cannot fail with it.)
    source, kafka = Source(tmp_path), Kafka()
    first = source.commit(700, ACCOUNTS, ins(1))
    second = source.commit(701, ins(2))
    arriving = threading.Event()
    arriving.set()
    queue = TxnQueue(1 << 30)
    publisher = session(kafka, queue, receiving=arriving.is_set)
    publisher.start()
    queue.put(first)
    time.sleep(0.1)  # the publisher takes it and finds the queue empty
    queue.put(second)
    arriving.clear()
    queue.stop()
    publisher.join()
    assert publisher.error is None
    assert len(kafka.sink.transactions) == 1
    assert kafka.keys() == [1, 2]


def test_a_backlog_of_small_transactions_fills_the_queue(tmp_path: Path) -> None:
    # The bound is on memory, not on payload bytes: one-row transactions of 20 bytes fill
    # it long before their payload would (a thousand of them are a third of the bound).
    queue = TxnQueue(60_000)
    stats = SpoolStats()
    for xid in range(1, 1001):
        spool = Spool(tmp_path, str(xid), 1 << 20, stats)
        spool.append(xid, bytes(20))
        queue.put(Transaction(xid, xid, xid, 0, spool, False, frozenset()))
        if queue.full:
            break
    assert queue.full and xid < 100, xid
    while not queue.empty:
        queue.get(0)
    assert not queue.full


def test_a_put_wakes_a_waiting_get(tmp_path: Path) -> None:
    """A put wakes the publisher only when it waits: one that waits gets the transaction
    as it comes, not at the end of its wait, and the queue counts it out again."""
    queue = TxnQueue(1 << 30)
    spool = Spool(tmp_path, "1", 1 << 20, SpoolStats())
    spool.append(1, bytes(20))
    txn = Transaction(1, 1, 1, 0, spool, False, frozenset())
    got: list[object] = []
    waited = 600.0  # far longer than a put takes to arrive, whatever the load
    began = time.monotonic()
    taker = threading.Thread(target=lambda: got.append(queue.get(waited)))
    taker.start()
    while not queue._waiting:  # the put must find it waiting
        time.sleep(0.001)
    queue.put(txn)
    taker.join()
    assert got == [txn]
    assert time.monotonic() - began < waited / 2, "the put did not wake the waiting get"
    assert queue.empty and not queue.full and queue.get(0) is None
