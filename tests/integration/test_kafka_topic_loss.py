"""Kafka losing a topic under the bridge (issue #32 item 5): a change topic deleted while
the bridge streams is known by its topic id, never written on silently.

The stack's broker auto-creates topics (Kafka's default), but the bridge's clients never
ask it to: the test creates the deleted topic again itself, empty, under another id, as
another client of the broker could.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from confluent_kafka import TopicCollection

# Their public home, confluent_kafka.admin (its stubs do not declare the re-export).
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    NewTopic,
)

from services.bridge.progress.kafka_reader import read_kafka_progress, read_topic
from slotbridge_dev.stack.kafka_audit import audit
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import (
    CounterWorkload,
    Pipeline,
    one_line_error,
    read_topics,
    run_cli,
    sql,
    wait_for,
)


def _bridge_error(output: str) -> str:
    """The bridge's one error line. librdkafka's own lines about the failed transaction
    (ADDPARTS, TXNERR: a partition of the deleted topic could not join it) may precede it."""
    return one_line_error(
        "\n".join(line for line in output.splitlines() if "[rdkafka#producer" not in line)
    )


def _topic_id(admin: AdminClient, topic: str) -> str:
    return str(admin.describe_topics(TopicCollection([topic]))[topic].result(30).topic_id)


def test_change_topic_deleted_under_a_streaming_bridge_stops_it_in_one_line(
    stack: Stack, tmp_path: Path
) -> None:
    """Deleted with writes running: the bridge stops with one line naming the topic and its
    old and new ids; nothing it confirmed to PostgreSQL is beyond the progress Kafka holds,
    no transaction that wrote into the new topic is committed, and a restart refuses too."""
    workload = CounterWorkload(stack.primary_dsn, "topicloss")
    pipe = Pipeline(stack, workload.create(), tmp_path)
    admin = AdminClient({"bootstrap.servers": pipe.kafka.bootstrap})
    log_topic = pipe.topic("topicloss.log")
    try:
        # Counters seeded after the snapshot: a key the workload changes while its chunk is
        # read reaches Kafka only through the stream, so v=0 would be missing (it failed
        # that way once under load).
        workload.start_under(pipe, 300)
        old = _topic_id(admin, log_topic)
        admin.delete_topics([log_topic])[log_topic].result(30)
        deleted = time.monotonic()
        assert pipe.proc is not None
        code = pipe.proc.wait(60)
        print(f"\nstopped {time.monotonic() - deleted:.1f}s after the topic was deleted")
        workload.finish()
        line = _bridge_error(pipe.output())
        assert code == 1 and log_topic in line and f"topic id {old}" in line, line
        # Gone: the bridge's producer did not have the broker create it again.
        assert "topic id now" not in line, line
        admin.create_topics([NewTopic(log_topic, 1)])[log_topic].result(30)
        new = _topic_id(admin, log_topic)
        assert new != old and "slotbridge resync" in line, line

        progress = read_kafka_progress(
            {"bootstrap.servers": pipe.kafka.bootstrap}, pipe.progress_topic, pipe.name
        )
        assert progress is not None and progress.topic_ids[log_topic] == old
        assert pipe._origin() <= progress.end_lsn
        assert read_topics(pipe.kafka, [log_topic]) == []  # read_committed: nothing
        # Every published transaction is in the counters topic once, in order, and lost
        # only its rows in the deleted topic.
        published: dict[int, int] = {}
        for r in pipe.changes("topicloss.counters"):
            k, v = r.value["after"]["k"], r.value["after"]["v"]
            assert v == published.get(k, -1) + 1, (k, v, published.get(k))
            published[k] = v
        # The broker-log audit: what is missing is the deleted topic's records (its
        # transactions' END counts more events than the log holds; the producer's next
        # sequences there went into the new topic, in a transaction never committed).
        report = audit(pipe.kafka, pipe.prefix, [pipe.progress_topic])
        deleted_records = [
            p
            for p in report.problems
            if "END counts" in p or (p.startswith(f"{log_topic}-0: ") and "never stored" in p)
        ]
        assert deleted_records == report.problems and report.source_transactions > 0
        assert sum("END counts" in p for p in report.problems) <= report.source_transactions
        # Nothing confirmed to PostgreSQL that Kafka does not hold: every workload
        # transaction, and the one that seeded the counters, is published or still in the
        # slot.
        ((in_slot,),) = sql(
            stack.primary_dsn,
            "SELECT count(DISTINCT xid::text) FROM pg_logical_slot_peek_binary_changes("
            "%s, NULL, NULL, 'proto_version', '1', 'publication_names', %s)",
            (pipe.name, pipe.name),
        )
        assert report.source_transactions + in_slot == workload.committed + 1

        code, output = pipe.run_to_exit(60)
        assert code == 1 and f"topic id now {new}" in _bridge_error(output), output[-2000:]

        # Resync: the slot is kept, every table published again, the new topic accepted.
        code, out = run_cli("resync", env=pipe.env())
        assert code == 0 and "start the bridge" in out, out
        restarted = CounterWorkload(stack.primary_dsn, "topicloss", seed=8)
        pipe.start()
        restarted.start()
        wait_for(lambda: restarted.committed >= 100, 60, "100 more source transactions")
        restarted.finish()
        pipe.wait_caught_up()
        assert pipe.stop() == 0
        ids = [r.key["id"] for r in pipe.changes("topicloss.log")]
        assert sorted(set(ids)) == [
            i for (i,) in sql(stack.primary_dsn, "SELECT id FROM topicloss.log ORDER BY id")
        ]
        gaps = [
            json.loads(value)
            for key, value in read_topic(
                {"bootstrap.servers": pipe.kafka.bootstrap}, pipe.progress_topic
            )
            if key is not None and b"gap_after_lsn" in key and value is not None
        ]
        assert [(g["kind"], g["after_lsn"]) for g in gaps] == [("topic", progress.end_lsn)], gaps
        assert log_topic in gaps[0]["reason"] and old in gaps[0]["reason"], gaps
    finally:
        workload.stop_flag.set()
        pipe.cleanup()
