"""Exactly once on the oldest Kafka broker we claim to support (bootstrap.KAFKA_OLDEST_VERSION).

The stack's PostgreSQL with a dedicated broker of that version: a few hundred small
transactions into two tables, a SIGKILL of the bridge half-way and a restart, then every
source row must be in Kafka exactly once and in order, and the broker's log must pass the
audit (the crash tests' workload and checks).
"""

from __future__ import annotations

from pathlib import Path

from slotbridge_dev import bootstrap
from slotbridge_dev.stack.kafka import Kafka
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import CounterWorkload, Pipeline, wait_for

TRANSACTIONS = 300


def test_exactly_once_across_a_kill(stack: Stack, oldest_kafka: Kafka, tmp_path: Path) -> None:
    workload = CounterWorkload(stack.primary_dsn, "oldest_broker")
    pipe = Pipeline(stack, workload.create(), tmp_path, broker=oldest_kafka)
    try:
        pipe.start()
        pipe.wait_caught_up(60)
        workload.seed_counters()
        workload.start()
        wait_for(lambda: workload.committed >= TRANSACTIONS // 2, 30, "half the workload")
        pipe.kill()
        pipe.start()
        wait_for(lambda: workload.committed >= TRANSACTIONS, 30, "the rest of the workload")
        workload.finish()
        pipe.wait_caught_up(60)
        assert pipe.stop() == 0
        checked = workload.verify(pipe)
        pipe.audit()
    finally:
        workload.stop_flag.set()  # a failed wait must not leave it writing for the session
        pipe.cleanup()
    print(
        f"Kafka {bootstrap.KAFKA_OLDEST_VERSION}: {workload.committed} source transactions, "
        f"{checked} records verified"
    )
