"""Reading committed records back from Kafka: the slot's last progress record (the other
half of the high-water mark, ``highwater``) and the small schema topic.

Both topics have one partition; reads are ``read_committed``, so an aborted or still open
transaction's records are never taken for published ones.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from services.bridge.progress.record import parse_progress, progress_key
from services.common.errors import SlotbridgeError
from services.common.kafka import END_READER_CONFIG, explain
from services.contract.records import ProgressRecord


class TopicReadError(SlotbridgeError):
    """A topic could not be read back from Kafka (an error or a timeout); the message names
    the topic and the cause."""

    retryable = True  # the broker was away or slow; a new session reads again


def _consumer(client_config: dict[str, object]) -> Consumer:
    return Consumer(
        {
            **client_config,
            **END_READER_CONFIG,
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
    raise TopicReadError(f"timed out reading topic {topic}")


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
                return parse_progress(latest, topic)
            end, window = start, window * 4
        return None
    except KafkaException as exc:
        raise TopicReadError(f"cannot read progress topic {topic}: {explain(exc)}") from None
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
        raise TopicReadError(f"cannot read topic {topic}: {explain(exc)}") from None
    finally:
        consumer.close()
