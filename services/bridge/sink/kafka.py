"""The Kafka side: one transactional producer per slot, and the topics it writes.

The ``transactional.id`` is derived from the slot, so a second bridge on the same slot
fences the first (its next commit fails with a fatal error and it stops). Keys are
partitioned Java-compatibly (murmur2) so Kafka Streams/Connect consumers co-partition.

What Kafka acknowledged must be in the log, or exactly-once is a claim, not a fact: every
broker before 4.5 can lose a producer's first request to a partition (KAFKA-15591), so the
first record to each partition is sent alone (``FirstWrites``).

Topics are known by their Kafka topic id, not their name (``TopicIds``): a topic deleted
under the bridge loses what was published there, and a broker that auto-creates topics
brings it back empty on the producer's next metadata request, where writing on would hide
the loss.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any

from confluent_kafka import (
    KafkaError,
    KafkaException,
    Producer,
    TopicCollection,
)

# Their public home, confluent_kafka.admin (its stubs do not declare the re-export).
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewTopic,
    ResourceType,
)

from services.bridge.settings import BridgeSettings
from services.bridge.sink.partitioner import partition_for
from services.bridge.sink.topic_id_probe import ProbeError, TopicIdProbe
from services.common.errors import SlotbridgeError
from services.common.kafka import KafkaLog, cause, check_reachable, explain
from services.common.logs import log_event

log = logging.getLogger(__name__)


class SinkError(SlotbridgeError):
    """Kafka refused or lost something; the session must restart from durable progress."""

    retryable = True


class FencedError(SinkError):
    """Another bridge instance owns this slot's transactional id now."""

    retryable = False  # the newer bridge streams the slot; this one steps aside


class TopicReplaced(SinkError):
    """A topic the bridge wrote was deleted (and maybe created again) behind its back."""

    retryable = False  # what was published there is gone: only the operator can decide


class ProducerFailed(SinkError):
    """The producer hit a fatal error other than being fenced (librdkafka: INVALID_TXN_STATE
    from an abort, a lost authorization): it can commit nothing more, nor tell whether a
    successor fenced it, which the daemon must know before it starts a new session."""

    retryable = False


class KafkaRefused(SinkError):
    """Kafka refuses what the bridge must do (a topic, a record's size, a setting) and will
    refuse it again in every new session: only the operator can change that."""

    retryable = False


# A record batch around the largest record: what topics and the producer must accept.
RECORD_SLACK = 65_536
# Codes with which Kafka refuses to create a topic for good, and what to do about each.
_TOPIC_REFUSALS = {
    KafkaError.TOPIC_EXCEPTION: "rename the table or leave it out of the publication (tables)",
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "grant the bridge's principal CREATE on the topic",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "grant the bridge's principal CREATE on the topic",
    KafkaError.POLICY_VIOLATION: "create the topic yourself, or change the brokers' policy",
    KafkaError.INVALID_CONFIG: "check topic_partitions and topic_replication_factor",
    KafkaError.INVALID_PARTITIONS: "check topic_partitions",
}
# Fewer brokers are up than the replication factor asks for: a broker that comes back
# lets the next session create it.
_TOPIC_WAITS = frozenset({KafkaError.INVALID_REPLICATION_FACTOR})
# Kafka errors that say nothing about the topics written: no need to check their ids.
_NOT_ABOUT_TOPICS = frozenset(
    {
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.RECORD_LIST_TOO_LARGE,
    }
)
_TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
# A right of the bridge's principal that an ACL no longer grants: every new session would
# be refused the same way, so the bridge stops (librdkafka takes some of them as fatal).
_NOT_AUTHORIZED = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
    }
)
_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
_REACH_S = 10.0
# How long an abort waits for the coordinator before the session goes on ending; an abort
# that did not finish is called again before the next transaction.
_ABORT_S = 10.0
# How long a flush waits before the sink checks that its topics still exist (one
# DescribeTopics request): a deleted topic is noticed within about this.
_FLUSH_CHECK_S = 1.0
# After this long without acknowledgement a flush says why it waits, then once a minute.
_WAIT_REPORT_S = 5.0
_WAIT_REPEAT_S = 60.0
# Records that wait in BatchSender before they are handed over: calls with hundreds of
# records each, and a bounded copy of the records in memory.
_CHUNK = 1024
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
    }


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


