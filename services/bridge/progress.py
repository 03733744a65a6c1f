"""Where the bridge stands: what Kafka holds, what the origin says, what may be confirmed.

The rule (the README's first section; the team's shared ARCHITECTURE.md, "Exactly once"):
``high_water = max(origin progress, last committed Kafka progress record)``; every
transaction ending at or below it was published already and is skipped. The origin is
WAL-logged, so a promoted standby carries it; the Kafka record closes the window between a
Kafka commit and the origin update.

What may be confirmed to the slot is a separate, lower bound (``ConfirmTracker``): never
past what Kafka holds, and never past a prepared transaction not yet published - once the
slot's confirmed position passes a PREPARE, the server will not send its content again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from services.common.kafka import explain
from services.common.logs import log_event
from services.common.lsn import format_lsn, parse_lsn
from services.common.pg import SourceRefused
from services.contract.records import ProgressRecord, TableSnapshot

log = logging.getLogger(__name__)


class ProgressError(Exception):
    """The recorded progress contradicts the server we are connected to."""


@dataclass(frozen=True, slots=True)
class ServerIdentity:
    system_identifier: str
    timeline: int


def high_water(origin_lsn: int, kafka: ProgressRecord | None) -> int:
    return max(origin_lsn, kafka.end_lsn if kafka is not None else 0)


class IdentityError(ProgressError):
    """This server cannot be where the published progress came from.

    The message is the problem and what to do; ``problem`` alone serves a caller that
    moves on to another server instead.
    """

    def __init__(
        self, problem: str, remedy: str, server: ServerIdentity, published: ProgressRecord
    ) -> None:
        super().__init__(f"{problem}; {remedy}")
        self.problem = problem
        self.server = server
        self.published = published


def check_identity(server: ServerIdentity, kafka: ProgressRecord | None, slot: str) -> None:
    """Refuse a server that cannot be where our progress came from (``IdentityError``).

    A different system identifier is another cluster altogether; an older timeline is an
    old primary that came back after a failover - its slot may be behind what we
    published, and its WAL may hold transactions the new primary never had.
    """
    if kafka is None:
        return
    if kafka.system_identifier != server.system_identifier:
        raise IdentityError(
            f"slot {slot}'s published progress came from PostgreSQL system "
            f"{kafka.system_identifier}, but this server is system {server.system_identifier}",
            "point source_dsn at the right cluster (or use another slot_name/progress_topic)",
            server,
            kafka,
        )
    if server.timeline < kafka.timeline:
        raise IdentityError(
            f"server is on timeline {server.timeline} but slot {slot} already published from "
            f"timeline {kafka.timeline}: this looks like an old primary after a failover",
            "point source_dsn at the current primary",
            server,
            kafka,
        )


class OriginStore:
    """The replication origin that records the last published commit, over plain SQL.

    Its functions are superuser-only by default; a role without the GRANT gets one line
    naming the function and the GRANT to run, and the daemon stops (``SourceRefused``).
    """

    def __init__(self, conn: psycopg.Connection[tuple[object, ...]], name: str) -> None:
        self._conn = conn
        self.name = name

    def exists(self) -> bool:
        with self._conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_replication_origin WHERE roname = %s", (self.name,))
            return cur.fetchone() is not None

    def ensure(self) -> None:
        if self.exists():
            return
        try:
            self._call("pg_replication_origin_create", "text", "%s", (self.name,))
        except psycopg.errors.UniqueViolation:
            return  # another bridge starting on the slot created it since we looked
        log_event(log, logging.INFO, "created replication origin", origin=self.name)

    def progress(self) -> int:
        """The recorded position; 0 while the origin does not exist."""
        if not self.exists():
            return 0
        value = self._call(
            "pg_replication_origin_progress", "text, boolean", "%s, true", (self.name,)
        )
        return parse_lsn(str(value)) if value else 0

    def advance(self, lsn: int) -> None:
        self._call(
            "pg_replication_origin_advance",
            "text, pg_lsn",
            "%s, %s::pg_lsn",
            (self.name, format_lsn(lsn)),
        )

    def _call(self, function: str, signature: str, args: str, params: tuple[object, ...]) -> object:
        try:
            with self._conn.cursor() as cur:
                cur.execute(f"SELECT {function}({args})", params)
                row = cur.fetchone()
        except psycopg.errors.InsufficientPrivilege:
            raise SourceRefused(
                f"the bridge's role may not call {function}; as a superuser run GRANT EXECUTE "
                f"ON FUNCTION {function}({signature}) TO {self._conn.info.user}"
            ) from None
        return row[0] if row else None


def _consumer(client_config: dict[str, object]) -> Consumer:
    return Consumer(
        {
            **client_config,
            "group.id": f"slotbridge-reader-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )


def _bounds(consumer: Consumer, topic: str, timeout_s: float) -> tuple[int, int] | None:
    tmeta = consumer.list_topics(topic, timeout=timeout_s).topics.get(topic)
    if tmeta is None or tmeta.error is not None or not tmeta.partitions:
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            low, high = consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=timeout_s)
            return int(low), int(high)
        except KafkaException:
            # A partition that just got its leader answers "not leader" for a moment.
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _scan(
    consumer: Consumer, topic: str, start: int, end: int, timeout_s: float
) -> Iterator[tuple[bytes | None, bytes | None]]:
    """Committed (key, value) pairs of partition 0 from ``start`` up to ``end``."""
    consumer.assign([TopicPartition(topic, 0, start if start > 0 else OFFSET_BEGINNING)])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        msg = consumer.poll(1.0)
        if msg is None:
            continue
        error = msg.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                return
            raise KafkaException(error)
        offset = msg.offset()
        if offset is not None and offset >= end:
            return
        yield msg.key(), msg.value()
    raise ProgressError(f"timed out reading topic {topic}")


def read_kafka_progress(
    client_config: dict[str, object], topic: str, slot: str, timeout_s: float = 30.0
) -> ProgressRecord | None:
    """The last committed progress record for ``slot``, or None if there is none.

    Reads backwards in growing windows from the end of the (single-partition) topic, so
    the cost does not grow with the topic's history before compaction catches up. The
    caller must have initialised its transactional producer first: a killed
    predecessor's open transaction would otherwise hold back what read_committed sees.
    """
    consumer = _consumer(client_config)
    wanted = progress_key(slot)
    try:
        bounds = _bounds(consumer, topic, timeout_s)
        if bounds is None:
            return None
        low, end = bounds
        window = 256
        while end > low:
            start = max(low, end - window)
            latest = None
            for key, value in _scan(consumer, topic, start, end, timeout_s):
                if key == wanted and value is not None:
                    latest = value
            if latest is not None:
                return ProgressRecord.model_validate(json.loads(latest))
            end, window = start, window * 4
        return None
    except KafkaException as exc:
        raise ProgressError(f"cannot read progress topic {topic}: {explain(exc)}") from None
    finally:
        consumer.close()


def read_topic(
    client_config: dict[str, object], topic: str, timeout_s: float = 60.0
) -> list[tuple[bytes | None, bytes | None]]:
    """Every committed record of a small single-partition topic (the schema topic)."""
    consumer = _consumer(client_config)
    try:
        bounds = _bounds(consumer, topic, timeout_s)
        if bounds is None:
            return []
        return list(_scan(consumer, topic, bounds[0], bounds[1], timeout_s))
    except KafkaException as exc:
        raise ProgressError(f"cannot read topic {topic}: {explain(exc)}") from None
    finally:
        consumer.close()


def progress_key(slot: str) -> bytes:
    return json.dumps({"slot": slot}).encode()


def progress_value(
    slot: str,
    end_lsn: int,
    commit_lsn: int,
    identity: ServerIdentity,
    snapshots: Sequence[TableSnapshot] = (),
) -> bytes:
    return json.dumps(
        {
            "slot": slot,
            "end_lsn": end_lsn,
            "commit_lsn": commit_lsn,
            "system_identifier": identity.system_identifier,
            "timeline": identity.timeline,
            "ts_ms": int(time.time() * 1000),
            "snapshots": [snap.model_dump(by_alias=True) for snap in snapshots],
        }
    ).encode()


class ConfirmTracker:
    """What may be confirmed to the slot, shared by the socket loop and the publisher."""

    def __init__(self, start: int) -> None:
        self._lock = threading.Lock()
        self._published = start
        self._prepared: dict[str, int] = {}  # gid -> prepare LSN, until published/rolled back

    def published(self, end_lsn: int) -> None:
        with self._lock:
            self._published = max(self._published, end_lsn)

    def prepared(self, gid: str, prepare_lsn: int) -> None:
        with self._lock:
            self._prepared[gid] = prepare_lsn

    def finished(self, gid: str) -> None:
        with self._lock:
            self._prepared.pop(gid, None)

    def confirmable(self) -> int:
        with self._lock:
            if self._prepared:
                return min(self._published, min(self._prepared.values()) - 1)
            return self._published

    @property
    def published_lsn(self) -> int:
        return self._published
