"""The Kafka side: one transactional producer per slot, writing the sink's topics.

The ``transactional.id`` is derived from the slot, so a second bridge on the same slot
fences the first (its next commit fails with a fatal error and it stops). Keys are
partitioned Java-compatibly (murmur2) so Kafka Streams/Connect consumers co-partition.

What Kafka acknowledged must be in the log, or exactly-once is a claim, not a fact: every
broker before 4.5 can lose a producer's first request to a partition (KAFKA-15591), so the
first record to each partition is sent alone (``FirstWrites``). The topics themselves, and
their ids checked before every commit, are ``topics.Topics``'; which error caused a failure
is ``diagnosis.Diagnosis``'s, and what it means to the operator ``errors.refusal``'s.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from services.bridge.settings import BridgeSettings
from services.bridge.sink.ack_wait import REPORT_AFTER_S, AckWait
from services.bridge.sink.broker_stats import BrokerLatency, broker_latencies, brokers_of
from services.bridge.sink.diagnosis import Diagnosis, OpenTransaction
from services.bridge.sink.errors import ProducerStranded, SinkError
from services.bridge.sink.partitioner import partition_for
from services.bridge.sink.stranded import Stranding
from services.bridge.sink.topics import Topics
from services.common.kafka import KafkaLog, cause, check_reachable, explain
from services.common.logs import log_event

log = logging.getLogger(__name__)

_REACH_S = 10.0
# How long an abort waits for the coordinator before the session goes on ending; an abort
# that did not finish is called again before the next transaction.
_ABORT_S = 10.0
# How long a flush waits before the sink checks that its topics still exist (one
# DescribeTopics request): a deleted topic is noticed within about this.
_FLUSH_CHECK_S = 1.0
# Records that wait in BatchSender before they are handed over: calls with hundreds of
# records each, and a bounded copy of the records in memory.
_CHUNK = 1024
# How often librdkafka reports its statistics, which say whether the producer still knows
# a broker (``stranded``), and how long it may know none before the session gives it up:
# two reports, so that a re-bootstrap, which drops brokers and adds them again, is not one.
_STATS_MS = 5000
_STRANDED_S = 10.0
_SECURITY_HINT = (
    "kafka_bootstrap and the security settings in kafka_config (security.protocol, sasl.*, ssl.*)"
)


# The producer's batching, compression and memory settings, which kafka_config overrides.
PRODUCER_DEFAULTS: dict[str, Any] = {
    "linger.ms": 5,
    "batch.size": 1_000_000,
    "compression.type": "lz4",
    # Bounded producer memory: produce() blocks (we poll) instead of growing.
    "queue.buffering.max.messages": 200_000,
    "queue.buffering.max.kbytes": 262_144,
}


def kafka_client_config(settings: BridgeSettings) -> dict[str, Any]:
    """Connection settings shared by the producer, admin and progress consumer."""
    # librdkafka's own log lines go through Python logging (structured, level-filtered).
    config: dict[str, Any] = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "logger": KafkaLog(logging.getLogger("kafka")),
    }
    config.update(settings.kafka_config)
    if settings.kafka_sasl_password is not None:
        config["sasl.password"] = settings.kafka_sasl_password.get_secret_value()
    return config


def producer_config(settings: BridgeSettings, record_limit: int) -> dict[str, Any]:
    """The transactional producer's settings: kafka_config over the tuning defaults, and
    the exactly-once settings over both (settings validation refuses them in kafka_config)."""
    return {
        **PRODUCER_DEFAULTS,
        **kafka_client_config(settings),
        "transactional.id": settings.transactional_id,
        "transaction.timeout.ms": settings.kafka_transaction_timeout_ms,
        "enable.idempotence": True,
        "acks": "all",
        # Java clients' default: a key lands where Kafka Streams and Connect expect it.
        "partitioner": "murmur2_random",
        "message.max.bytes": max(record_limit, 1_000_000),
        # A topic deleted under the bridge must not come back from its own metadata
        # requests, with the broker's defaults instead of the settings Topics gives it
        # (a progress topic not compacted): the bridge creates every topic it writes.
        "allow.auto.create.topics": False,
    }


class FirstWrites:
    """Which partitions this producer has written: the guard against KAFKA-15591.

    A broker that holds no state for a producer on a partition accepts any first sequence
    from it. When the producer's first request there fails retriably (NOT_LEADER_OR_FOLLOWER
    while the broker applies the partition's creation) and a later request is already in
    flight, the later one is stored and the first, retried, is taken for a duplicate: its
    records are gone and nobody hears of it. So until a partition has been written once,
    its first record goes alone and nothing follows it there before the broker acknowledged
    it. And nothing goes before it into the transaction unacknowledged, so that its partition
    joins the transaction alone: a transaction coordinator that does not know the topic yet
    (just created, on a cluster where the coordinator's metadata lags) answers
    UNKNOWN_TOPIC_OR_PARTITION for it and OPERATION_NOT_ATTEMPTED for the partitions asked
    with it, adding none. librdkafka asks again while the first is read first (always, when
    alone), but takes a not-attempted one read first for an abortable error, and the
    abort's refusal (INVALID_TXN_STATE: the transaction holds no partition) fails the
    producer for good (confluentinc/librdkafka#4849).
    "Written" means by this producer session: a topic that exists but that this producer
    id never wrote is as new as a created one. The broker forgets an idle producer after
    ``producer.id.expiration.ms`` (one day by default); proofs older than ``renew_s`` are
    dropped at a transaction's start, so a partition idle that long is treated as new again.
    """

    def __init__(self, renew_s: float = 3600.0) -> None:
        self.settled: set[str] = set()  # topics whose every partition is written
        self._written: dict[str, set[int]] = {}
        self._renew_s = renew_s
        self._since = time.monotonic()

    def is_new(self, topic: str, partition: int) -> bool:
        return partition not in self._written.get(topic, ())

    def written(self, topic: str, partition: int, partitions: int) -> None:
        done = self._written.setdefault(topic, set())
        done.add(partition)
        if len(done) >= partitions:
            self.settled.add(topic)

    def forget(self) -> None:
        """After an abort nothing is proven any more: an aborted first write may never have
        reached its partition. (A new producer session is a new sink, with nothing proven.)"""
        self.settled.clear()
        self._written.clear()
        self._since = time.monotonic()

    def renew_if_old(self) -> None:
        if time.monotonic() - self._since > self._renew_s:
            self.forget()


Headers = list[tuple[str, str | bytes | None]]
Record = tuple[str, bytes | None, bytes | None, Headers | None]


class BatchSender:
    """Runs of plain records handed to librdkafka through confluent-kafka's public
    ``Producer.produce_batch``: one call per run of records of one topic, at a fraction of a
    ``produce()`` call each (bench/produce_floor.py). Every record keeps its delivery
    report (the producer's ``on_delivery``), so a refused one is named like any other.

    confluent-kafka's batch call takes no headers, so a record with headers (the Debezium
    format's) is handed over here with a ``produce()`` call of its own, in the same loop: the
    sink's checks around a single record cost a third of the call again. A delivery failure
    reported meanwhile is not looked at per record: librdkafka takes no record into a
    transaction one of whose records failed (``_STATE``), and the commit raises the
    failure before it commits.

    Its caller gives it only topics whose every partition is proven (``FirstWrites``): the
    records are partitioned by librdkafka, many requests in flight to each partition.
    Records wait here, per topic, until ``flush``: a run of one source transaction is a
    record or two per table in an OLTP stream, and a call per run cost more than the
    records it carried.
    """

    def __init__(self, producer: Producer, wait_for_room: Callable[[], None]) -> None:
        self._produce_batch = producer.produce_batch
        self._produce = producer.produce
        self._wait_for_room = wait_for_room
        self._runs: dict[str, list[dict[str, bytes | None]]] = {}
        self.waiting = 0  # records in _runs
        # The (topic, bytes) of the record whose produce() call raised, for the error's line.
        self.refused: tuple[str, int] | None = None

    def take(self, records: Iterator[Record], settled: Container[str]) -> tuple[int, Record | None]:
        """Keep records from ``records`` for their topics' next runs, or hand a record with
        headers over at once, until one is not for this path (its topic is not ``settled``,
        or it has headers and records of its topic wait: it is returned, for the caller to
        hand those over first), or ``_CHUNK`` wait, or ``records`` ends. Returns how many it
        took, and that record. One loop here rather than a call per record: this is every
        record's path."""
        runs, waiting, kept = self._runs, self.waiting, 0
        for record in records:
            topic, key, value, headers = record
            if topic not in settled:
                self.waiting = waiting
                return kept, record
            if headers is not None:
                if topic in runs:  # records of its topic wait: they go first
                    self.waiting = waiting
                    return kept, record
                try:
                    self.send(topic, key, value, headers)
                except (KafkaException, SystemError):
                    self.refused = topic, len(value or b"")
                    raise
                kept += 1
                continue
            run = runs.get(topic)
            if run is None:
                run = runs[topic] = []
            run.append({"key": key, "value": value})
            kept += 1
            waiting += 1
            if waiting >= _CHUNK:
                break
        self.waiting = waiting
        return kept, None

    def send(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        partition: int = -1,
    ) -> None:
        """One record to librdkafka with a ``produce()`` call of its own (a full queue is
        waited out); ``partition`` -1: librdkafka's partitioner chooses."""
        while True:
            try:
                self._produce(topic, value, key, partition=partition, headers=headers)
                return
            except BufferError:
                self._wait_for_room()  # then try again

    def flush(self) -> tuple[str, int, int] | None:
        """Hand every waiting run over, in the order each topic's records came (a full
        librdkafka queue is waited out). None, or the refused record's (topic, size, error
        code); the records behind it in its run are dropped, as its transaction is lost."""
        runs, self._runs, self.waiting = self._runs, {}, 0
        for topic, messages in runs.items():
            while messages:
                queued = self._produce_batch(topic, messages)
                if queued == len(messages):
                    break
                # The refused ones must be the run's last: a record queued behind a refused
                # one (a smaller record fits where a larger did not) would overtake it.
                if any("_error" in message for message in messages[:queued]):
                    raise SinkError(
                        "librdkafka queued a record behind one it refused, out of order; the "
                        "transaction is aborted and published again"
                    )
                error = messages[queued]["_error"]
                code = int(error.code()) if isinstance(error, KafkaError) else -1
                if code != KafkaError._QUEUE_FULL:
                    return topic, len(messages[queued]["value"] or b""), code
                self._wait_for_room()  # then hand the rest over
                messages = messages[queued:]
                for message in messages:
                    message.pop("_error", None)  # this call's verdict, not the next one's
        return None

    def drop(self) -> None:
        """Forget the waiting records (their transaction is aborted)."""
        self._runs, self.waiting = {}, 0


class KafkaSink:
    def __init__(
        self,
        settings: BridgeSettings,
        on_wait: Callable[[float], None] = lambda _s: None,
        on_latencies: Callable[[list[BrokerLatency]], None] = lambda _l: None,
    ) -> None:
        self._settings = settings
        base = kafka_client_config(settings)
        # Before any client exists: each would log its own failure to connect.
        check_reachable(base, _REACH_S, _SECURITY_HINT)  # KafkaUnreachable: retryable
        self.topics = Topics(settings, base)
        # on_wait: seconds records have waited for acknowledgement (a metric).
        self._ack_wait = AckWait(self.topics, settings.kafka_transaction_timeout_ms / 1000, on_wait)
        self._stranding = Stranding()
        # on_latencies: each broker's round trip and queue time, every _STATS_MS (a metric).
        self._on_latencies = on_latencies
        self._txn = OpenTransaction()
        self._producer = Producer(
            {
                **producer_config(settings, self.topics.record_limit),
                # A Python callback per record costs a sixth of the hot path; failures are what
                # we need to hear of. A flush that leaves nothing queued and reported no failure
                # proves every record of the transaction was delivered.
                "on_delivery": self._txn.delivered,
                "delivery.report.only.error": True,
                "statistics.interval.ms": _STATS_MS,
                "stats_cb": self._statistics,
            }
        )
        # What any call that failed means: its cause (``diagnosis``), one line.
        self.diagnosis = Diagnosis(self._producer, settings, self.topics, self._txn)
        self._batches = BatchSender(self._producer, self._wait_for_room)
        self._first = FirstWrites()
        # A commit_transaction or abort_transaction that timed out: librdkafka refuses every
        # other transactional call (_CONFLICT) until this one is called again and finishes.
        self._unfinished: str | None = None
        # prove_not_fenced's record: a key of its own, never the slot's progress key.
        self._fence_probe_key = json.dumps(
            {"slot": settings.slot_name, "fence_probe": True}
        ).encode()

    def start(self, timeout_s: float = 30.0) -> None:
        """Check that the brokers can take our largest record, then register the
        transactional id, fencing any older producer and its open txn."""
        self.topics.start(timeout_s)
        try:
            self._producer.init_transactions(timeout_s)
        except KafkaException as exc:
            raise SinkError(
                f"cannot start Kafka transactions at {self._settings.kafka_bootstrap}:"
                f" {explain(exc)}"
            ) from None

    def begin(self) -> None:
        self._check_not_stranded()
        self._txn.failure = None
        self._first.renew_if_old()
        self._finish_unfinished()
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            raise self.diagnosis.classify(exc) from None
        self._txn.open, self._txn.began = True, time.monotonic()

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None = None,
    ) -> None:
        self._hand_over()  # what waits for a run goes first: order per partition holds
        if self._txn.failure is not None:
            raise self.diagnosis.delivery_failed()
        try:
            if topic in self._first.settled:
                partition, first = -1, False  # librdkafka's murmur2 partitioner
            else:
                partition = partition_for(key, self.topics.partition_count(topic))
                first = self._first.is_new(topic, partition)
                if first:
                    self._deliver_all()  # so that its partition joins the transaction alone
            self._batches.send(topic, key, value, headers, partition)
            if first:
                self._deliver_all()  # alone in flight to its partition until acknowledged
                self._first.written(topic, partition, self.topics.partition_count(topic))
        except (KafkaException, SystemError) as exc:
            # SystemError: confluent-kafka raises it when it serves a delivery report
            # while a fatal producer error is pending.
            raise self.diagnosis.classify(exc, record=(topic, len(value or b""))) from None

    def produce_all(self, records: Iterable[Record], compacted: Container[str]) -> int:
        """``produce`` each record, creating topics it does not know yet (``compacted``:
        those to create compacted); returns how many. The publisher's path: records for topics
        whose every partition is proven go through ``BatchSender`` (those without headers
        wait there in runs per topic until enough of them wait, a record takes the other
        path, or the transaction commits), the others through ``produce``."""
        pending = iter(records)
        count = 0
        while True:
            try:
                kept, other = self._batches.take(pending, self._first.settled)
            except (KafkaException, SystemError) as exc:
                raise self.diagnosis.classify(exc, record=self._batches.refused) from None
            count += kept
            if other is None and self._batches.waiting < _CHUNK:
                return count  # records ended: what waits goes at the next hand-over
            self._hand_over()
            if other is not None:
                count += 1
                topic, key, value, headers = other
                if topic not in self.topics.ready:
                    self.topics.ensure({topic: topic in compacted})
                self.produce(topic, key, value, headers)

    def _hand_over(self) -> None:
        """The waiting runs to librdkafka; a record it refuses ends the transaction."""
        if not self._batches.waiting:
            return
        refused = self._batches.flush() if self._txn.failure is None else None
        if refused is None and self._txn.failure is None:
            return
        self._batches.drop()
        # librdkafka takes no record once one of the transaction's failed (_STATE): the
        # first failure's delivery report says why.
        if self._txn.failure is not None:
            raise self.diagnosis.delivery_failed()
        assert refused is not None
        topic, size, code = refused
        raise self.diagnosis.classify(KafkaException(KafkaError(code)), record=(topic, size))

    def _deliver_all(self) -> None:
        """Wait until every record produced so far is acknowledged, or raise. librdkafka
        waits silently, up to the transaction's timeout, for brokers that do not
        acknowledge (a deleted topic, NOT_ENOUGH_REPLICAS, a full log dir): meanwhile the
        topics' ids are checked every ``_FLUSH_CHECK_S``, and the wait is reported
        (``AckWait``)."""
        began = time.monotonic()
        deadline = began + self._settings.kafka_transaction_timeout_ms / 1000
        try:
            while True:
                left = deadline - time.monotonic()
                undelivered = self._producer.flush(max(0.0, min(_FLUSH_CHECK_S, left)))
                if self._txn.failure is not None:
                    raise (
                        self.diagnosis.transaction_failed(self._txn.failure)
                        or self.diagnosis.delivery_failed()
                    )
                if not undelivered:
                    return
                self._check_not_stranded()
                if left <= _FLUSH_CHECK_S:
                    # Never commit a transaction we cannot prove whole.
                    raise SinkError(
                        f"{undelivered} records of this transaction were not acknowledged in "
                        f"{self._settings.kafka_transaction_timeout_ms} ms "
                        f"(kafka_transaction_timeout_ms); aborting it, a new session publishes "
                        f"it again ({self.topics.why_unacknowledged()[0]})"
                    )
                self.topics.check_ids_briefly()
                self._ack_wait.waited(time.monotonic() - began, f"{undelivered} records")
        finally:
            self._ack_wait.ended()

    def commit(self) -> float:
        """Commit the open transaction; returns the seconds it took."""
        started = time.monotonic()
        try:
            self._hand_over()
            self._deliver_all()
            # After every record is acknowledged: a topic deleted while they were on their
            # way got them (or some of them) in its new incarnation.
            self.topics.check_ids()
            self._end_transaction("commit_transaction")
        except (KafkaException, SystemError) as exc:
            err = cause(exc)
            known = (
                self.diagnosis.transaction_failed(err)
                if isinstance(err, KafkaError) and err.txn_requires_abort()
                else None
            )
            raise known or self.diagnosis.classify(exc) from None
        self._txn.open = False
        return time.monotonic() - started

    def topic_ids(self) -> dict[str, str]:
        """Every topic's id as published (the progress record carries them)."""
        return self.topics.ids.published()

    def abort(self) -> None:
        """Abort the open transaction if there is one; errors here are only logged."""
        self._batches.drop()
        if not self._txn.open:
            return
        self._txn.open = False
        self._first.forget()
        if self._stranded():
            log_event(
                log,
                logging.WARNING,
                "Kafka transaction left open: the producer knows no broker to abort it with; "
                "the next session's producer aborts it when it starts",
                stranded_s=round(self._stranding.stranded_s()),
            )
            return
        try:
            if self._unfinished is None:
                self._end_transaction("abort_transaction", _ABORT_S)
            else:
                self._finish_unfinished(_ABORT_S)
        except (KafkaException, SystemError, SinkError) as exc:
            log_event(
                log,
                logging.WARNING,
                "abort of Kafka transaction failed",
                error=explain(exc),
                called_again_before_the_next_transaction=self._unfinished,
            )

    def _end_transaction(self, call: str, timeout_s: float | None = None) -> None:
        """``commit_transaction`` or ``abort_transaction``, called again every
        ``REPORT_AFTER_S`` (librdkafka resumes it) to say why it waits: the coordinator
        writes the markers only where the partition has its in-sync replicas. One that
        times out (Kafka away) is remembered, to be called again before anything else."""
        began = time.monotonic()
        deadline = began + (timeout_s or self._settings.kafka_transaction_timeout_ms / 1000)
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    getattr(self._producer, call)(max(0.0, min(REPORT_AFTER_S, left)))
                except (KafkaException, SystemError) as exc:
                    err = cause(exc)
                    resumable = isinstance(err, KafkaError) and err.retriable() and not err.fatal()
                    self._unfinished = call if resumable else None
                    if not resumable or left <= REPORT_AFTER_S:
                        raise
                    self._check_not_stranded()
                    self._ack_wait.waited(time.monotonic() - began, call.split("_")[0])
                    continue
                self._unfinished = None
                return
        finally:
            self._ack_wait.ended()

    def _finish_unfinished(self, timeout_s: float | None = None) -> None:
        """Call again the commit or abort that timed out. A commit that lands now was not
        confirmed to PostgreSQL: its progress record makes the next session skip it."""
        if self._unfinished is not None:
            try:
                self._end_transaction(self._unfinished, timeout_s)
            except (KafkaException, SystemError) as exc:
                raise self.diagnosis.classify(exc) from None

    def prove_not_fenced(self) -> None:
        """Write one record into a transaction and abort it; FencedError if a newer bridge
        took the transactional id.

        The coordinator and the partition's leader check the producer's epoch on every
        transactional request, and a bridge with nothing to publish sends none: this is how
        an idle one learns it was fenced. The record is a tombstone under a key of its own on
        the progress topic, aborted: no read_committed reader sees it, compaction drops it.

        Not a consumer-group offset sent to the transaction, as before: once the brokers have
        restarted, librdkafka (2.16) may never look the group's coordinator up again, and
        ``send_offsets_to_transaction`` then waits past its timeout, for good
        (confluentinc/librdkafka#5511, #5456). A soak's bridge stood there, silent, for as
        long as it was watched after a broker restart and a planned failover.
        """
        self.begin()
        self._txn.probing = True
        try:
            self.produce(self._settings.progress_topic, self._fence_probe_key, None)
            self._deliver_all()
        except (KafkaException, SystemError, SinkError) as exc:
            # SystemError: a delivery report served while the fatal error is pending.
            failed = exc if isinstance(exc, SinkError) else self.diagnosis.classify(exc)
            self.abort()
            raise failed from None
        finally:
            self._txn.probing = False
        self._txn.open = False
        try:
            # Not ``abort``, which forgets the partitions proven written (``FirstWrites``):
            # this record was acknowledged, so its partition is proven too.
            self._end_transaction(
                "abort_transaction", self._settings.kafka_transaction_timeout_ms / 1000
            )
        except (KafkaException, SystemError) as exc:
            raise self.diagnosis.classify(exc) from None

    def close(self) -> None:
        """Abort what is open and let go; never raises, so the error that ended the session
        is the one reported."""
        self.abort()
        self.topics.close()
        if self._stranded():
            return  # the flush would wait for brokers it no longer knows
        try:
            self._producer.flush(5)
        except (KafkaException, SystemError) as exc:
            log_event(
                log, logging.WARNING, "Kafka producer did not close cleanly", error=explain(exc)
            )

    def _wait_for_room(self) -> None:
        """librdkafka's queue is full: let it send for a moment, unless it cannot."""
        self._producer.poll(0.05)
        self._check_not_stranded()

    def _statistics(self, statistics: str) -> None:
        """librdkafka's statistics document: whether the producer still has a broker to ask,
        and each broker's latencies."""
        brokers = brokers_of(statistics)  # decoded once, for both
        self._stranding.seen(brokers)
        if brokers is not None:
            self._on_latencies(broker_latencies(brokers))

    def _stranded(self) -> bool:
        """Whether the producer has known no broker to ask for ``_STRANDED_S``
        (``stranded.Stranding``). Statistics still queued are read before a yes: a producer
        that was not polled for a while may have found its brokers again since."""
        if self._stranding.stranded_s() < _STRANDED_S:
            return False
        self._producer.poll(0)
        return self._stranding.stranded_s() >= _STRANDED_S

    def _check_not_stranded(self) -> None:
        """End the session when the producer can no longer reach Kafka by itself: only a
        new producer gets out of librdkafka#5301, and it fences this one."""
        if self._stranded():
            raise ProducerStranded(
                f"the Kafka producer has known no broker for "
                f"{self._stranding.stranded_s():.0f}s: a broker answered its metadata request "
                "with none, as one does in controlled shutdown, and librdkafka dropped them "
                "all without bootstrapping again (librdkafka#5301); a new session starts a "
                "new producer, which aborts this one's transaction"
            )
