"""Exactly once across SIGKILLs in every window of publish -> commit -> advance -> confirm.

The workload makes the check exact: every transaction bumps a per-key counter by one and
logs a unique row, so a read_committed consumer must see each counter's values as
0, 1, 2, ... with no gap (loss), no repeat (duplicate) and no inversion (order), and each
log id exactly once.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from services.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, sql

SCHEMA = "crash"
KEYS = 8
FAILPOINTS = ["after_produce", "before_kafka_commit", "after_kafka_commit",
              "after_origin_advance", "after_slot_confirm"]


class Workload(threading.Thread):
    """Small transactions against the primary until stopped; counts what committed."""

    def __init__(self, dsn: str, schema: str = SCHEMA) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.schema = schema
        self.stop_flag = threading.Event()
        self.committed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        rng = random.Random(7)
        try:
            with psycopg.connect(self.dsn) as conn:
                while not self.stop_flag.is_set():
                    for _ in range(rng.randint(1, 3)):
                        k = rng.randrange(KEYS)
                        conn.execute(f"UPDATE {self.schema}.counters SET v = v + 1 "
                                     "WHERE k = %s", (k,))
                        conn.execute(f"INSERT INTO {self.schema}.log (k) VALUES (%s)", (k,))
                    conn.commit()
                    self.committed += 1
                    time.sleep(0.005)
        except BaseException as exc:  # reported by the test thread's owner
            self.error = exc

    def finish(self) -> None:
        self.stop_flag.set()
        self.join(30)
        assert self.error is None, self.error


def start_pipeline(stack: Stack, workdir: Path, schema: str = SCHEMA,
                   kafka_bootstrap: str = "") -> Pipeline:
    """The workload's tables, created fresh, and a running bridge that publishes them."""
    sql(stack.primary_dsn, f"""
        DROP SCHEMA IF EXISTS {schema} CASCADE; CREATE SCHEMA {schema};
        CREATE TABLE {schema}.counters (k int PRIMARY KEY, v int NOT NULL);
        CREATE TABLE {schema}.log (id bigserial PRIMARY KEY, k int NOT NULL);""")
    pipeline = Pipeline(stack, [f"{schema}.counters", f"{schema}.log"], workdir,
                        kafka_bootstrap=kafka_bootstrap)
    pipeline.start()
    pipeline.wait_caught_up(60)
    sql(stack.primary_dsn,
        f"INSERT INTO {schema}.counters SELECT g, 0 FROM generate_series(0, {KEYS - 1}) g")
    return pipeline


@pytest.fixture
def pipe(stack: Stack, tmp_path: Path) -> Iterator[Pipeline]:
    pipeline = start_pipeline(stack, tmp_path)
    try:
        yield pipeline
    finally:
        pipeline.cleanup()


def verify_exactly_once(pipe: Pipeline, schema: str = SCHEMA) -> tuple[int, int]:
    """Assert exactly-once and per-key order; returns (counter records, log records)."""
    dsn = pipe.stack.primary_dsn
    final = dict(sql(dsn, f"SELECT k, v FROM {schema}.counters"))
    source_ids = [r[0] for r in sql(dsn, f"SELECT id FROM {schema}.log ORDER BY id")]
    seen: dict[int, list[int]] = defaultdict(list)
    counters = pipe.changes(f"{schema}.counters")
    for r in counters:
        seen[r.value["after"]["k"]].append(r.value["after"]["v"])
    for k, v in final.items():
        assert seen[k] == list(range(v + 1)), f"key {k}: {seen[k][:20]}... (source v={v})"
    log_ids = [r.value["after"]["id"] for r in pipe.changes(f"{schema}.log")]
    assert len(log_ids) == len(set(log_ids)), "duplicate log rows in Kafka"
    assert sorted(log_ids) == source_ids, "log rows missing from Kafka"
    return len(counters), len(log_ids)


def test_exactly_once_across_twenty_kills(pipe: Pipeline) -> None:
    workload = Workload(pipe.stack.primary_dsn)
    workload.start()
    pipe.stop()
    kills = {"failpoint": 0, "random": 0}
    rng = random.Random(11)
    plan = [("failpoint", fp) for fp in FAILPOINTS for _ in range(2)]
    plan += [("random", "")] * 10
    rng.shuffle(plan)
    for kind, point in plan:
        if kind == "failpoint":
            code, output = pipe.run_to_exit(
                90, SLOTBRIDGE_FAILPOINTS=f"{point}={rng.randint(1, 3)}*kill")
            assert code == -9, f"failpoint {point} did not fire (exit {code}):\n{output[-2000:]}"
        else:
            proc = pipe.start()
            time.sleep(rng.uniform(1.0, 4.0))
            assert proc.poll() is None, f"bridge died by itself:\n{pipe.output()[-2000:]}"
            pipe.kill()
        kills[kind] += 1
    workload.finish()
    pipe.start()
    pipe.wait_caught_up(180)
    assert pipe.stop() == 0
    counted = verify_exactly_once(pipe)
    print(f"kills {kills}, source transactions {workload.committed}, "
          f"records verified {counted}")
    assert kills["failpoint"] + kills["random"] >= 20
    assert workload.committed > 100


def test_exactly_once_across_kafka_restart(pipe: Pipeline) -> None:
    workload = Workload(pipe.stack.primary_dsn)
    workload.start()
    time.sleep(3)
    pipe.stack.kafka.stop()
    time.sleep(5)
    pipe.stack.kafka.start()
    time.sleep(3)
    workload.finish()
    pipe.wait_caught_up(300)
    assert pipe.proc is not None and pipe.proc.poll() is None, "bridge gave up"
    assert pipe.stop() == 0
    verify_exactly_once(pipe)
