"""The Kafka side: one transactional producer per slot, and the topics it writes.

The ``transactional.id`` is derived from the slot, so a second bridge on the same slot
fences the first (its next commit fails with a fatal error and it stops). Keys are
partitioned Java-compatibly (murmur2) so Kafka Streams/Connect consumers co-partition.

What Kafka acknowledged must be in the log, or exactly-once is a claim, not a fact: every
broker before 4.5 can lose a producer's first request to a partition (KAFKA-15591), so the
first record to each partition is sent alone (``FirstWrites``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from services.bridge.partitioner import partition_for
from services.bridge.settings import BridgeSettings
from services.common.logs import log_event

log = logging.getLogger(__name__)


class SinkError(Exception):
    """Kafka refused or lost something; the session must restart from durable progress."""


class FencedError(SinkError):
    """Another bridge instance owns this slot's transactional id now."""


def kafka_client_config(settings: BridgeSettings) -> dict[str, Any]:
    """Connection settings shared by the producer, admin and progress consumer."""
    # librdkafka's own log lines go through Python logging (structured, level-filtered).
    config: dict[str, Any] = {"bootstrap.servers": settings.kafka_bootstrap,
                              "logger": logging.getLogger("kafka")}
    config.update(settings.kafka_config)
    if settings.kafka_sasl_password is not None:
        config["sasl.password"] = settings.kafka_sasl_password.get_secret_value()
    return config


def _cause(err: KafkaError | KafkaException | BaseException) -> KafkaError | BaseException:
    # confluent-kafka raises SystemError ("<function ...> returned a result with an exception
    # set") when a callback runs while a fatal error is pending; the real error is its cause.
    while isinstance(err, SystemError) and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    if isinstance(err, KafkaException):
        return err.args[0]  # type: ignore[no-any-return]
    return err


def _explain(err: KafkaError | KafkaException | BaseException) -> str:
    err = _cause(err)
    if isinstance(err, KafkaError):
        return f"{err.name()}: {err.str()}"
    return str(err)


