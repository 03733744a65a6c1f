"""Kafka refusing writes because its disk is full (issue #32 item 5).

The broker's log dir is a 64 MiB filesystem of its own (``small_disk_kafka``). A broker
whose only log dir fails (a write refused with ENOSPC) stops itself, so the bridge meets a
broker that no longer answers: it waits, says so once a minute, confirms nothing to
PostgreSQL meanwhile, and once the space is freed and the broker restarted publishes every
change exactly once.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from slotbridge_dev.stack.cluster import free_ports
from slotbridge_dev.stack.kafka import Kafka
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import (
    CounterWorkload,
    Pipeline,
    kafka_write_wait,
    wait_for,
)

# What the ballast leaves the broker: a few seconds of the workload's records.
LEFT_BYTES = 2 << 20


def test_a_full_broker_disk_waits_says_why_and_resumes_once(
    stack: Stack, small_disk_kafka: Kafka, tmp_path: Path
) -> None:
    kafka = small_disk_kafka
    workload = CounterWorkload(stack.primary_dsn, "diskfull")
    pipe = Pipeline(stack, workload.create(), tmp_path, broker=kafka)
    (port,) = free_ports(1)
    pipe.extra["SLOTBRIDGE_HTTP_PORT"] = str(port)
    ballast = kafka.data_dir / "ballast"
    try:
        workload.start_under(pipe)
        free = shutil.disk_usage(kafka.data_dir).free
        with ballast.open("wb") as out:  # tmpfs takes the space as it is written
            for _ in range((free - LEFT_BYTES) >> 20):
                out.write(bytes(1 << 20))
        # The ground truth: the broker's own log says why it stopped.
        wait_for(lambda: not kafka.is_running(), 300, "the broker to stop on a full disk")
        assert "No space left on device" in kafka.log_path.read_text(errors="replace")
        confirmed = pipe._confirmed()
        line = "Kafka does not acknowledge this transaction"
        pipe.wait_for_log(line, 120)
        said = next(ln for ln in pipe.output().splitlines() if line in ln)
        assert "the brokers do not answer either" in said and "full disk" in said, said
        assert kafka_write_wait(port) >= 5
        # Nothing confirmed to PostgreSQL while Kafka holds nothing more.
        assert pipe._confirmed() == confirmed
        assert pipe.proc is not None and pipe.proc.poll() is None, pipe.output()[-3000:]

        ballast.unlink()
        kafka.start()
        kafka.wait_ready()
        committed = workload.committed
        wait_for(lambda: workload.committed >= committed + 100, 120, "100 more transactions")
        wait_for(lambda: pipe._confirmed() > confirmed, 300, "a confirmation after the restart")
        checked, report = workload.settle(pipe)
    finally:
        workload.stop_flag.set()  # a failed wait must not leave it writing for the session
        pipe.cleanup()
    print(f"{workload.committed} source transactions, {checked} records verified; {report}")
