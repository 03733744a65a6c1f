"""The transactional sink against the real broker: what Kafka refuses must fail the commit."""

from __future__ import annotations

import base64
import json
import os
import time
import uuid

import pytest
from confluent_kafka import Consumer, Producer, cimpl
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from services.bridge import _rdsend
from services.bridge.events import Record
from services.bridge.settings import BridgeSettings
from services.bridge.sink import (
    FencedError,
    KafkaRefused,
    KafkaSink,
    SinkError,
    UnnamedDeliveryFailure,
)
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import read_topics


def _settings(stack: Stack, name: str, **extra: object) -> BridgeSettings:
    return BridgeSettings(
        source_dsn="host=unused",
        kafka_bootstrap=stack.kafka_bootstrap,
        slot_name=name,
        topic_prefix=name,
        http_port=0,
        **extra,  # type: ignore[arg-type]
    )


def test_refused_record_aborts_the_transaction(stack: Stack) -> None:
    """Only failed deliveries are reported to Python; the commit must still hear of them,
    and say in one line which topic refused what (a fatal error: no retry changes it)."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    # A topic made elsewhere with a small record limit: the broker refuses our big record.
    admin.create_topics([NewTopic(name, 1, 1, config={"max.message.bytes": "2000"})])[name].result()
    sink = KafkaSink(_settings(stack, name))
    try:
        sink.start()
        sink.begin()  # not through ensure_topics, which would raise the topic's limit
        sink.produce(name, b"k", b'"small"')
        # Random, so that compression cannot bring it under the limit.
        sink.produce(name, b"k", b'"%s"' % base64.b64encode(os.urandom(50_000)))
        # Purged when the big one fails: the purge must not hide the broker's reason.
        for n in range(200):
            sink.produce(name, b"k%d" % n, b'"behind it"')
        with pytest.raises(
            KafkaRefused, match="Kafka delivery failed: MSG_SIZE_TOO_LARGE"
        ) as refused:
            sink.commit()
    finally:
        sink.close()  # aborts
    assert read_topics(stack.kafka, [name]) == []  # nothing of it is visible
    text = str(refused.value)
    assert f"topic {name}" in text and "max.message.bytes" in text and "\n" not in text


def test_transaction_open_past_its_timeout_says_so(stack: Stack) -> None:
    """The broker aborts it and fences the producer; the error must name the setting, not
    blame another bridge."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(_settings(stack, name, kafka_transaction_timeout_ms=1000))
    try:
        sink.start()
        sink.ensure_topics({name: False})
        sink.begin()
        deadline = time.monotonic() + 60  # the broker looks for expired ones every 10s
        with pytest.raises(SinkError, match="past kafka_transaction_timeout_ms") as caught:
            while time.monotonic() < deadline:
                sink.produce(name, b"k", b'"v"')
                time.sleep(0.2)
        assert not isinstance(caught.value, FencedError)
    finally:
        sink.close()
    assert read_topics(stack.kafka, [name]) == []


