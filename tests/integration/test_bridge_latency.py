"""A quiet stream's transactions are committed to Kafka at once, not when the batch's time
budget runs out, and the commit-to-visible histogram counts them; the broker's round trip
is a metric too."""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from slotbridge_dev.stack.cluster import free_ports
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, metric, sql, wait_for

SCHEMA = "lat"
BATCH_MAX_MS = 5000
# Far below BATCH_MAX_MS, far above a commit on a busy shared machine (~10-50 ms).
VISIBLE_WITHIN_S = 1.5
INSERTS = 3


def _histogram(text: str, name: str, slot: str) -> dict[str, float]:
    """The histogram's samples of this slot: {"count": n, "sum": s, "le=0.005": n, ...}."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.labels.get("slot") != slot:
                continue
            kind = sample.name.removeprefix(name + "_")
            key = f"le={sample.labels['le']}" if kind == "bucket" else kind
            samples[key] = sample.value
    return samples


def test_quiet_stream_is_visible_before_the_batch_time_budget(stack: Stack, tmp_path: Path) -> None:
    sql(
        stack.primary_dsn,
        f"""
        DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA};
        CREATE TABLE {SCHEMA}.t (id int PRIMARY KEY, note text);
        INSERT INTO {SCHEMA}.t VALUES (0, 'before the slot');""",
    )
    port = free_ports(1)[0]
    pipe = Pipeline(
        stack,
        [f"{SCHEMA}.t"],
        tmp_path,
        extra={"SLOTBRIDGE_BATCH_MAX_MS": str(BATCH_MAX_MS), "SLOTBRIDGE_HTTP_PORT": str(port)},
    )
    pipe.start()
    consumer: Consumer | None = None
    try:
        pipe.wait_caught_up(60)  # the snapshot created the topic
        consumer = Consumer(
            {
                "bootstrap.servers": stack.kafka.bootstrap,
                "group.id": f"test-{uuid.uuid4()}",
                "isolation.level": "read_committed",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 10,
            }
        )
        topic = TopicPartition(pipe.topic(f"{SCHEMA}.t"), 0)
        _low, end = consumer.get_watermark_offsets(topic, timeout=10)
        consumer.assign([TopicPartition(topic.topic, 0, end)])
        for i in range(1, INSERTS + 1):
            started = time.monotonic()
            sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES ({i}, 'quiet')")
            msg = consumer.poll(BATCH_MAX_MS / 1000 * 2)
            elapsed = time.monotonic() - started
            assert msg is not None and msg.error() is None, msg and msg.error()
            value = msg.value()
            assert value is not None and json.loads(value)["after"]["id"] == i, value
            assert elapsed < VISIBLE_WITHIN_S, (
                f"insert {i} visible after {elapsed:.3f}s (batch_max_ms {BATCH_MAX_MS})"
            )
            time.sleep(0.5)  # quiet again

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
        seen = _histogram(metrics, "slotbridge_commit_to_visible_seconds", pipe.name)
        # Only the inserts: the snapshot chunk's watermark transaction is no source change.
        assert seen["count"] == INSERTS, seen
        assert seen["le=2.5"] == INSERTS, seen
        assert 0 < seen["sum"] < INSERTS * VISIBLE_WITHIN_S, seen
        # From librdkafka's statistics, every 5 s; an idle bridge's fence check every 5 s
        # makes requests, so a window with round trips comes.
        rtt = wait_for(
            lambda: metric(port, "slotbridge_kafka_broker_rtt_seconds"), 60, "the round trip"
        )
        quantiles = {label.split('quantile="')[1].split('"')[0] for label in rtt}
        assert quantiles == {"0.5", "0.99"} and all(f'slot="{pipe.name}"' in k for k in rtt), rtt
        assert all(0 < v < 60 for v in rtt.values()), rtt
        (queue,) = metric(port, "slotbridge_kafka_producer_queue_seconds").values()
        assert 0 <= queue < 60, queue
        assert pipe.stop() == 0
        pipe.audit()
    finally:
        if consumer is not None:
            consumer.close()
        pipe.cleanup()
