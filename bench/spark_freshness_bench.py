"""Freshness of the Spark consumer: a change's source commit to its row being readable in
the current-state Delta table, at a steady OLTP write rate, on the local stack.

    .venv/bin/python bench/spark_freshness_bench.py [--rate 2000] [--seconds 120]
        [--warm-up 30] [--max-warm-up 900] [--stack-dir .stack/bench] [--keep-stack]
        [--trigger-interval-s DEFAULT] [--conf KEY=VALUE ...]

The real pipeline, each part as its own process: pgbench's TPC-B-like script (three
UPDATEs and one INSERT into ``pgbench_history`` per transaction) rate-limited to
``--rate`` changes/s, the bridge daemon of this checkout streaming the four tables, and
``slotbridge consume`` with its default settings (trigger interval, local master) building
the Delta tables.

Method: every change of ``pgbench_history`` inserts a new key (``hid``), so each of them
becomes exactly one new row of ``current/<schema>.pgbench_history``. A reader outside
Spark (delta-rs) polls that table's log every 0.1 s; when a new version is there it reads
the Parquet files it added and notes, for every key not seen before, the poll's clock
time. At the end each key's source commit time is read from the history table's
``_cdc_commit_ts`` (the commit timestamp PostgreSQL sent, in milliseconds; server and bench
share the machine's clock). So a delay is commit -> a reader sees the row, including the
bridge, Kafka, the trigger wait, the batch's work on the other tables before this one, and
up to one poll interval. The warm-up write (the JVM's
first batches) is not counted; every measured row must be seen.

Warm-up: a new JVM's first batches take tens of seconds whatever their size (class
loading, Spark's code generation, the JIT), and the backlog they leave takes minutes to
drain on a small machine; measured during that, the figures are a restart's. So the
warm-up write goes on past ``--warm-up`` seconds, 30 s at a time, until the consumer has
caught up (its last batch took at most two trigger intervals and held at most two
intervals' worth of changes) or ``--max-warm-up`` seconds have passed. The summary says
how long it took and whether the measured window was steady (every batch that started in
it took at most two trigger intervals).

Printed, not asserted: p50/p90/p99/max, the rows, the Delta versions (batches) seen, the
write rate reached and the load average; then every micro-batch of the consumer: when it
started (the checkpoint's offsets file, seconds from the start of the measured write), its
seconds from that file to its commit file (Spark's whole batch), the consumer's own
seconds and changes (its "batch applied" log line) with the classes its driver JVM
loaded and its JIT compilation and GC milliseconds (a warm JVM loads few), and per table
and phase the wall seconds and Spark jobs (``spark_consumers.timings``; tables run side by
side, so a phase's jobs include the other table's of that time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from bench.bridge_bench import (
    add_stack_arguments,
    bench_stack,
    daemon_env,
    drop_pipeline,
    say,
    stop_process,
)
from bench.latency_bench import start_daemon, wait_streaming
from bench.spark_merge_bench import jvm_cpu_s
from bench.workloads import OLTP_CHANGES_PER_TXN, Oltp
from slotbridge_dev.bootstrap import SPARK_SET, cache_dir, jars_dir
from slotbridge_dev.stack.stack import Stack
from spark_consumers import schema as s
from spark_consumers.settings import ConsumerSettings
from spark_consumers.tables import table_paths

ROOT = Path(__file__).resolve().parents[1]
OLTP = Oltp()
KEY = "hid"


class Reader(threading.Thread):
    """Polls a current-state table with delta-rs; ``seen`` maps each key to the clock time
    of the poll that first found it."""

    def __init__(self, path: str, poll_s: float) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.poll_s = poll_s
        self.seen: dict[int, float] = {}
        self.versions = 0
        self.last_progress = time.monotonic()
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not DeltaTable.is_deltatable(self.path):
                if self.stop_flag.wait(self.poll_s):
                    return
            table = DeltaTable(self.path)
            files: set[str] = set()
            version = -1
            while not self.stop_flag.is_set():
                table.update_incremental()
                if table.version() != version:
                    found = time.time()
                    version = table.version()
                    self.versions += 1
                    self.last_progress = time.monotonic()
                    current = set(table.file_uris())
                    for uri in sorted(current - files):
                        self._take(uri.removeprefix("file://"), found)
                    files = current
                self.stop_flag.wait(self.poll_s)
        except BaseException as exc:  # reported by the main thread
            self.error = exc

    def _take(self, file: str, found: float) -> None:
        for key in pq.read_table(file, columns=[KEY])[KEY].to_pylist():
            self.seen.setdefault(key, found)


def commit_times(history: str) -> dict[int, float]:
    """Each key's commit time (epoch seconds) from the history table: one version per key,
    as pgbench only inserts history rows."""
    rows = DeltaTable(history).to_pyarrow_table(columns=[KEY, s.COMMIT_TS])
    micros = pc.cast(rows[s.COMMIT_TS], "int64").to_pylist()
    return {k: m / 1e6 for k, m in zip(rows[KEY].to_pylist(), micros, strict=True)}


def max_hid(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT coalesce(max(hid), 0) FROM {schema}.pgbench_history").fetchone()
        assert row is not None
        return int(row[0])


def consumer_env(settings: ConsumerSettings, work: Path) -> dict[str, str]:
    """``slotbridge consume``'s environment: where to read and write, nothing else, so the
    trigger, master and Spark settings are the job's defaults (unless --trigger-interval-s
    or --conf)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTBRIDGE_")}
    env.update(
        {
            "SLOTBRIDGE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "SLOTBRIDGE_TOPIC_PREFIX": settings.topic_prefix,
            "SLOTBRIDGE_TABLES": json.dumps(settings.tables),
            "SLOTBRIDGE_WAREHOUSE": settings.warehouse,
            "SLOTBRIDGE_CHECKPOINT_DIR": settings.checkpoint_dir,
            "SLOTBRIDGE_STATUS_PATH": str(work / "status.json"),
            "SLOTBRIDGE_TRIGGER_INTERVAL_S": str(settings.trigger_interval_s),
            "SLOTBRIDGE_SPARK_CONF": json.dumps(settings.spark_conf),
            "SLOTBRIDGE_JARS_DIR": str(settings.jars_dir),
            # JSON, so the bench reads each batch's phases back from the log.
            "SLOTBRIDGE_LOG_FORMAT": "json",
            "SLOTBRIDGE_HTTP_PORT": "0",
        }
    )
    return env


