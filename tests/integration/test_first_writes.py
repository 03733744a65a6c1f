"""KAFKA-15591 on demand: the first produce request to a partition fails, a later one wins.

The fault proxy answers the first request that carries a partition with the error a broker
gives while it applies the partition's creation (NOT_LEADER_OR_FOLLOWER) and writes none of
its records, holding the answer back so that a pipelining producer sends its later batches
first. Every released broker up to 4.4 then stores those later batches (it has no producer
state to say they are out of order) and takes the retried first one for a duplicate.

With the sink's guard the first record to each partition is alone in flight, so nothing
can overtake it; without it (the same sink, guard switched off) the log loses records.
Both outcomes are judged from the broker's log segments, not from a consumer.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from confluent_kafka import Producer

# Their public home, confluent_kafka.admin (its stubs do not declare the re-export).
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    NewTopic,
)

from services.bridge.settings import BridgeSettings
from services.bridge.sink.kafka import KafkaSink
from services.bridge.sink.partitioner import partition_for
from slotbridge_dev.stack.kafka_audit import audit_topics
from slotbridge_dev.stack.kafka_proxy import KafkaFaultProxy
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import read_topics


@pytest.fixture
def proxy(stack: Stack) -> Iterator[KafkaFaultProxy]:
    faulty = KafkaFaultProxy(stack.kafka_bootstrap, fail_first_produce=True, hold_s=0.5)
    yield faulty.start()
    faulty.stop()


def _write_two_transactions(sink: KafkaSink, topics: list[str]) -> int:
    """Records at a producer's natural pace: each ~20 ms apart, so several requests go to a
    partition while its first is still unanswered. Returns how many were committed."""
    sent = 0
    for txn in range(2):
        sink.begin()
        for i in range(30):
            for topic in topics:
                sink.produce(topic, b'{"id":%d}' % (txn * 100 + i), b'{"n":%d}' % sent)
                sent += 1
            time.sleep(0.02)
        sink.commit()
    return sent


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
def test_first_writes_to_new_partitions_survive_a_failed_first_request(
    stack: Stack,
    proxy: KafkaFaultProxy,
    guard: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = f"fw{uuid.uuid4().hex[:8]}"
    # One topic the sink creates (three partitions), one that exists but this producer id
    # never wrote: both are new to it.
    existing = f"{name}.existing"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    admin.create_topics([NewTopic(existing, 2, 1)])[existing].result()
    settings = BridgeSettings(
        source_dsn="host=unused",
        kafka_bootstrap=proxy.bootstrap,
        slot_name=name,
        topic_prefix=name,
        topic_partitions=3,
        http_port=0,
    )
    sink = KafkaSink(settings)
    if not guard:
        monkeypatch.setattr(sink._first, "is_new", lambda _topic, _partition: False)
    topics = [f"{name}.created", existing]
    try:
        sink.start()
        sink.topics.ensure({f"{name}.created": False})
        sent = _write_two_transactions(sink, topics)
    finally:
        sink.close()

    report, committed = audit_topics(stack.kafka, topics)
    print(f"\nguard={guard} sent={sent} sabotaged={len(proxy.stats.sabotaged)} {report.summary()}")
    assert len(proxy.stats.sabotaged) == 5, proxy.stats  # every partition's first request
    consumed = read_topics(stack.kafka, topics)
    if guard:
        report.assert_clean()
        assert report.committed == len(committed) == len(consumed) == sent
    else:
        # The reproduction works: first requests were lost, every commit succeeded.
        assert report.kinds["lost"] > 0, report.summary()
        assert any("acknowledged but never stored" in p for p in report.problems)
        assert len(consumed) < sent


def test_sink_partitions_keys_as_librdkafka_does(stack: Stack) -> None:
    """Records the guard places itself must land where librdkafka's murmur2_random puts the
    same key afterwards, or a key's changes would split over two partitions."""
    topic = f"part{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 7, 1)])[topic].result()
    producer = Producer(
        {"bootstrap.servers": stack.kafka_bootstrap, "partitioner": "murmur2_random"}
    )
    placed: dict[bytes, int] = {}

    def remember(err: object, msg: object) -> None:
        assert err is None, err
        placed[msg.key()] = msg.partition()  # type: ignore[attr-defined]

    keys = [b'{"id":%d}' % i for i in range(300)] + [b'{"k":"\xc3\xa9t\xc3\xa9"}']
    for key in keys:
        producer.produce(topic, key=key, value=b"{}", on_delivery=remember)
    assert producer.flush(30) == 0
    assert {key: partition_for(key, 7) for key in keys} == placed
