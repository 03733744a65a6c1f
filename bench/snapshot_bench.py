"""Initial-snapshot throughput of the bridge next to the bare read rate, on the local stack.

    python bench/snapshot_bench.py [--rows 1000000] [--repeat 1] [--stack-dir .stack/bench]
                                   [--keep-stack]

For each repeat, on a fresh table of ``--rows`` rows (bigint key, int, text, numeric,
timestamptz; the load time is printed, never part of a rate):

1. ceiling: one REPEATABLE READ transaction reads the table through a server-side cursor
   with the columns as raw output text, exactly the query and loaders the snapshot uses,
   and does nothing with the rows: the most a snapshot reader could do here;
2. bridge: ``slotbridge run`` with ``snapshot_mode: initial_only`` (own slot, publication,
   topic prefix) creates its slot, publishes the table as ``op: "r"`` records in chunks
   (each its own Kafka transaction with progress) and exits. Printed: the rate inside the
   snapshot (the daemon's own "snapshot of table published" log line: read, watermark,
   build, produce, commit), the rate over the whole process (spawn to exit: imports,
   connections, Kafka init included), and the peak RSS.
   The change topic is then read back with read_committed and must hold exactly
   ``--rows`` records.
3. CPU budget: CPU seconds per row over the bridge's run (spawn to exit) of the bridge, of
   PostgreSQL (the postmaster and every backend that ended meanwhile: the chunk readers,
   the walsender) and of the broker; the rate at which the three fill every core of this
   machine, and the cores PostgreSQL and the broker alone would take at half the read
   ceiling (the goal of issue #13).

Figures, not assertions: the machine is shared, so run it a few times and take medians.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
from confluent_kafka import Consumer, KafkaError, TopicPartition
from psycopg.types.string import TextLoader

from bench.bridge_bench import (
    add_stack_arguments,
    bench_stack,
    broker_pid,
    cpu_seconds,
    delete_topics,
)
from slotbridge_dev.stack.stack import Stack

ROOT = Path(__file__).resolve().parents[1]


def _say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def load(dsn: str, table: str, rows: int) -> float:
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} (id bigint PRIMARY KEY, a int, b text, "
            "c numeric(14,2), d timestamptz)"
        )
        conn.execute(
            f"INSERT INTO {table} SELECT g, (g % 100000)::int, "
            "'customer ' || g || ' note', (g * 1.25)::numeric(14,2), "
            "timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second' "
            f"FROM generate_series(1, {rows}) g"
        )
        conn.execute(f"VACUUM ANALYZE {table}")
    return time.monotonic() - started


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of ``pid`` and of its children that ended and were waited for."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    # utime, stime, cutime, cstime: fields 14-17 of proc(5), the 12th-15th after the name.
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class OtherCpu:
    """CPU seconds PostgreSQL (``postmaster``) and the broker spend over a span."""

    def __init__(self, postmaster: int, broker: int | None) -> None:
        self.postmaster, self.broker = postmaster, broker
        self._start = self._now()

    def _now(self) -> tuple[float, float]:
        broker = cpu_seconds(self.broker) if self.broker is not None else 0.0
        return tree_cpu_seconds(self.postmaster), broker

    def spent(self) -> tuple[float, float]:
        # The backends' exit is reaped by the postmaster shortly after they close.
        time.sleep(0.5)
        end = self._now()
        return end[0] - self._start[0], end[1] - self._start[1]


def ceiling(dsn: str, table: str) -> float:
    """Rows per second of the snapshot's own read, rows discarded."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        for oid in (20, 23, 25, 1700, 1184):
            conn.adapters.register_loader(oid, TextLoader)
        started = time.monotonic()
        count = 0
        with conn.cursor(name="ceiling") as cur:
            cur.itersize = 5_000
            cur.execute(f"SELECT id, a, b, c, d FROM {table}")
            for _row in cur:
                count += 1
        return count / (time.monotonic() - started)