class CpuSampler(threading.Thread):
    """The JVM's CPU seconds every ``every_s``: ``samples`` holds (epoch seconds, CPU s)."""

    def __init__(self, pid: int, every_s: float) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.every_s = every_s
        self.samples: list[tuple[float, float]] = []
        self.stop_flag = threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                self.samples.append((time.time(), jvm_cpu_s(self.pid)))
            except FileNotFoundError:
                return  # the JVM ended
            self.stop_flag.wait(self.every_s)

    def at(self, when: float) -> float | None:
        """The CPU seconds of the last sample at or before ``when`` (None: none yet)."""
        before = [cpu for at, cpu in self.samples if at <= when]
        return before[-1] if before else None


@dataclass
class Batch:
    batch_id: int
    started: float  # epoch seconds: the checkpoint's offsets file
    spark_s: float | None  # offsets file -> commits file
    cpu_s: float | None  # the JVM's CPU seconds over the same span (None: not sampled)
    logged: dict[str, Any]  # the consumer's "batch applied" line


def applied_lines(log: Path) -> list[dict[str, Any]]:
    """The consumer's "batch applied" lines so far, oldest first. The consumer may be
    writing its last line as this reads: only whole lines (ended by a newline) count."""
    whole = log.read_text(errors="replace").rpartition("\n")[0]
    lines = (line for line in whole.splitlines() if line.startswith("{"))
    return [d for d in map(json.loads, lines) if d.get("msg") == "batch applied"]


def changes_of(logged: dict[str, Any]) -> int:
    return sum(int(c["applied"]) for c in logged["tables"].values())


