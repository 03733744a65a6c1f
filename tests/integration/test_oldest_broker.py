"""Exactly once on the oldest Kafka broker we claim to support (bootstrap.KAFKA_OLDEST_VERSION).

The stack's PostgreSQL with a dedicated broker of that version: a few hundred small
transactions into two tables, a SIGKILL of the bridge half-way and a restart, then every
source row must be in Kafka exactly once and in order (the crash tests' workload and check).
"""

from __future__ import annotations

from pathlib import Path

from services.stack import bootstrap
from services.stack.kafka import Kafka
from services.stack.stack import Stack
from tests.integration.bridge_harness import wait_for
from tests.integration.test_bridge_crash import Workload, start_pipeline, verify_exactly_once

SCHEMA = "oldest_broker"
TRANSACTIONS = 300


def test_exactly_once_across_a_kill(stack: Stack, oldest_kafka: Kafka, tmp_path: Path) -> None:
    pipe = start_pipeline(stack, tmp_path, SCHEMA, oldest_kafka.bootstrap)
    workload = Workload(stack.primary_dsn, SCHEMA)
    try:
        workload.start()
        wait_for(lambda: workload.committed >= TRANSACTIONS // 2, 30, "half the workload")
        pipe.kill()
        pipe.start()
        wait_for(lambda: workload.committed >= TRANSACTIONS, 30, "the rest of the workload")
        workload.finish()
        pipe.wait_caught_up(60)
        assert pipe.stop() == 0
        counters, log_rows = verify_exactly_once(pipe, SCHEMA)
    finally:
        workload.stop_flag.set()  # a failed wait must not leave it writing for the session
        pipe.cleanup()
    print(f"Kafka {bootstrap.KAFKA_OLDEST_VERSION}: {workload.committed} source transactions, "
          f"{counters} counter and {log_rows} log records verified")
