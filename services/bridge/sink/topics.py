"""The topics the sink writes: made ready for the largest record, and known by their id.

Topics are known by their Kafka topic id, not their name (``TopicIds``): a topic deleted
under the bridge loses what was published there, and a broker that auto-creates topics
brings it back empty on another client's metadata request (never the bridge's producer:
``producer_config``), where writing on would hide the loss. Everything here goes through
the admin client or the topic id probe, never the producer: the sink asks, the producer
writes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicCollection

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
from services.bridge.sink.errors import KafkaRefused, SinkError, TopicReplaced
from services.bridge.sink.topic_id_probe import ProbeError, TopicIdProbe
from services.common.kafka import explain
from services.common.logs import log_event

log = logging.getLogger(__name__)

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
# How long a diagnostic request waits for the brokers.
_DIAGNOSE_S = 10.0
# How long every answer must say a topic does not exist before the sink believes it. Each
# broker answers from its own copy of the cluster's metadata, which follows the controller's
# by a moment: on a loaded two-broker cluster, one topic in three that CreateTopics had just
# created was unknown to some of the answers that followed, sometimes after another broker
# had named it (test_kafka_sink: ...lags_are_known_by_their_ids).
_ABSENT_FOR_S = 5.0


def record_limit(settings: BridgeSettings) -> int:
    """The largest record the bridge may write, with its batch's overhead."""
    return settings.max_row_bytes + RECORD_SLACK


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


class Topics:
    """The sink's topics: created or fitted to the largest record before they are written,
    their partition counts, and their ids checked against what was published."""

    def __init__(self, settings: BridgeSettings, client_config: dict[str, Any]) -> None:
        self._settings = settings
        self._admin = AdminClient(client_config)
        self._client_config = client_config  # for a fresh admin client (see why_unacknowledged)
        self._ids_probe = TopicIdProbe(client_config)  # not the admin client: see topic_id_probe
        self.record_limit = record_limit(settings)
        # Topics written this session: created, or their record limit checked.
        self.ready: set[str] = set()
        self._partitions: dict[str, int] = {}  # partition count per existing topic
        self.ids = TopicIds()

    def start(self, timeout_s: float) -> None:
        """Learn the cluster's topics, and refuse a max_row_bytes no broker can take."""
        metadata = self._admin.list_topics(timeout=timeout_s)
        self._check_request_limit(list(metadata.brokers))
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

    def partition_count(self, topic: str) -> int:
        count = self._partitions.get(topic)
        if count is None:
            self._learn(self._admin.list_topics(topic, timeout=30).topics)
            count = self._partitions.get(topic)
            if count is None:
                raise SinkError(f"topic {topic} has no partitions; check the Kafka brokers")
        return count

    def ensure(self, topics: dict[str, bool]) -> None:
        """Make the given topics (name -> compacted) ready for records up to max_row_bytes:
        create those that do not exist, raise the limit of those that take less."""
        todo = {t: c for t, c in topics.items() if t not in self.ready}
        if not todo:
            return
        existing = [t for t in todo if t in self._partitions]
        missing = {t: c for t, c in todo.items() if t not in self._partitions}
        if missing:
            existing += self._create(missing)
            self._wait_for_leaders(list(missing))
        found = self._describe(list(todo))
        gone = sorted(t for t, now in found.items() if now is None)
        if gone:
            raise SinkError(
                f"topics {', '.join(gone)} were deleted as the bridge made them ready; the "
                "session restarts and creates them again"
            )
        self.ids.check(found, created=missing)
        if existing:
            self._align_limits(existing)
        self.ready.update(todo)

    def expect_ids(self, published: dict[str, str]) -> None:
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

    def check_ids(self, timeout_s: float = 30.0) -> None:
        """TopicReplaced if a topic written this session has another id now."""
        if self.ids.learned:
            self.ids.check(self._describe(list(self.ids.learned), timeout_s))

    def check_ids_briefly(self) -> None:
        """``check_ids`` where an answer is not needed now (a wait goes on, an error is
        reported anyway): a broker that does not answer (its request went to a broker going
        away) only skips it; a replaced topic still raises."""
        try:
            self.check_ids(timeout_s=_DIAGNOSE_S)
        except SinkError as exc:
            if isinstance(exc, TopicReplaced):
                raise

    def _describe(self, topics: list[str], timeout_s: float = 30.0) -> dict[str, str | None]:
        """Each topic's id now; None for one that does not exist: that is every answer for
        ``_ABSENT_FOR_S``, for one broker's "unknown topic" may only mean that its metadata
        has not caught up yet. Believed at once, it left a topic just created without its
        id (unchecked, and out of ``why_unacknowledged``), or called one the bridge had just
        written deleted, which stops the bridge for good."""
        found = self._ask_ids(topics, timeout_s)
        since = time.monotonic()
        while True:
            absent = [t for t, now in found.items() if now is None]
            if not absent or time.monotonic() - since >= _ABSENT_FOR_S:
                return found
            time.sleep(0.2)
            found.update(self._ask_ids(absent, timeout_s))

    def _ask_ids(self, topics: list[str], timeout_s: float) -> dict[str, str | None]:
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

    def why_unacknowledged(self) -> tuple[str, bool]:
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
            described = admin.describe_topics(TopicCollection(topics), request_timeout=_DIAGNOSE_S)
            isr = {
                (t, p.id): len(p.isr) for t, f in described.items() for p in f.result().partitions
            }
            resources = [ConfigResource(ResourceType.TOPIC, t) for t in topics]
            configs = admin.describe_configs(resources, request_timeout=_DIAGNOSE_S)
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

    def close(self) -> None:
        self._ids_probe.close()