def batches(log: Path, checkpoint: Path, cpu: CpuSampler) -> list[Batch]:
    """The consumer's micro-batches, oldest first: its "batch applied" lines with the
    times the checkpoint's offsets and commits files were written and the JVM's CPU
    seconds in between."""
    found = []
    for line in applied_lines(log):
        batch_id = int(line["batch_id"])
        offsets = checkpoint / "offsets" / str(batch_id)
        commit = checkpoint / "commits" / str(batch_id)
        started = offsets.stat().st_mtime
        spark_s = cpu_s = None
        if commit.exists():
            ended = commit.stat().st_mtime
            spark_s = ended - started
            cpu_start, cpu_end = cpu.at(started), cpu.at(ended)
            if cpu_start is not None and cpu_end is not None:
                cpu_s = cpu_end - cpu_start
        found.append(Batch(batch_id, started, spark_s, cpu_s, line))
    return found


def print_batches(found: list[Batch], measured_from: float, prefix: str) -> None:
    for b in found:
        changes = changes_of(b.logged)
        spark = "-" if b.spark_s is None else f"{b.spark_s:.1f}"
        cpu = "-" if b.cpu_s is None else f"{b.cpu_s:.1f}"
        print(
            f"batch {b.batch_id}: at {b.started - measured_from:+.1f}s, {changes:,} changes, "
            f"{spark} s offsets -> commit ({cpu} s JVM CPU), "
            f"{b.logged['seconds']:.1f} s in foreachBatch; the driver JVM {_jvm(b.logged)}"
        )
        jobs = b.logged["jobs"]
        for name, seconds in b.logged["phases"].items():
            shown = name.replace(prefix, "")
            print(f"    {shown:<40} {seconds:6.1f} s {jobs.get(name, 0):3d} jobs")


def _jvm(logged: dict[str, Any]) -> str:
    """The batch's JVM work as its line gives it (``spark_consumers.timings``)."""
    jvm = logged.get("jvm") or {}
    return (
        f"loaded {jvm.get('classes_loaded', '-')} classes, JIT {jvm.get('jit_ms', '-')} ms, "
        f"GC {jvm.get('gc_ms', '-')} ms"
    )