@pytest.mark.parametrize("checked", [False, True], ids=["rdsend", "checked"])
def test_records_keep_their_order_across_both_paths(stack: Stack, checked: bool) -> None:
    """Runs of plain records go to librdkafka in one call each (_rdsend), the others (with
    headers, or while its queue is full: 500 records here) through produce(); a checked
    sink sends all through produce(). Per partition, Kafka must hold them exactly in the
    order given."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(
        _settings(stack, name, kafka_config={"queue.buffering.max.messages": "500"}),
        checked=checked,
    )
    assert (sink._direct is None) == checked
    topics = [f"{name}.a", f"{name}.b"]
    records: list[Record] = []
    for n in range(20_000):
        topic = topics[(n // 700) % 2]  # runs of 700 records per topic
        key = None if n % 97 == 0 else b'{"id":%d}' % n
        value = None if n % 89 == 0 else b'{"n":%d}' % n
        records.append((topic, key, value, [("h", b"%d" % n)] if n % 53 == 0 else None))
    try:
        sink.start()
        sink.begin()
        assert sink.produce_all(iter(records), ()) == len(records)
        sink.commit()
    finally:
        sink.close()
    got = read_topics(stack.kafka, topics)
    for topic in topics:
        expected = [
            (None if k is None else json.loads(k), None if v is None else json.loads(v))
            for t, k, v, _ in records
            if t == topic
        ]
        assert [(r.key, r.value) for r in got if r.topic == topic] == expected


def test_refusal_of_a_record_sent_unchecked_fails_the_commit(stack: Stack) -> None:
    """A record sent through _rdsend has no delivery report of its own: when the broker
    refuses it, the commit must still fail, nothing of the transaction may be visible, and
    the error must say the next session checks every record (the daemon then uses
    ``checked=True``: produce(), whose reports name the record, as the test above shows)."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    admin.create_topics([NewTopic(name, 1, 1, config={"max.message.bytes": "2000"})])[name].result()
    big = b'"%s"' % base64.b64encode(os.urandom(50_000))
    sink = KafkaSink(_settings(stack, name))
    assert sink._direct is not None
    try:
        sink.start()
        sink.begin()  # not through ensure_topics, which would raise the topic's limit
        sink.produce(name, b"k", b'"small"')  # the partition's first write: now proven
        sink.produce_all(iter([(name, b"k", big, None), (name, b"k", b'"behind"', None)]), ())
        with pytest.raises(UnnamedDeliveryFailure) as failed:
            sink.commit()
    finally:
        sink.close()  # aborts
    text = str(failed.value)
    assert "MSG_SIZE_TOO_LARGE" in text and name in text and "\n" not in text
    assert "every record checked" in text
    checked = KafkaSink(_settings(stack, name), checked=True)
    assert checked._direct is None
    checked.close()
    assert read_topics(stack.kafka, [name]) == []


def test_records_behind_an_unchecked_refusal_fail_the_transaction_too(stack: Stack) -> None:
    """Once a record of the transaction failed, librdkafka takes no more (``_STATE``): a
    record sent through produce() behind one refused unreported (these carry headers) must
    fail the same way, as UnnamedDeliveryFailure, never as a bare state error the next
    session would meet again."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    admin.create_topics([NewTopic(name, 1, 1, config={"max.message.bytes": "2000"})])[name].result()
    big = b'"%s"' % base64.b64encode(os.urandom(50_000))
    behind: list[Record] = [
        (name, b"k%d" % n, b'"behind"', [("h", b"%d" % n)]) for n in range(2000)
    ]
    sink = KafkaSink(_settings(stack, name))
    try:
        sink.start()
        sink.begin()  # not through ensure_topics, which would raise the topic's limit
        sink.produce(name, b"k", b'"small"')  # the partition's first write: now proven
        with pytest.raises(UnnamedDeliveryFailure, match="every record checked"):
            sink.produce_all(iter([(name, b"k", big, None), *behind]), ())
            time.sleep(1)  # the refusal is in by now, whichever call hears of it
            sink.produce_all(iter(behind), ())
            sink.commit()
    finally:
        sink.close()  # aborts
    assert read_topics(stack.kafka, [name]) == []


def test_rdsend_binds_only_to_a_confluent_kafka_producer(stack: Stack) -> None:
    """_rdsend reads the handle out of the Producer object: it must refuse anything whose
    layout it cannot vouch for, a subclass included, rather than read a stray pointer."""

    class MyProducer(Producer):
        pass

    config = {"bootstrap.servers": stack.kafka_bootstrap}
    consumer = Consumer({**config, "group.id": f"g{uuid.uuid4().hex[:8]}"})
    try:
        for other in (object(), consumer, MyProducer(config)):
            with pytest.raises(TypeError, match="not a confluent-kafka Producer"):
                _rdsend.bind(cimpl.__file__, other)  # type: ignore[arg-type]
    finally:
        consumer.close()
    sender = _rdsend.bind(cimpl.__file__, Producer(config))
    with pytest.raises(TypeError):
        sender.send((), 0, set())  # type: ignore[arg-type]
    assert sender.send([], 0, set()) == (0, 0)