class FirstWrites:
    """Which partitions this producer has written: the guard against KAFKA-15591.

    A broker that holds no state for a producer on a partition accepts any first sequence
    from it. When the producer's first request there fails retriably (NOT_LEADER_OR_FOLLOWER
    while the broker applies the partition's creation) and a later request is already in
    flight, the later one is stored and the first, retried, is taken for a duplicate: its
    records are gone and nobody hears of it. So until a partition has been written once,
    its first record goes alone and nothing follows it there before the broker acknowledged
    it. "Written" means by this producer session: a topic that exists but that this producer
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


class KafkaSink:
    def __init__(self, settings: BridgeSettings) -> None:
        self._settings = settings
        base = kafka_client_config(settings)
        self._admin = AdminClient(base)
        self._producer = Producer({
            **base,
            "transactional.id": settings.transactional_id,
            "transaction.timeout.ms": settings.kafka_transaction_timeout_ms,
            "enable.idempotence": True,
            "acks": "all",
            "partitioner": "murmur2_random",
            "linger.ms": 5,
            "batch.size": 1_000_000,
            "compression.type": "lz4",
            # Bounded producer memory: produce() blocks (we poll) instead of growing.
            "queue.buffering.max.messages": 200_000,
            "queue.buffering.max.kbytes": 262_144,
            "message.max.bytes": max(settings.max_row_bytes + 65_536, 1_000_000),
            # A Python callback per record costs a sixth of the hot path; failures are what
            # we need to hear of. A flush that leaves nothing queued and reported no failure
            # proves every record of the transaction was delivered.
            "on_delivery": self._delivered,
            "delivery.report.only.error": True,
        })
        self._known_topics: set[str] = set()
        self._partitions: dict[str, int] = {}  # partition count per topic
        self._first = FirstWrites()
        self._failure: KafkaError | None = None
        self._in_txn = False
        self._began = 0.0  # monotonic time the open transaction began
        self._fence_group: Consumer | None = None  # made by the first prove_not_fenced

    def start(self, timeout_s: float = 30.0) -> None:
        """Register the transactional id, fencing any older producer and its open txn."""
        try:
            self._producer.init_transactions(timeout_s)
        except KafkaException as exc:
            raise SinkError(f"cannot start Kafka transactions at {self._settings.kafka_bootstrap}:"
                            f" {_explain(exc)}") from None
        self._learn(self._admin.list_topics(timeout=timeout_s).topics)

    @property
    def known_topics(self) -> set[str]:
        return self._known_topics

    def _learn(self, topics: dict[str, Any]) -> None:
        for name, meta in topics.items():
            if meta.error is None and meta.partitions:
                self._known_topics.add(name)
                self._partitions[name] = len(meta.partitions)

    def _partition_count(self, topic: str) -> int:
        count = self._partitions.get(topic)
        if count is None:
            self._learn(self._admin.list_topics(topic, timeout=30).topics)
            count = self._partitions.get(topic)
            if count is None:
                raise SinkError(f"topic {topic} has no partitions; check the Kafka brokers")
        return count

    def ensure_topics(self, topics: dict[str, bool]) -> None:
        """Create the given topics (name -> compacted) that do not exist yet."""
        missing = {t: c for t, c in topics.items() if t not in self._known_topics}
        if not missing:
            return
        # Topics must take the largest record we allow, or the broker refuses it later.
        size = {"max.message.bytes": str(self._settings.max_row_bytes + 65_536)}
        new = [NewTopic(t, num_partitions=1 if compacted else self._settings.topic_partitions,
                        replication_factor=self._settings.topic_replication_factor,
                        config={"cleanup.policy": "compact", **size} if compacted else size)
               for t, compacted in missing.items()]
        for topic, future in self._admin.create_topics(new, operation_timeout=30).items():
            try:
                future.result()
                log_event(log, logging.INFO, "created topic", topic=topic)
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise SinkError(f"cannot create topic {topic}: {_explain(exc)}") from None
        self._wait_for_leaders(list(missing))

    def _wait_for_leaders(self, topics: list[str], timeout_s: float = 30.0) -> None:
        # A new topic answers "not leader" until its partitions have one; reading or
        # writing it before then fails for no reason an operator should see. (A leader in
        # the metadata does not mean the broker is ready to write: see FirstWrites.)
        deadline = time.monotonic() + timeout_s
        while True:
            meta = self._admin.list_topics(timeout=timeout_s).topics
            if all(t in meta and meta[t].partitions
                   and all(p.leader >= 0 for p in meta[t].partitions.values()) for t in topics):
                self._learn({t: meta[t] for t in topics})
                return
            if time.monotonic() > deadline:
                raise SinkError(f"topics {', '.join(topics)} have no partition leader after "
                                f"{timeout_s:.0f}s; check the Kafka brokers")
            time.sleep(0.2)

    def begin(self) -> None:
        self._failure = None
        self._first.renew_if_old()
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            raise self._classify(exc) from None
        self._in_txn = True
        self._began = time.monotonic()

    def produce(self, topic: str, key: bytes | None, value: bytes | None) -> None:
        if self._failure is not None:
            raise self._classify(self._failure, "Kafka delivery failed: ")
        try:
            if topic in self._first.settled:
                partition, first = -1, False  # librdkafka's murmur2 partitioner
            else:
                partition = partition_for(key, self._partition_count(topic))
                first = self._first.is_new(topic, partition)
            while True:
                try:
                    self._producer.produce(topic, value=value, key=key, partition=partition)
                    break
                except BufferError:
                    # The local queue is full: let librdkafka send, then try again.
                    self._producer.poll(0.05)
            if first:
                self._deliver_all()  # alone in flight to its partition until acknowledged
                self._first.written(topic, partition, self._partitions[topic])
        except (KafkaException, SystemError) as exc:
            # SystemError: confluent-kafka raises it when it serves a delivery report
            # while a fatal producer error is pending.
            raise self._classify(exc) from None

    def _deliver_all(self) -> None:
        """Wait until every record produced so far is acknowledged, or raise."""
        undelivered = self._producer.flush(self._settings.kafka_transaction_timeout_ms / 1000)
        if self._failure is not None:
            raise self._classify(self._failure, "Kafka delivery failed: ")
        if undelivered:
            # Never commit a transaction we cannot prove whole.
            raise SinkError(f"{undelivered} records of this transaction were not delivered "
                            "in time; aborting it")

    def commit(self) -> float:
        """Commit the open transaction; returns the seconds it took."""
        started = time.monotonic()
        try:
            self._deliver_all()
            self._producer.commit_transaction(self._settings.kafka_transaction_timeout_ms / 1000)
        except (KafkaException, SystemError) as exc:
            raise self._classify(exc) from None
        self._in_txn = False
        return time.monotonic() - started

    def abort(self) -> None:
        """Abort the open transaction if there is one; errors here are only logged."""
        if not self._in_txn:
            return
        self._in_txn = False
        self._first.forget()
        try:
            self._producer.abort_transaction(10)
        except KafkaException as exc:
            log_event(log, logging.WARNING, "abort of Kafka transaction failed",
                      error=_explain(exc))

    def prove_not_fenced(self) -> None:
        """Commit a transaction that holds only a consumer-group offset; FencedError if a
        newer bridge took the transactional id.

        The coordinator checks the producer's epoch on every transactional request, and a
        bridge with nothing to publish sends none: this is how an idle one learns it was
        fenced. The offset (group ``slotbridge-fence-<slot>``, on the progress topic) lands
        in Kafka's internal offsets topic, in no topic anybody reads.
        """
        if self._fence_group is None:
            self._fence_group = Consumer({
                **kafka_client_config(self._settings),
                "group.id": f"slotbridge-fence-{self._settings.slot_name}"})
        group = self._fence_group.consumer_group_metadata()
        timeout_s = self._settings.kafka_transaction_timeout_ms / 1000
        self.begin()
        try:
            self._producer.send_offsets_to_transaction(
                [TopicPartition(self._settings.progress_topic, 0, 0)], group, timeout_s)
        except (KafkaException, SystemError) as exc:
            raise self._classify(exc) from None
        self.commit()

    def close(self) -> None:
        """Abort what is open and let go; never raises, so the error that ended the session
        is the one reported."""
        self.abort()
        if self._fence_group is not None:
            self._fence_group.close()
        try:
            self._producer.flush(5)
        except (KafkaException, SystemError) as exc:
            log_event(log, logging.WARNING, "Kafka producer did not close cleanly",
                      error=_explain(exc))

    def _delivered(self, err: KafkaError | None, _msg: object) -> None:
        if err is not None and self._failure is None:
            self._failure = err

    def _classify(self, exc: KafkaException | KafkaError | SystemError,
                  what: str = "Kafka: ") -> SinkError:
        timeout_ms = self._settings.kafka_transaction_timeout_ms
        age = time.monotonic() - self._began
        if self._in_txn and age * 1000 > timeout_ms:
            # The coordinator aborts a transaction open past its timeout and fences the
            # producer: the error then reads "fenced", but nobody else took over.
            return SinkError(
                f"the Kafka transaction was open {age:.0f}s, past kafka_transaction_timeout_ms "
                f"({timeout_ms} ms), and the broker aborted it; raise kafka_transaction_timeout_ms"
                " (at most the brokers' transaction.max.timeout.ms) for a snapshot this large")
        # A fenced producer's error often comes wrapped in a SystemError: unwrap it, or the
        # bridge would reconnect and fence the bridge that fenced it, in turn.
        err = _cause(exc)
        if isinstance(err, KafkaError) and err.code() in (
                KafkaError._FENCED, KafkaError.PRODUCER_FENCED,
                KafkaError.INVALID_PRODUCER_EPOCH):
            return FencedError(
                f"another bridge took over slot {self._settings.slot_name} "
                f"(transactional id {self._settings.transactional_id}); this one stops")
        return SinkError(f"{what}{_explain(err)}")
