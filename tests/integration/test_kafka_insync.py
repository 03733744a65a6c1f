"""Kafka refusing writes for want of in-sync replicas (issue #32 item 5).

A single broker takes acks=all on a one-replica topic whatever its min.insync.replicas
(the minimum is capped at the replicas the partition has), so this needs two brokers: the
topic has a replica on each, min.insync.replicas=2, and the follower goes away.
"""

from __future__ import annotations

from pathlib import Path

# Their public home, confluent_kafka.admin (its stubs do not declare the re-export).
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from slotbridge_dev.stack.cluster import free_ports
from slotbridge_dev.stack.kafka import Kafka
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import (
    CounterWorkload,
    Pipeline,
    kafka_write_wait,
    unpublished_commits,
    wait_for,
)


def _set_min_insync(admin: AdminClient, topic: str, value: str) -> None:
    change = ConfigResource(
        ResourceType.TOPIC,
        topic,
        incremental_configs=[
            ConfigEntry("min.insync.replicas", value, incremental_operation=AlterConfigOpType.SET)
        ],
    )
    admin.incremental_alter_configs([change])[change].result(30)


def test_unsatisfied_min_insync_replicas_waits_says_why_and_resumes_once(
    stack: Stack, kafka_pair: tuple[Kafka, Kafka], tmp_path: Path
) -> None:
    """The follower of a change topic with min.insync.replicas=2 stops: every write there
    is refused (NOT_ENOUGH_REPLICAS, which librdkafka retries without a word). The bridge
    says why in one line naming the partition and the fix, exports the wait, confirms to
    PostgreSQL no transaction Kafka does not hold, and when the follower is back
    publishes everything exactly once (broker-log audit)."""
    first, second = kafka_pair
    workload = CounterWorkload(stack.primary_dsn, "insync")
    pipe = Pipeline(stack, workload.create(), tmp_path, broker=first)
    (port,) = free_ports(1)
    pipe.extra["SLOTBRIDGE_HTTP_PORT"] = str(port)
    admin = AdminClient({"bootstrap.servers": first.bootstrap})
    topic = pipe.topic("insync.counters")
    try:
        workload.start_under(pipe)
        # Every topic created while both brokers are up (a topic of 2 replicas cannot be
        # created on one).
        wanted = {topic, pipe.topic("insync.log")}
        wait_for(lambda: wanted <= set(admin.list_topics(timeout=10).topics), 60, "the topics")
        _set_min_insync(admin, topic, "2")
        second.stop()  # a clean shutdown: the leader drops it from the ISR at once
        # The first line may not know why yet (the admin requests of a broker that just
        # lost one of its peers can time out while its metadata still names it): then the
        # bridge asks again until it can say, without waiting the minute between lines.
        why = f"{topic}-0 has 1 in-sync replicas, min.insync.replicas=2"
        pipe.wait_for_log(why, 120)
        line = next(ln for ln in pipe.output().splitlines() if why in ln)
        assert "Kafka does not acknowledge" in line, line
        assert "lower the topic's min.insync.replicas" in line, line
        assert kafka_write_wait(port) >= 5
        # Nothing confirmed to PostgreSQL that Kafka does not hold, while it waits: no
        # transaction of the tables commits between Kafka's progress record and the slot's
        # confirmed position (which may lie past the record: see unpublished_commits).
        # Held means committed, markers or not: the follower left in the middle of a
        # commit can keep a partition's marker out for as long as it is away.
        confirmed = pipe._confirmed()
        published = pipe.committed_end_lsn()
        assert not unpublished_commits(stack.primary_dsn, pipe.name, pipe.tables or [], published)
        wait_for(lambda: kafka_write_wait(port) >= 10, 60, "a longer wait")
        assert pipe._confirmed() == confirmed
        second.start()
        second.wait_ready()
        workload.finish()
        pipe.wait_caught_up()
        assert pipe._confirmed() > confirmed
        assert kafka_write_wait(port) == 0
        assert pipe.stop() == 0
        checked = workload.verify(pipe)
        report = pipe.audit()
    finally:
        workload.stop_flag.set()  # a failed wait must not leave it writing for the session
        pipe.cleanup()
    print(
        f"{workload.committed} source transactions, {checked} records verified; while "
        f"waiting the slot was confirmed {confirmed - published} bytes past the progress "
        f"record; {report}"
    )
