"""The transactional sink against the real broker: what Kafka refuses must fail the commit."""

from __future__ import annotations

import base64
import os
import time
import uuid

import pytest
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from services.bridge.settings import BridgeSettings
from services.bridge.sink import FencedError, KafkaRefused, KafkaSink, SinkError
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import read_topics


def test_refused_record_aborts_the_transaction(stack: Stack) -> None:
    """Only failed deliveries are reported to Python; the commit must still hear of them,
    and say in one line which topic refused what (a fatal error: no retry changes it)."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    # A topic made elsewhere with a small record limit: the broker refuses our big record.
    admin.create_topics([NewTopic(name, 1, 1, config={"max.message.bytes": "2000"})])[name].result()
    settings = BridgeSettings(
        source_dsn="host=unused",
        kafka_bootstrap=stack.kafka_bootstrap,
        slot_name=name,
        topic_prefix=name,
        http_port=0,
    )
    sink = KafkaSink(settings)
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
    settings = BridgeSettings(
        source_dsn="host=unused",
        kafka_bootstrap=stack.kafka_bootstrap,
        slot_name=name,
        topic_prefix=name,
        http_port=0,
        kafka_transaction_timeout_ms=1000,
    )
    sink = KafkaSink(settings)
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