class TopicIds:
    """The id of every topic the bridge wrote, as it was when it wrote there.

    ``expected`` comes from the published progress record (what earlier sessions wrote),
    ``learned`` is what this session found when it made a topic ready; both are published
    with every progress record, so a topic recreated while the bridge was down is caught at
    the session's start. Checked again before every commit (one DescribeTopics request, asked
    by ``TopicIdProbe``'s child process: ~1 ms on the local stack, more on a loaded one): a
    transaction that wrote into a topic recreated meanwhile is aborted, never confirmed to
    PostgreSQL. A new id means new partitions that this producer never wrote: the session
    ends, and the next one starts with ``FirstWrites`` empty, so nothing there counts as
    proven.
    """

    def __init__(self) -> None:
        self.expected: dict[str, str] = {}
        self.learned: dict[str, str] = {}

    def published(self) -> dict[str, str]:
        return {**self.expected, **self.learned}

    def check(self, found: dict[str, str | None], created: Container[str] = ()) -> None:
        """``found``: topic -> its id now (None: it does not exist); ``created``: those this
        session just created. Learns the ids, or raises ``TopicReplaced``."""
        for topic, now in found.items():
            was = self.learned.get(topic) or self.expected.get(topic)
            if was is not None and now != was:
                raise TopicReplaced(self._replaced(topic, was, now, topic in created))
            if now is not None:
                self.learned[topic] = now

    def _replaced(self, topic: str, was: str, now: str | None, by_us: bool) -> str:
        if now is None:
            what = "was deleted"
        elif by_us:
            what = f"was deleted; the bridge created it again, empty (topic id now {now})"
        else:
            what = f"was deleted and created again behind the bridge (topic id now {now})"
        return (
            f"topic {topic} (topic id {was}) {what}: the records published there before are "
            "gone from Kafka and this bridge will not write on as if they were there; to "
            "publish every table again into the same topics, with the gap recorded, run "
            "`slotbridge resync` once with the bridge stopped, then start it"
        )


Record = tuple[str, bytes | None, bytes | None, list[tuple[str, str | bytes | None]] | None]


class BatchSender:
    """Runs of plain records handed to librdkafka through confluent-kafka's public
    ``Producer.produce_batch``: one call per run of records of one topic, at a fraction of a
    ``produce()`` call each (bench/produce_floor.py). Every record keeps its delivery
    report (the producer's ``on_delivery``), so a refused one is named like any other.

    It takes no headers (confluent-kafka's batch call has none: the Debezium format's
    records go through ``produce()``), and its caller gives it only topics whose every
    partition is proven (``FirstWrites``): the records are partitioned by librdkafka, many
    requests in flight to each partition. Records wait here, per topic, until ``flush``:
    a run of one source transaction is a record or two per table in an OLTP stream, and a
    call per run cost more than the records it carried.
    """

    def __init__(self, producer: Producer) -> None:
        self._produce_batch = producer.produce_batch
        self._poll = producer.poll
        self._runs: dict[str, list[dict[str, bytes | None]]] = {}
        self.waiting = 0  # records in _runs

    def take(self, records: Iterator[Record], settled: Container[str]) -> tuple[int, Record | None]:
        """Keep records from ``records`` for their topics' next runs until one is not for
        this path (it has headers, or its topic is not ``settled``: it is returned), or
        ``_CHUNK`` wait, or ``records`` ends. Returns how many it kept, and that record.
        One loop here rather than a call per record: this is every record's path."""
        runs, waiting, kept = self._runs, self.waiting, 0
        for record in records:
            topic, key, value, headers = record
            if headers is not None or topic not in settled:
                self.waiting = waiting
                return kept, record
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
                self._poll(0.05)  # let librdkafka send, then hand the rest over
                messages = messages[queued:]
                for message in messages:
                    message.pop("_error", None)  # this call's verdict, not the next one's
        return None

    def drop(self) -> None:
        """Forget the waiting records (their transaction is aborted)."""
        self._runs, self.waiting = {}, 0