def java_child(pid: int) -> int:
    """The JVM ``slotbridge consume`` (process ``pid``) started: the driver, which runs
    local mode's tasks."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    javas = [int(c) for c in children if Path(f"/proc/{c}/comm").read_text().strip() == "java"]
    if len(javas) != 1:
        raise RuntimeError(f"expected one JVM under the consumer, found {javas}")
    return javas[0]


def wait_seen(
    reader: Reader, keys: range, stall_s: float, consumer: subprocess.Popen[bytes], what: str
) -> None:
    """Until the reader has seen every key of ``keys``; fails when the consumer exits or no
    new table version arrived for ``stall_s`` (a stall, not a slow machine)."""
    while not all(k in reader.seen for k in keys):
        if reader.error is not None:
            raise RuntimeError(f"{what}: the reader failed ({reader.error!r})")
        if consumer.poll() is not None:
            raise RuntimeError(f"{what}: the consumer exited with {consumer.returncode}")
        if time.monotonic() - reader.last_progress > stall_s:
            raise TimeoutError(f"{what}: no new table version for {stall_s:.0f}s")
        time.sleep(0.2)


def caught_up(log: Path, checkpoint: Path, rate: int, trigger_s: float, since: float) -> bool:
    """The consumer keeps up with the write instead of draining a backlog: its last batch
    started after ``since`` (epoch seconds), took at most two trigger intervals and held at
    most two intervals' worth of changes, and the batch after it (if one is running) has
    not run longer than that."""
    applied = applied_lines(log)
    if not applied:
        return False
    last = applied[-1]
    started = (checkpoint / "offsets" / str(last["batch_id"])).stat().st_mtime
    running = checkpoint / "offsets" / str(int(last["batch_id"]) + 1)
    return (
        started >= since
        and last["seconds"] <= 2 * trigger_s
        and changes_of(last) <= 2 * rate * trigger_s
        and (not running.exists() or time.time() - running.stat().st_mtime <= 2 * trigger_s)
    )


def warm_up(
    args: argparse.Namespace,
    dsn: str,
    schema: str,
    pgbench: tuple[str, ...],
    consumer: tuple[Path, Path],
    trigger_s: float,
) -> tuple[float, bool]:
    """The warm-up write: ``--warm-up`` seconds, then 30 s more at a time until the consumer
    (its log and checkpoint folder) has caught up or ``--max-warm-up`` seconds have passed.
    Its seconds, and whether it caught up."""
    began, since = time.monotonic(), time.time()
    chunk = args.warm_up
    while True:
        OLTP.run_pgbench(dsn, schema, *pgbench, "-T", str(int(chunk)))
        spent = time.monotonic() - began
        if caught_up(*consumer, args.rate, trigger_s, since):
            return spent, True
        if spent >= args.max_warm_up:
            return spent, False
        say(f"warm-up: {spent:.0f}s, the consumer has not caught up yet")
        chunk = 30


def run(args: argparse.Namespace, stack: Stack, work: Path) -> dict[str, Any]:
    dsn, bootstrap = stack.primary_dsn, stack.kafka_bootstrap
    tag = f"fresh{int(time.time()) % 1_000_000}"
    schema, prefix = f"bench_{tag}", f"bench.{tag}"
    tables = [f"{schema}.{t}" for t in OLTP.tables]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        OLTP.prefill(dsn, schema, 0)  # pgbench's own tables, filled by pgbench -i
        conn.execute(f"CREATE PUBLICATION {tag} FOR TABLE {', '.join(tables)}")
    trigger_s = args.trigger_interval_s
    if trigger_s is None:
        trigger_s = ConsumerSettings.model_fields["trigger_interval_s"].default
    settings = ConsumerSettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=prefix,
        tables=tables,
        warehouse=str(work / tag / "warehouse"),
        checkpoint_dir=str(work / tag / "checkpoint"),
        trigger_interval_s=trigger_s,
        spark_conf=dict(c.split("=", 1) for c in args.conf),
        jars_dir=jars_dir(cache_dir(), SPARK_SET),
    )
    env = daemon_env(dsn, bootstrap, tag, tag, tables, prefix, work / tag / "spool")
    paths = table_paths(settings.warehouse, f"{schema}.pgbench_history")
    reader = Reader(paths.current, 0.1)
    bridge: subprocess.Popen[bytes] | None = None
    cpu: CpuSampler | None = None
    consumer: subprocess.Popen[bytes] | None = None
    try:
        bridge, alive = start_daemon(env, work / f"{tag}-bridge.log")
        wait_streaming(work / f"{tag}-bridge.log", "streaming", alive)
        with (work / f"{tag}-consume.log").open("wb") as log:
            consumer = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "consume"],
                env=consumer_env(settings, work / tag),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        reader.start()
        tps = max(1, args.rate // OLTP_CHANGES_PER_TXN)
        pgbench = ("-n", "-R", str(tps), "-c", "8", "-j", "2")
        OLTP.run_pgbench(dsn, schema, "-n", "-t", "1", "-c", "1")
        say(f"{tag}: waiting for the consumer's first batch (a new JVM)")
        started = time.monotonic()
        while 1 not in reader.seen:
            if reader.error is not None:
                raise RuntimeError(f"the reader failed ({reader.error!r})")
            if consumer.poll() is not None:
                raise RuntimeError(f"the consumer exited; see {work}/{tag}-consume.log")
            time.sleep(0.2)
        say(f"{tag}: first row readable after {time.monotonic() - started:.1f}s")
        jvm = java_child(consumer.pid)
        cpu = CpuSampler(jvm, 0.25)
        cpu.start()
        warm_up_s, warmed = 0.0, False
        if args.warm_up > 0:
            say(f"{tag}: warm-up, {tps * OLTP_CHANGES_PER_TXN:,} changes/s, {args.warm_up:.0f}s+")
            consumer_files = (work / f"{tag}-consume.log", Path(settings.checkpoint_dir))
            warm_up_s, warmed = warm_up(args, dsn, schema, pgbench, consumer_files, trigger_s)
        first = max_hid(dsn, schema) + 1
        say(f"{tag}: measuring, {tps * OLTP_CHANGES_PER_TXN:,} changes/s for {args.seconds:.0f}s")
        load_before = os.getloadavg()
        cpu_before = jvm_cpu_s(jvm)
        measured_from = time.time()
        began = time.monotonic()
        versions_before = reader.versions
        OLTP.run_pgbench(dsn, schema, *pgbench, "-T", str(int(args.seconds)))
        write_s = time.monotonic() - began
        measured = range(first, max_hid(dsn, schema) + 1)
        wait_seen(reader, measured, 10 * trigger_s + 120, consumer, tag)
        load_after = os.getloadavg()
        cpu_s = jvm_cpu_s(jvm) - cpu_before
        until_seen_s = time.time() - measured_from
    finally:
        reader.stop_flag.set()
        if cpu is not None:
            cpu.stop_flag.set()
        for proc in (consumer, bridge):
            if proc is not None:
                stop_process(proc)
        if not args.keep:
            drop_pipeline(
                dsn, bootstrap, [tag], [tag], tag, f"SCHEMA IF EXISTS {schema} CASCADE", prefix
            )
    committed = commit_times(paths.history)
    delays = sorted(reader.seen[k] - committed[k] for k in measured)

    def pct(q: float) -> float:
        return delays[min(len(delays) - 1, int(q * len(delays)))]

    found = batches(work / f"{tag}-consume.log", Path(settings.checkpoint_dir), cpu)
    longest = max((b.logged["seconds"] for b in found if b.started >= measured_from), default=0.0)
    return {
        "batches": found,
        "measured_from": measured_from,
        "warm_up_s": warm_up_s,
        "caught_up_before": warmed,
        "steady": longest <= 2 * trigger_s,
        "longest_batch_s": longest,
        "prefix": f"{schema}.",
        "trigger_interval_s": trigger_s,
        "rows": len(delays),
        "changes_per_s": len(delays) * OLTP_CHANGES_PER_TXN / write_s,
        "versions": reader.versions - versions_before,
        "p50_s": pct(0.50),
        "p90_s": pct(0.90),
        "p99_s": pct(0.99),
        "max_s": delays[-1],
        "jvm_cpu_s": cpu_s,
        "until_seen_s": until_seen_s,
        "load_before": load_before,
        "load_after": load_after,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=2000, help="changes per second")
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--warm-up", type=float, default=30, help="seconds, not counted")
    parser.add_argument(
        "--max-warm-up",
        type=float,
        default=900,
        help="seconds: the warm-up goes on until the consumer has caught up, at most this long",
    )
    parser.add_argument(
        "--trigger-interval-s", type=float, default=None, help="default: the job's own"
    )
    parser.add_argument(
        "--conf", action="append", default=[], help="KEY=VALUE: a Spark setting to try"
    )
    add_stack_arguments(parser)
    parser.add_argument("--keep", action="store_true", help="keep tables, slots and topics")
    args = parser.parse_args()
    with bench_stack(args) as stack:
        work = args.stack_dir / "spark-freshness-bench"
        work.mkdir(parents=True, exist_ok=True)
        result = run(args, stack, work)
    found, measured_from, prefix = (result.pop(k) for k in ("batches", "measured_from", "prefix"))
    print(json.dumps(result))
    print(
        f"commit -> readable in the current-state table, trigger {result['trigger_interval_s']}s, "
        f"{result['rows']:,} rows at {result['changes_per_s']:,.0f} changes/s over "
        f"{result['versions']} table versions: p50 {result['p50_s']:.1f}s, "
        f"p90 {result['p90_s']:.1f}s, p99 {result['p99_s']:.1f}s, max {result['max_s']:.1f}s "
        f"(load {result['load_before'][0]:.1f} -> {result['load_after'][0]:.1f}); the consumer's "
        f"JVM used {result['jvm_cpu_s']:.1f} s of CPU from the measured write's start until "
        f"its last row was seen ({result['until_seen_s']:.1f} s)"
    )
    caught = "caught up" if result["caught_up_before"] else "had NOT caught up"
    steady = "steady" if result["steady"] else "NOT steady"
    print(
        f"warm-up {result['warm_up_s']:.0f} s (the consumer {caught}); the measured window "
        f"was {steady}: its longest batch took {result['longest_batch_s']:.1f} s "
        f"(two trigger intervals: {2 * result['trigger_interval_s']:.0f} s)"
    )
    print_batches(found, measured_from, prefix)


if __name__ == "__main__":
    main()
