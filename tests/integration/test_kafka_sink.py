"""The transactional sink against the real broker: a record Kafka refuses fails the commit."""

from __future__ import annotations

import base64
import os
import uuid

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from services.bridge.settings import BridgeSettings
from services.bridge.sink import KafkaSink, SinkError
from services.stack.stack import Stack
from tests.integration.bridge_harness import read_topics


def test_refused_record_aborts_the_transaction(stack: Stack) -> None:
    """Only failed deliveries are reported to Python; the commit must still hear of them."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    # A topic made elsewhere with a small record limit: the broker refuses our big record.
    admin.create_topics([NewTopic(name, 1, 1, config={"max.message.bytes": "2000"})])[
        name].result()
    settings = BridgeSettings(source_dsn="host=unused", kafka_bootstrap=stack.kafka_bootstrap,
                              slot_name=name, topic_prefix=name, http_port=0)
    sink = KafkaSink(settings)
    try:
        sink.start()
        sink.ensure_topics({name: False})  # exists: left as it is
        sink.begin()
        sink.produce(name, b"k", b'"small"')
        # Random, so that compression cannot bring it under the limit.
        sink.produce(name, b"k", b'"%s"' % base64.b64encode(os.urandom(50_000)))
        with pytest.raises(SinkError, match="Kafka delivery failed: MSG_SIZE_TOO_LARGE"):
            sink.commit()
    finally:
        sink.close()  # aborts
    assert read_topics(stack.kafka_bootstrap, [name]) == []  # nothing of it is visible