class KafkaSink:
    def __init__(
        self, settings: BridgeSettings, on_wait: Callable[[float], None] = lambda _s: None
    ) -> None:
        self._settings = settings
        self._on_wait = on_wait  # seconds records have waited for acknowledgement (metric)
        self._wait_logged = 0.0  # monotonic time of the last "Kafka does not acknowledge"
        # Whether that line could say why (the brokers answered the sink's questions).
        self._wait_explained = False
        base = kafka_client_config(settings)
        # Before any client exists: each would log its own failure to connect.
        check_reachable(base, _REACH_S, _SECURITY_HINT)  # KafkaUnreachable: retryable
        self._admin = AdminClient(base)
        self._client_config = base  # for a fresh admin client (see _why_unacknowledged)
        self._ids_probe = TopicIdProbe(base)  # not the admin client: see topic_id_probe
        self._producer = Producer(
            {
                **producer_config(settings, self.record_limit),
                # A Python callback per record costs a sixth of the hot path; failures are what
                # we need to hear of. A flush that leaves nothing queued and reported no failure
                # proves every record of the transaction was delivered.
                "on_delivery": self._delivered,
                "delivery.report.only.error": True,
            }
        )
        self._batches = BatchSender(self._producer)
        # Topics written this session: created, or their record limit checked.
        self._ready: set[str] = set()
        self._partitions: dict[str, int] = {}  # partition count per existing topic
        self._first = FirstWrites()
        self.ids = TopicIds()
        self._failure: KafkaError | None = None
        self._failed_record: tuple[str, int] | None = None  # topic, bytes
        self._in_txn = False
        self._began = 0.0  # monotonic time the open transaction began
        # A commit_transaction or abort_transaction that timed out: librdkafka refuses every
        # other transactional call (_CONFLICT) until this one is called again and finishes.
        self._unfinished: str | None = None
        # prove_not_fenced's record: a key of its own, never the slot's progress key.
        self._fence_probe_key = json.dumps(
            {"slot": settings.slot_name, "fence_probe": True}
        ).encode()

    @property
    def record_limit(self) -> int:
        return self._settings.max_row_bytes + RECORD_SLACK

    def start(self, timeout_s: float = 30.0) -> None:
        """Check that the brokers can take our largest record, then register the
        transactional id, fencing any older producer and its open txn."""
        metadata = self._admin.list_topics(timeout=timeout_s)
        self._check_request_limit(list(metadata.brokers))
        try:
            self._producer.init_transactions(timeout_s)
        except KafkaException as exc:
            raise SinkError(
                f"cannot start Kafka transactions at {self._settings.kafka_bootstrap}:"
                f" {explain(exc)}"
            ) from None
        self._learn(metadata.topics)

    def _check_request_limit(self, brokers: list[int]) -> None:
        """A broker closes the connection of a request larger than its
        socket.request.max.bytes, without an error the producer could report: the bridge
        would retry forever, silently. Refuse a max_row_bytes that no broker can take."""
        for broker, value in self._below_record_limit(
            ResourceType.BROKER, [str(b) for b in brokers], "socket.request.max.bytes"
        ):
            raise KafkaRefused(
                f"max_row_bytes={self._settings.max_row_bytes} is more than broker {broker} "
                f"takes in one request (socket.request.max.bytes={value}, which must exceed "
                f"max_row_bytes by {RECORD_SLACK}): lower max_row_bytes to "
                f"{value - RECORD_SLACK} or raise socket.request.max.bytes on every broker"
            )

    def _below_record_limit(
        self, kind: ResourceType, names: list[str], setting: str
    ) -> list[tuple[str, int]]:
        """The brokers or topics whose ``setting`` is below ``record_limit``, with its value.
        One that cannot be read (no DESCRIBE_CONFIGS right) is only warned of: the broker
        still refuses a record too large, and the sink reports that in one line."""
        below = []
        resources = [ConfigResource(kind, name) for name in names]
        # librdkafka takes one broker per DescribeConfigs call (the request goes to it):
        # more fail, each with _CONFLICT, and the check did not run on a cluster.
        calls = [[r] for r in resources] if kind == ResourceType.BROKER else [resources]
        futures = {}
        for call in calls:
            futures.update(self._admin.describe_configs(call))
        for resource, future in futures.items():
            try:
                entry = future.result(timeout=30).get(setting)
            except KafkaException as exc:
                log_event(
                    log,
                    logging.WARNING,
                    f"cannot read {setting}; records up to max_row_bytes may be refused",
                    resource=resource.name,
                    error=explain(exc),
                )
                continue
            if entry is not None and int(entry.value) < self.record_limit:
                below.append((resource.name, int(entry.value)))
        return below

    def _learn(self, topics: dict[str, Any]) -> None:
        for name, meta in topics.items():
            if meta.error is None and meta.partitions:
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
        """Make the given topics (name -> compacted) ready for records up to max_row_bytes:
        create those that do not exist, raise the limit of those that take less."""
        todo = {t: c for t, c in topics.items() if t not in self._ready}
        if not todo:
            return
        existing = [t for t in todo if t in self._partitions]
        missing = {t: c for t, c in todo.items() if t not in self._partitions}
        if missing:
            existing += self._create(missing)
            self._wait_for_leaders(list(missing))
        self.ids.check(self._describe(list(todo)), created=missing)
        if existing:
            self._align_limits(existing)
        self._ready.update(todo)

    def expect_topic_ids(self, published: dict[str, str]) -> None:
        """The ids the published progress names: a topic recreated since stops the session
        now; one deleted and not recreated is warned of, and stops it if written again (the
        table may have left the publication with its topic)."""
        self.ids.expected = dict(published)
        if not published:
            return
        found = self._describe(list(published))
        for topic in [t for t, now in found.items() if now is None]:
            log_event(
                log,
                logging.WARNING,
                "a topic this bridge wrote was deleted; writing there again stops the bridge",
                topic=topic,
                topic_id=published[topic],
            )
        self.ids.check({t: now for t, now in found.items() if now is not None})

    def replaced(self, published: dict[str, str]) -> dict[str, str | None]:
        """The topics of ``published`` (name -> id) whose id is another now: their new id,
        None for one that is gone."""
        found = self._describe(list(published)) if published else {}
        return {t: now for t, now in found.items() if now != published[t]}

    def _describe(self, topics: list[str], timeout_s: float = 30.0) -> dict[str, str | None]:
        """Each topic's id now; None for one that does not exist."""
        try:
            return self._ids_probe.describe(topics, timeout_s)
        except ProbeError as exc:
            raise SinkError(str(exc)) from None

    def _create(self, topics: dict[str, bool]) -> list[str]:
        """Create the topics; returns those that someone else created meanwhile."""
        size = {"max.message.bytes": str(self.record_limit)}
        new = [
            NewTopic(
                t,
                num_partitions=1 if compacted else self._settings.topic_partitions,
                replication_factor=self._settings.topic_replication_factor,
                config={"cleanup.policy": "compact", **size} if compacted else size,
            )
            for t, compacted in topics.items()
        ]
        raced = []
        for topic, future in self._admin.create_topics(new, operation_timeout=30).items():
            try:
                future.result()
                log_event(log, logging.INFO, "created topic", topic=topic)
            except KafkaException as exc:
                code = exc.args[0].code()
                if code == KafkaError.TOPIC_ALREADY_EXISTS:
                    raced.append(topic)
                elif code in _TOPIC_REFUSALS:
                    raise KafkaRefused(
                        f"Kafka refuses to create topic {topic}: {explain(exc)}; "
                        f"{_TOPIC_REFUSALS[code]}"
                    ) from None
                elif code in _TOPIC_WAITS:
                    raise SinkError(
                        f"cannot create topic {topic} yet: {explain(exc)}; fewer brokers are up "
                        "than its replication factor (topic_replication_factor, or the brokers'"
                        " default.replication.factor): the bridge tries again"
                    ) from None
                else:
                    raise SinkError(f"cannot create topic {topic}: {explain(exc)}") from None
        return raced

    def _align_limits(self, topics: list[str]) -> None:
        """Raise max.message.bytes of existing topics to what max_row_bytes needs (a topic
        created under a smaller max_row_bytes keeps its old limit otherwise, and the broker
        refuses the first larger record)."""
        want = str(self.record_limit)
        for topic, old in self._below_record_limit(ResourceType.TOPIC, topics, "max.message.bytes"):
            change = ConfigResource(
                ResourceType.TOPIC,
                topic,
                incremental_configs=[
                    ConfigEntry(
                        "max.message.bytes", want, incremental_operation=AlterConfigOpType.SET
                    )
                ],
            )
            try:
                self._admin.incremental_alter_configs([change])[change].result(timeout=30)
            except KafkaException as exc:
                raise KafkaRefused(
                    f"topic {topic} takes records of at most {old} bytes (max.message.bytes), "
                    f"less than max_row_bytes={self._settings.max_row_bytes} needs, and raising"
                    f" it failed ({explain(exc)}): set max.message.bytes={want} on topic "
                    f"{topic} or lower max_row_bytes"
                ) from None
            log_event(
                log,
                logging.INFO,
                "raised the topic's max.message.bytes for max_row_bytes",
                topic=topic,
                was=old,
                now=want,
            )

    def _wait_for_leaders(self, topics: list[str], timeout_s: float = 30.0) -> None:
        # A new topic answers "not leader" until its partitions have one; reading or
        # writing it before then fails for no reason an operator should see. (A leader in
        # the metadata does not mean the broker is ready to write: see FirstWrites.)
        deadline = time.monotonic() + timeout_s
        while True:
            meta = self._admin.list_topics(timeout=timeout_s).topics
            if all(
                t in meta
                and meta[t].partitions
                and all(p.leader >= 0 for p in meta[t].partitions.values())
                for t in topics
            ):
                self._learn({t: meta[t] for t in topics})
                return
            if time.monotonic() > deadline:
                raise SinkError(
                    f"topics {', '.join(topics)} have no partition leader after "
                    f"{timeout_s:.0f}s; check the Kafka brokers"
                )
            time.sleep(0.2)

    def begin(self) -> None:
        self._failure = None
        self._first.renew_if_old()
        self._finish_unfinished()
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            raise self._classify(exc) from None
        self._in_txn = True
        self._began = time.monotonic()

    def produce(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, str | bytes | None]] | None = None,
    ) -> None:
        self._hand_over()  # what waits for a run goes first: order per partition holds
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
                    self._producer.produce(
                        topic, value=value, key=key, partition=partition, headers=headers
                    )
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
            raise self._classify(exc, record=(topic, len(value or b""))) from None

    def produce_all(self, records: Iterable[Record], compacted: Container[str]) -> int:
        """``produce`` each record, creating topics it does not know yet (``compacted``:
        those to create compacted); returns how many. The publisher's path: records with no
        headers, for topics whose every partition is proven, wait in runs per topic
        (``BatchSender``) until enough of them wait, a record takes the other path, or the
        transaction commits."""
        pending = iter(records)
        count = 0
        while True:
            kept, other = self._batches.take(pending, self._first.settled)
            count += kept
            if other is None and self._batches.waiting < _CHUNK:
                return count  # records ended: what waits goes at the next hand-over
            self._hand_over()
            if other is not None:
                count += 1
                topic, key, value, headers = other
                if topic not in self._ready:
                    self.ensure_topics({topic: topic in compacted})
                self.produce(topic, key, value, headers)

    def _hand_over(self) -> None:
        """The waiting runs to librdkafka; a record it refuses ends the transaction."""
        if not self._batches.waiting:
            return
        refused = self._batches.flush() if self._failure is None else None
        if refused is None and self._failure is None:
            return
        self._batches.drop()
        # librdkafka takes no record once one of the transaction's failed (_STATE): the
        # first failure's delivery report says why.
        if self._failure is not None:
            raise self._classify(self._failure, "Kafka delivery failed: ")
        assert refused is not None
        topic, size, code = refused
        raise self._classify(KafkaException(KafkaError(code)), record=(topic, size))

    def _deliver_all(self) -> None:
        """Wait until every record produced so far is acknowledged, or raise. librdkafka
        waits silently, up to the transaction's timeout, for brokers that do not
        acknowledge (a deleted topic, NOT_ENOUGH_REPLICAS, a full log dir): meanwhile the
        topics' ids are checked every ``_FLUSH_CHECK_S``, the wait is exported, and from
        ``_WAIT_REPORT_S`` on one line a minute says why it waits."""
        began = time.monotonic()
        deadline = began + self._settings.kafka_transaction_timeout_ms / 1000
        try:
            while True:
                left = deadline - time.monotonic()
                undelivered = self._producer.flush(max(0.0, min(_FLUSH_CHECK_S, left)))
                if self._failure is not None:
                    failed = self._failure
                    raise self._transaction_failed(failed) or self._classify(
                        failed, "Kafka delivery failed: "
                    )
                if not undelivered:
                    return
                if left <= _FLUSH_CHECK_S:
                    # Never commit a transaction we cannot prove whole.
                    raise SinkError(
                        f"{undelivered} records of this transaction were not acknowledged in "
                        f"{self._settings.kafka_transaction_timeout_ms} ms "
                        f"(kafka_transaction_timeout_ms); aborting it, a new session publishes "
                        f"it again ({self._why_unacknowledged()[0]})"
                    )
                self._check_topic_ids_meanwhile()
                self._report_wait(time.monotonic() - began, f"{undelivered} records")
        finally:
            self._on_wait(0.0)

    def _report_wait(self, waited: float, what: str) -> None:
        """Export the wait; from ``_WAIT_REPORT_S`` on, say why once a minute, and sooner
        while the last line could not say it: brokers that just lost one of theirs may
        answer the sink's questions only once their metadata has caught up."""
        self._on_wait(waited)
        now = time.monotonic()
        if waited < _WAIT_REPORT_S:
            return
        due = now - self._wait_logged >= _WAIT_REPEAT_S
        if not due and self._wait_explained:
            return
        cause, explained = self._why_unacknowledged()
        if not due and not explained:
            return  # nothing more to say than the last line
        self._wait_logged, self._wait_explained = now, explained
        log_event(
            log,
            logging.WARNING,
            "Kafka does not acknowledge this transaction; waiting, nothing is confirmed to "
            "PostgreSQL meanwhile",
            waited_s=round(waited),
            waiting_for=what,
            gives_up_in_s=round(self._settings.kafka_transaction_timeout_ms / 1000 - waited),
            cause=cause,
        )

    def _why_unacknowledged(self) -> tuple[str, bool]:
        """A partition with fewer in-sync replicas than its topic's min.insync.replicas (the
        leader answers NOT_ENOUGH_REPLICAS, which librdkafka retries silently), or where
        else to look; and whether the brokers answered the questions that tell."""
        topics = list(self.ids.learned)
        if not topics:
            return "no topic written yet: check the brokers", True
        # A client of its own, whose metadata is fresh from the bootstrap servers: the
        # sink's may still name a broker that has just gone away as the controller, where
        # these requests go, and wait for it for minutes. In this process, though
        # describe_topics keeps ~100 bytes per topic (see topic_id_probe): it runs once a
        # minute of a wait, and needs the partitions' replicas, which the probe does not say.
        admin = AdminClient(self._client_config)
        try:
            described = admin.describe_topics(TopicCollection(topics), request_timeout=_REACH_S)
            isr = {
                (t, p.id): len(p.isr) for t, f in described.items() for p in f.result().partitions
            }
            resources = [ConfigResource(ResourceType.TOPIC, t) for t in topics]
            configs = admin.describe_configs(resources, request_timeout=_REACH_S)
            wanted: dict[str, int] = {}
            for resource, future in configs.items():
                entry = future.result().get("min.insync.replicas")
                if entry is not None:
                    wanted[resource.name] = int(entry.value)
        except KafkaException as exc:
            return (
                f"the brokers do not answer either ({explain(exc)}): check that they run, and "
                "their logs (a broker stops when its log dir fails, as on a full disk)"
            ), False
        short = [
            f"{t}-{p} has {n} in-sync replicas, min.insync.replicas={wanted[t]}"
            for (t, p), n in sorted(isr.items())
            if n < wanted.get(t, 1)
        ]
        if short:
            return (
                f"NOT_ENOUGH_REPLICAS: {'; '.join(short[:3])}: bring the replicas back, or "
                "lower the topic's min.insync.replicas"
            ), True
        return (
            "every partition has its in-sync replicas: look for errors in the brokers' logs",
            True,
        )

    def _check_topic_ids(self, timeout_s: float = 30.0) -> None:
        if self.ids.learned:
            self.ids.check(self._describe(list(self.ids.learned), timeout_s))

    def _check_topic_ids_meanwhile(self) -> None:
        """The check while records wait: briefly, and a broker that does not answer now (its
        request went to a broker going away) only skips it, as the wait goes on and is said;
        the check before the commit is never skipped."""
        try:
            self._check_topic_ids(timeout_s=_REACH_S)
        except SinkError as exc:
            if isinstance(exc, TopicReplaced):
                raise

    def _check_topic_ids_after(self, err: KafkaError | BaseException) -> None:
        """A topic deleted under a transaction fails it in more ways than ``_TOPIC_GONE``
        (a partition that cannot join it, a purged queue, an abort the broker refuses):
        after any Kafka error, TopicReplaced if a topic's id changed. A check that fails
        leaves the error as it was."""
        if not isinstance(err, KafkaError) or err.code() in _NOT_ABOUT_TOPICS:
            return
        try:
            # Briefly: when Kafka is away, the error is what matters, and it is retried.
            self._check_topic_ids(timeout_s=_REACH_S)
        except SinkError as exc:
            if isinstance(exc, TopicReplaced):
                raise

    def commit(self) -> float:
        """Commit the open transaction; returns the seconds it took."""
        started = time.monotonic()
        try:
            self._hand_over()
            self._deliver_all()
            # After every record is acknowledged: a topic deleted while they were on their
            # way got them (or some of them) in its new incarnation.
            self._check_topic_ids()
            self._end_transaction("commit_transaction")
        except (KafkaException, SystemError) as exc:
            err = cause(exc)
            known = (
                self._transaction_failed(err)
                if isinstance(err, KafkaError) and err.txn_requires_abort()
                else None
            )
            raise known or self._classify(exc) from None
        self._in_txn = False
        return time.monotonic() - started

    def topic_ids(self) -> dict[str, str]:
        return self.ids.published()

    def abort(self) -> None:
        """Abort the open transaction if there is one; errors here are only logged."""
        self._batches.drop()
        if not self._in_txn:
            return
        self._in_txn = False
        self._first.forget()
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
        ``_WAIT_REPORT_S`` (librdkafka resumes it) to say why it waits: the coordinator
        writes the markers only where the partition has its in-sync replicas. One that
        times out (Kafka away) is remembered, to be called again before anything else."""
        began = time.monotonic()
        deadline = began + (timeout_s or self._settings.kafka_transaction_timeout_ms / 1000)
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    getattr(self._producer, call)(max(0.0, min(_WAIT_REPORT_S, left)))
                except (KafkaException, SystemError) as exc:
                    err = cause(exc)
                    resumable = isinstance(err, KafkaError) and err.retriable() and not err.fatal()
                    self._unfinished = call if resumable else None
                    if not resumable or left <= _WAIT_REPORT_S:
                        raise
                    self._report_wait(time.monotonic() - began, call.split("_")[0])
                    continue
                self._unfinished = None
                return
        finally:
            self._on_wait(0.0)

    def _finish_unfinished(self, timeout_s: float | None = None) -> None:
        """Call again the commit or abort that timed out. A commit that lands now was not
        confirmed to PostgreSQL: its progress record makes the next session skip it."""
        if self._unfinished is not None:
            try:
                self._end_transaction(self._unfinished, timeout_s)
            except (KafkaException, SystemError) as exc:
                raise self._classify(exc) from None

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
        try:
            self.produce(self._settings.progress_topic, self._fence_probe_key, None)
            self._deliver_all()
        except (KafkaException, SystemError, SinkError) as exc:
            # SystemError: a delivery report served while the fatal error is pending.
            failed = exc if isinstance(exc, SinkError) else self._classify(exc)
            self.abort()
            raise failed from None
        self._in_txn = False
        try:
            # Not ``abort``, which forgets the partitions proven written (``FirstWrites``):
            # this record was acknowledged, so its partition is proven too.
            self._end_transaction(
                "abort_transaction", self._settings.kafka_transaction_timeout_ms / 1000
            )
        except (KafkaException, SystemError) as exc:
            raise self._classify(exc) from None

    def close(self) -> None:
        """Abort what is open and let go; never raises, so the error that ended the session
        is the one reported."""
        self.abort()
        self._ids_probe.close()
        try:
            self._producer.flush(5)
        except (KafkaException, SystemError) as exc:
            log_event(
                log, logging.WARNING, "Kafka producer did not close cleanly", error=explain(exc)
            )

    def _delivered(self, err: KafkaError | None, msg: Any) -> None:
        # After one record fails, the producer purges those queued behind it and may
        # report them first: the purge is the consequence, the other error the cause.
        if err is not None and (self._failure is None or self._failure.code() in _PURGED):
            self._failure = err
            self._failed_record = (msg.topic(), len(msg.value() or b""))

    def _transaction_failed(self, err: KafkaError) -> SinkError | None:
        """Why the open transaction failed, where ``err`` says only that it did: once one of
        its records fails, librdkafka purges those queued behind it, takes no more
        (``_STATE``) and fails the commit. The failed record's own delivery report says why.
        None when nothing says more than ``err``."""
        self._producer.flush(self._settings.kafka_transaction_timeout_ms / 1000)  # the reports
        failure = self._failure
        if failure is not None and failure.code() not in _PURGED:
            return self._classify(failure, "Kafka delivery failed: ")
        why = self._transaction_error()
        if why is not None and why.code() != err.code():
            return self._classify(why)
        return None

    def _transaction_error(self) -> KafkaError | None:
        """The error the open transaction failed with where no record's report has it (a
        partition the coordinator would not add to it: TOPIC_AUTHORIZATION_FAILED): in a
        failed transaction begin_transaction does nothing but answer it."""
        try:
            self._producer.begin_transaction()
        except KafkaException as exc:
            err = cause(exc)
            if isinstance(err, KafkaError) and err.txn_requires_abort():
                return err
        return None

    def _classify(
        self,
        exc: KafkaException | KafkaError | SystemError,
        what: str = "Kafka: ",
        record: tuple[str, int] | None = None,
    ) -> SinkError:
        timeout_ms = self._settings.kafka_transaction_timeout_ms
        age = time.monotonic() - self._began
        if self._in_txn and age * 1000 > timeout_ms:
            # The coordinator aborts a transaction open past its timeout and fences the
            # producer: the error then reads "fenced", but nobody else took over.
            return SinkError(
                f"the Kafka transaction was open {age:.0f}s, past kafka_transaction_timeout_ms "
                f"({timeout_ms} ms), and the broker aborted it; a new session publishes it "
                "again. If the brokers acknowledged slowly, the earlier warnings say why; if they"
                " are healthy, raise kafka_transaction_timeout_ms (at most the brokers' "
                "transaction.max.timeout.ms) for batches this large"
            )
        # A fenced producer's error often comes wrapped in a SystemError: unwrap it, or the
        # bridge would reconnect and fence the bridge that fenced it, in turn.
        err = cause(exc)
        self._check_topic_ids_after(err)
        if (
            isinstance(err, KafkaError)
            and err.code() == KafkaError._STATE
            and self._in_txn
            and err is not self._failure
        ):
            known = self._transaction_failed(err)
            if known is not None:
                return known
        if isinstance(err, KafkaError) and err.code() in _TOO_LARGE:
            topic, size = record or self._failed_record or ("?", 0)
            if topic in self._ready:
                # This session made the topic's limit fit (ensure_topics): it was lowered
                # since, and a new session makes it fit again.
                return SinkError(
                    f"{what}{err.name()}: Kafka refused a record of {size} bytes for topic "
                    f"{topic}, whose max.message.bytes this session had set to take it: it was "
                    "lowered meanwhile; a new session raises it again"
                )
            return KafkaRefused(
                f"{what}{err.name()}: Kafka refused a record of {size} bytes for topic {topic} "
                f"as too large: its max.message.bytes (the brokers' message.max.bytes if it "
                f"has none) must be at least {self.record_limit} for max_row_bytes="
                f"{self._settings.max_row_bytes}; set it, or lower max_row_bytes"
            )
        if isinstance(err, KafkaError) and err.code() in (
            KafkaError._FENCED,
            KafkaError.PRODUCER_FENCED,
            KafkaError.INVALID_PRODUCER_EPOCH,
        ):
            return FencedError(
                f"another bridge took over slot {self._settings.slot_name} "
                f"(transactional id {self._settings.transactional_id}); this one stops"
            )
        if isinstance(err, KafkaError) and err.code() in _NOT_AUTHORIZED:
            user = self._settings.kafka_config.get("sasl.username")
            principal = f"principal User:{user}" if user else "bridge's principal"
            return KafkaRefused(
                f"{what}{explain(err)} (the {principal}, transactional id "
                f"{self._settings.transactional_id}, topics {self._settings.topic_prefix}.*); "
                "start the bridge again once granted: what was not confirmed is published then"
            )
        if isinstance(err, KafkaError) and err.fatal():
            return producer_failed(err, self._settings.transactional_id)
        return SinkError(f"{what}{explain(err)}")


def producer_failed(err: KafkaError, transactional_id: str) -> ProducerFailed:
    """The one line for a fatal producer error that is not fencing (checked first)."""
    return ProducerFailed(
        f"Kafka: the transactional producer failed for good ({explain(err)}): it can commit "
        "nothing more and cannot tell whether another bridge took the slot over, so this "
        f"bridge stops; start it again once the cause is fixed: its new producer registers "
        f"transactional id {transactional_id} afresh, and what was not confirmed is published "
        "again, once"
    )
