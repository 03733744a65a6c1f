"""Fresh topics under load with random kills: where KAFKA-15591 hid.

The bridge writes through the fault proxy, which fails the first produce request to
every partition it has not seen (the broker-side race, made certain) and cuts all
connections now and then. Meanwhile tables are created and added to the publication (so
their topics are created mid-stream and first written right away, by a snapshot and by the
stream), change topics have three partitions, and the bridge is SIGKILLed at random. The
verdict comes from the records (every counter 0, 1, 2 ...; every row once) and from the
broker's log segments (sequences, markers, END counts).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from slotbridge_dev.stack.kafka_proxy import KafkaFaultProxy
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import CounterWorkload, Pipeline

SCHEMA = "chaos"
ROUNDS = 10


@pytest.fixture
def proxy(stack: Stack) -> Iterator[KafkaFaultProxy]:
    faulty = KafkaFaultProxy(stack.kafka_bootstrap, fail_first_produce=True, hold_s=0.3)
    yield faulty.start()
    faulty.stop()


def test_fresh_topics_under_load_with_kills_and_cuts(
    stack: Stack, proxy: KafkaFaultProxy, tmp_path: Path
) -> None:
    workload = CounterWorkload(stack.primary_dsn, SCHEMA, seed=3)
    pipe = Pipeline(
        stack,
        workload.create(),
        tmp_path,
        extra={"SLOTBRIDGE_KAFKA_BOOTSTRAP": proxy.bootstrap, "SLOTBRIDGE_TOPIC_PARTITIONS": "3"},
    )
    rng = random.Random(5)
    kills = cuts = 0
    try:
        pipe.start()
        pipe.wait_caught_up(60)
        workload.seed_counters()
        workload.start()
        for round_ in range(ROUNDS):
            if pipe.proc is None or pipe.proc.poll() is not None:
                pipe.start()
            if round_ % 2 == 0:
                workload.add_fresh_table(f"fresh{round_}", 200, pipe.name)
            time.sleep(rng.uniform(1.5, 3.5))
            if round_ % 4 == 3:
                proxy.cut()
                cuts += 1
                time.sleep(rng.uniform(0.5, 1.5))
            assert pipe.proc is not None and pipe.proc.poll() is None, pipe.output()[-3000:]
            pipe.kill()
            kills += 1
        workload.finish()
        pipe.start()
        pipe.wait_caught_up(180)
        assert pipe.stop() == 0
        checked = workload.verify(pipe)
        report = pipe.audit()
        print(
            f"\nCHAOS kills={kills} cuts={cuts} fresh_tables={len(workload.fresh)} "
            f"source_txns={workload.committed} records_checked={checked} "
            f"first_requests_failed={len(proxy.stats.sabotaged)}"
        )
        assert workload.committed > 200
        # Every fresh table's topic: three change partitions, each one's first request failed.
        fresh_partitions = {(t, p) for t, p in proxy.stats.sabotaged if ".fresh" in t}
        assert len(fresh_partitions) == 3 * len(workload.fresh), proxy.stats.sabotaged
        assert report.snapshot_records >= 200 * len(workload.fresh)
    finally:
        workload.stop_flag.set()
        pipe.cleanup()