def bridge(
    dsn: str,
    bootstrap: str,
    table: str,
    tag: str,
    work: Path,
    profile: Path | None,
    settings: list[str],
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTBRIDGE_")}
    env.update(
        {
            "SLOTBRIDGE_SOURCE_DSN": dsn,
            "SLOTBRIDGE_KAFKA_BOOTSTRAP": bootstrap,
            "SLOTBRIDGE_SLOT_NAME": f"snap_{tag}",
            "SLOTBRIDGE_PUBLICATION_NAME": f"snap_{tag}",
            "SLOTBRIDGE_TOPIC_PREFIX": f"snapbench{tag}",
            "SLOTBRIDGE_PROGRESS_TOPIC": f"snapbench{tag}.progress",
            "SLOTBRIDGE_TABLES": json.dumps([f"public.{table}"]),
            "SLOTBRIDGE_SNAPSHOT_MODE": "initial_only",
            "SLOTBRIDGE_HTTP_PORT": "0",
            "SLOTBRIDGE_LOG_FORMAT": "text",
            "SLOTBRIDGE_SPOOL_DIR": str(work / "spool"),
        }
    )
    for setting in settings:
        name, _, value = setting.partition("=")
        env[f"SLOTBRIDGE_{name.upper()}"] = value
    log_path = work / f"snapshot-{tag}.log"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    with open(log_path, "wb") as log:
        command = [sys.executable, "-m", "services.cli", "run"]
        if profile is not None:  # sampled, every thread, in the collapsed-stack format
            command = [
                str(Path(sys.executable).with_name("py-spy")),
                "record",
                "--threads",
                "--format",
                "raw",
                "--rate",
                "200",
                "--idle",
                "-o",
                str(profile),
                "--",
                *command,
            ]
        code = subprocess.call(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    output = log_path.read_text(errors="replace")
    if code != 0:
        raise SystemExit(f"bridge exited with {code}; see {log_path}")
    found = re.search(
        r"snapshot of table published .*rows=(\d+) chunks=\d+ seconds=[\d.]+ "
        r"rows_per_s=(\d+)",
        output,
    )
    if found is None:
        raise SystemExit(f"no 'snapshot of table published' line in {log_path}")
    rows, rate = int(found.group(1)), int(found.group(2))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP PUBLICATION snap_{tag}")
        conn.execute("SELECT pg_replication_origin_drop(%s)", (f"slotbridge_snap_{tag}",))
    return {
        "rows": rows,
        "snapshot_rows_per_s": rate,
        "wall_s": wall,
        "cpu_s": cpu,
        "topic": f"snapbench{tag}.public.{table}",
        # Children waited for so far: this run's daemon is the largest of them.
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }


def count_committed(bootstrap: str, topic: str) -> int:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        count = 0
        while True:
            batch = consumer.consume(10_000, timeout=10)
            if not batch:
                raise SystemExit(f"timed out reading {topic} after {count} records")
            for msg in batch:
                error = msg.error()
                if error is None:
                    count += msg.value() is not None
                elif error.code() == KafkaError._PARTITION_EOF:
                    return count
                else:
                    raise SystemExit(f"reading {topic}: {error}")
    finally:
        consumer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=1)
    add_stack_arguments(parser)
    parser.add_argument(
        "--py-spy",
        type=Path,
        metavar="FILE",
        help="record the bridge with py-spy (pip install py-spy) into FILE",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a bridge setting for the run, e.g. snapshot_workers=4",
    )
    args = parser.parse_args()
    with bench_stack(args) as stack:
        _measure(args, stack)


def _measure(args: argparse.Namespace, stack: Stack) -> None:
    """The snapshot of --rows rows, --repeat times, each against its read ceiling."""
    work = args.stack_dir / "snapshot-bench"
    work.mkdir(parents=True, exist_ok=True)
    postmaster = int((stack.node("primary").data_dir / "postmaster.pid").read_text().split()[0])
    broker = broker_pid(args.stack_dir)
    results = []
    for _ in range(args.repeat):
        tag = uuid.uuid4().hex[:8]
        table = f"snapbench_{tag}"
        _say(f"loading {args.rows:,} rows into {table}")
        load_s = load(stack.primary_dsn, table, args.rows)
        _say(f"loaded in {load_s:.1f}s; reading the ceiling")
        ceiling_rate = ceiling(stack.primary_dsn, table)
        _say("running the bridge (snapshot_mode initial_only)")
        others = OtherCpu(postmaster, broker)
        run = bridge(
            stack.primary_dsn, stack.kafka_bootstrap, table, tag, work, args.py_spy, args.set
        )
        postgres_cpu, broker_cpu = others.spent()
        published = count_committed(stack.kafka_bootstrap, run["topic"])
        if published != args.rows or run["rows"] != args.rows:
            raise SystemExit(
                f"expected {args.rows} records, the snapshot logged {run['rows']}"
                f" and the topic holds {published}"
            )
        with psycopg.connect(stack.primary_dsn, autocommit=True) as conn:
            conn.execute(f"DROP TABLE {table}")
        delete_topics(stack.kafka_bootstrap, f"snapbench{tag}")
        results.append(
            {
                "ceiling": ceiling_rate,
                "snapshot": run["snapshot_rows_per_s"],
                "process": args.rows / run["wall_s"],
                "rss": run["peak_rss_mb"],
                "cpu": run["cpu_s"] / run["wall_s"],
                "load_s": load_s,
                "bridge_us": run["cpu_s"] / args.rows * 1e6,
                "postgres_us": postgres_cpu / args.rows * 1e6,
                "broker_us": broker_cpu / args.rows * 1e6,
            }
        )
        r = results[-1]
        print(
            f"rows {args.rows:,}: read ceiling {r['ceiling']:,.0f} rows/s | snapshot "
            f"{r['snapshot']:,.0f} rows/s (ratio {r['snapshot'] / r['ceiling']:.2f}) | "
            f"whole process {r['process']:,.0f} rows/s, {r['cpu']:.0%} of a core | "
            f"peak RSS {r['rss']:.0f} MB | "
            f"verified {published:,} records",
            flush=True,
        )
        cores = os.cpu_count() or 1
        per_row = r["bridge_us"] + r["postgres_us"] + r["broker_us"]
        goal = 0.5 * r["ceiling"]
        print(
            f"  CPU per row: bridge {r['bridge_us']:.2f} us, postgres {r['postgres_us']:.2f} us, "
            f"broker {r['broker_us']:.2f} us: all {cores} cores at {cores / per_row * 1e6:,.0f} "
            f"rows/s | at half the ceiling ({goal:,.0f} rows/s) postgres and the broker take "
            f"{goal * (r['postgres_us'] + r['broker_us']) / 1e6:.2f} cores",
            flush=True,
        )
    if args.repeat > 1:
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        print(
            f"median of {args.repeat}: ceiling {med['ceiling']:,.0f} rows/s, snapshot "
            f"{med['snapshot']:,.0f} rows/s (ratio {med['snapshot'] / med['ceiling']:.2f}), "
            f"process {med['process']:,.0f} rows/s, peak RSS {med['rss']:.0f} MB"
        )


if __name__ == "__main__":
    main()
