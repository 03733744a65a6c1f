"""Debezium next to slotbridge on one stack and the same workloads: throughput, CPU, memory
and latency of both, and the ratios (slotbridge / Debezium).

    python bench/vs_debezium.py [--rows 200000] [--txn-size 1000] [--shapes both]
                                [--rate 5000] [--txn-rows 50] [--seconds 30] [--warm-up 20]
                                [--dbz-poll-ms 10] [--broker-warm-up 3] [--repeat 1]
                                [--workload insert|...|all]
                                [--format slotbridge|debezium|debezium-lean]
                                [--stack-dir .stack/bench] [--json]

Debezium is its PostgreSQL connector (pgoutput) in Kafka Connect standalone
(``slotbridge_dev.connect``), from the bootstrap's jar cache; the script resolves the
bootstrap's Debezium set from Maven Central itself when the cache lacks it. slotbridge is
the daemon of this checkout in the record format ``--format`` names (by default its typed
JSON). Each run of either has its
own table, publication, slot and topics, all dropped afterwards unless ``--keep``.

Throughput, for each shape (``--txn-size``-row transactions, and one ``--rows``-row
transaction), as bench/bridge_bench.py measures it: the rows are loaded while the slots
already exist, so both systems catch up on the same WAL, Debezium first and slotbridge
second (so A B A B with ``--repeat``). Before the first, ``--broker-warm-up`` untimed
passes of bridge_bench's ``insert`` (its ``warm_up``, figures dropped) let the broker's JIT
compile its paths: a fresh broker spends several times the CPU per record in its first
runs, and Debezium, which goes first, would pay for it. Each one's clock runs from the log
line saying it streams (Debezium's "Processing messages", the daemon's "streaming") to the
moment its last row is readable by a read_committed consumer: for Debezium, whose producer is not
transactional, when the change topic's end offset reaches ``--rows``; for the daemon, when
its progress record, committed in the same Kafka transaction as the last rows, reaches the
last commit. Per system: rows/s (also from its process start, where the JVM's start
weighs), CPU seconds per million rows (utime + stime of the daemon, or of the Connect JVM,
over the clock's span), and peak RSS (VmHWM). The ceiling (bare receive rate of a third
slot) is printed for scale. With ``--verify`` (default) both change topics are read back and
must hold exactly ``--rows`` records.

Latency, as bench/latency_bench.py measures it: ``--rate`` rows/s in ``--txn-rows``-row
transactions for ``--seconds``, each row's delay from its ``clock_timestamp()`` at insert
(the ``ts`` column, which Debezium writes as an ISO-8601 string in ``after``) to a
read_committed consumer receiving it; p50 and p99, Debezium first again. The same write
runs ``--warm-up`` seconds before, not counted: while the JVM compiles its hot paths, in
the first seconds at this rate, Debezium's delays reach seconds, and the figures are meant
to be those of services that run for days.

Debezium's settings: its slot is created like the daemon's (failover, so both wait for the
standby the same way) before Connect starts, and ``snapshot.mode=no_data`` then streams from
it. For throughput, as Debezium's documentation suggests, larger batches and queue
(``max.batch.size`` the daemon's ``batch_max_events``, with Debezium's own 1:4 batch to queue
ratio) and the producer batching and codec the daemon's own producer uses. Its queue waits
for a full batch or ``poll.interval.ms`` (500 ms by default) before handing records to
Connect: ``--dbz-poll-ms`` (10 by default) keeps that wait from being most of what its
latency measures. Its JsonConverter writes without the Connect schemas
(``schemas.enable=false``: the payload alone is a fraction of the bytes) and the connector
without its context headers (``extended.headers.enabled=false``), its cheapest records,
unless ``--format debezium`` asks both systems for Debezium's defaults. Neither writes a
transaction topic: Debezium's default (``provide.transaction.metadata=false``), and the
daemon's ``transaction_metadata: false`` (before 29 Nov 2026 the daemon wrote a BEGIN and
an END per source transaction besides, which Debezium did not).
Connect runs with the heap of Kafka's ``connect-standalone.sh`` (2 GB).

Figures, not assertions: the machine is shared, so run it a few times and take medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
from confluent_kafka import Consumer, KafkaException, TopicPartition

from bench.bridge_bench import (
    LogMark,
    Run,
    add_run_arguments,
    bench_stack,
    catch_up,
    drop_pipeline,
    new_tag,
    say,
    stop_process,
    txn_sizes,
    warm_up,
    workloads,
)
from bench.latency_bench import (
    add_rate_arguments,
    create_table,
    inserted_at,
    measure,
    run_mode,
    wait_streaming,
)
from bench.workloads import Workload
from services.bridge.settings import BridgeSettings
from slotbridge_dev.bootstrap import (
    DEBEZIUM_SET,
    DEBEZIUM_VERSION,
    KAFKA_TOOLS_VERSION,
    MAVEN_SETS,
    cache_dir,
    ensure_jars,
    jars_dir,
)
from slotbridge_dev.connect import ConnectWorker, debezium_postgres
from slotbridge_dev.stack.stack import Stack

ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("Debezium", "slotbridge")
# Logged by PostgresStreamingChangeEventSource once the replication stream has started.
DEBEZIUM_STREAMING = "Processing messages"
BATCH = BridgeSettings.model_fields["batch_max_events"].default


def debezium_tuning(poll_ms: int) -> dict[str, str]:
    return {
        "max.batch.size": str(BATCH),
        "max.queue.size": str(4 * BATCH),
        "poll.interval.ms": str(poll_ms),
        # services/bridge/sink/kafka.py's producer settings: the same batching and the same codec.
        "producer.override.linger.ms": "5",
        "producer.override.batch.size": "1000000",
        "producer.override.compression.type": "lz4",
    }


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Everything written to stdout, by this process or a child (Maven), goes to stderr:
    stdout carries the report alone (``--json``)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _connect_alive(worker: ConnectWorker) -> Callable[[], None]:
    """Raises if the worker exited (pointing at its log) or its connector or task failed."""

    def alive() -> None:
        assert worker.proc is not None, "worker not started"
        if worker.proc.poll() is not None:
            raise RuntimeError(
                f"Kafka Connect exited with {worker.proc.returncode}; see {worker.log_path}"
            )
        worker.check()

    return alive


def _debezium_worker(
    args: argparse.Namespace,
    folder: Path,
    dsn: str,
    bootstrap: str,
    name: str,
    prefix: str,
    slot: str,
    publication: str,
    tables: list[str],
) -> ConnectWorker:
    folder.mkdir(parents=True, exist_ok=True)
    connector = debezium_postgres(name, dsn, prefix, slot, publication, tables)
    # Debezium at its fastest: without Connect schemas and context headers, unless the
    # daemon writes Debezium's records with its defaults.
    defaults = args.format == "debezium"
    return ConnectWorker(
        folder,
        args.jars,
        bootstrap,
        {
            **connector,
            **debezium_tuning(args.dbz_poll_ms),
            "extended.headers.enabled": str(defaults).lower(),
        },
        log_level="INFO",
        schemas=defaults,
    )


def debezium_catch_up(
    args: argparse.Namespace, run: Run, slot: str, folder: Path
) -> dict[str, Any]:
    """Debezium through ``run``'s backlog on ``slot``, timed as ``catch_up`` does: done when
    its change topics hold every record the workload's changes make in Debezium's format
    (its producer is not transactional, so their end offsets count records)."""
    prefix = run.other_prefix("dbz")
    topics = [f"{prefix}.{table}" for table in run.tables]
    expected = run.workload.expected_records("debezium", run.plan)
    worker = _debezium_worker(
        args,
        folder,
        run.dsn,
        run.bootstrap,
        f"dbz-{run.tag}",
        prefix,
        slot,
        run.publication,
        run.tables,
    )
    probe = Consumer(
        {
            "bootstrap.servers": run.bootstrap,
            "group.id": f"vs-{run.tag}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )

    def end_offset(topic: str) -> int:
        try:
            _low, high = probe.get_watermark_offsets(TopicPartition(topic, 0), timeout=5)
        except KafkaException:  # the topic comes with Debezium's first record
            return 0
        return int(high)

    def reached() -> tuple[bool, int]:
        records = sum(end_offset(topic) for topic in topics)
        if records >= expected:
            return True, records
        time.sleep(0.02)
        return False, records

    spawned = time.monotonic()
    worker.start()
    proc = worker.proc
    assert proc is not None
    mark = LogMark(worker.log_path, DEBEZIUM_STREAMING, proc.pid, lambda: proc.poll() is None)
    mark.start()
    try:
        result = catch_up(
            proc.pid,
            spawned,
            mark,
            reached,
            _connect_alive(worker),
            run.plan.changes,
            f"{run.tag}: Debezium",
        )
    finally:
        probe.close()
        stop_process(proc)
        mark.join(1)
    if run.verify:
        counted = [run.count(topic) for topic in topics]
        result["change_records"] = sum(records for records, _ in counted)
        result["record_bytes"] = sum(size for _, size in counted) / max(expected, 1)
        if result["change_records"] != expected:
            raise RuntimeError(
                f"Debezium's topics hold {result['change_records']} records, expected {expected}"
            )
    return result


def throughput(
    args: argparse.Namespace,
    dsn: str,
    bootstrap: str,
    workload: Workload,
    txn_size: int,
    index: int,
    work: Path,
) -> dict[str, Any]:
    """One run of ``workload``: Debezium, then the daemon in the same record format
    (``--format``), on their own slots of the same WAL."""
    tag = new_tag(workload.name, txn_size >= args.rows, index)
    slot = f"dbz_{tag}"
    run = Run(
        dsn,
        bootstrap,
        workload,
        args.rows,
        txn_size,
        tag,
        work / "spool",
        args.verify,
        formats=(args.format,),
        other_slots=[slot],
        other_prefixes=["dbz"],
        # Debezium writes no transaction topic by default (provide.transaction.metadata):
        # the daemon neither, so both write the same records.
        transaction_metadata=False,
    )
    with run.prepared(args.keep) as (load_s, ceiling):
        say(f"{tag}: ceiling {ceiling['changes_per_s']:,.0f} changes/s; starting Debezium")
        debezium = debezium_catch_up(args, run, slot, work / f"{tag}-connect")
        say(f"{tag}: Debezium {_brief(debezium)}; starting slotbridge")
        ours = run.e2e(args.format, ceiling["end_lsn"], work / f"{tag}.log")
        say(f"{tag}: slotbridge {_brief(ours)}")
    return {**run.facts(load_s, ceiling), "Debezium": debezium, "slotbridge": ours}


def _brief(result: dict[str, Any]) -> str:
    return (
        f"{result['changes_per_s']:,.0f} changes/s, {result['cpu_s_per_1m_changes']:.1f} CPU s"
        f" per 1M changes, peak RSS {result['peak_rss_mb']:.0f} MB"
    )


def debezium_latency(
    args: argparse.Namespace, dsn: str, bootstrap: str, work: Path
) -> dict[str, Any]:
    """latency_bench's measurement through Debezium, on its own table, slot and topics."""
    tag = f"latdbz{int(time.time()) % 1_000_000}"
    table, prefix = f"bench_{tag}", f"bench.{tag}"
    create_table(dsn, table, tag)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, false, true)",
            (tag,),
        )
    worker = _debezium_worker(
        args, work / tag, dsn, bootstrap, tag, prefix, tag, tag, [f"public.{table}"]
    )
    alive = _connect_alive(worker)
    try:
        worker.start()
        assert worker.proc is not None
        try:
            wait_streaming(worker.log_path, DEBEZIUM_STREAMING, alive, 120)
            result = measure(
                args,
                dsn,
                bootstrap,
                table,
                f"{prefix}.public.{table}",
                "Debezium",
                alive,
                inserted_at(lambda value: value["payload"]["after"])
                if worker.schemas
                else inserted_at(),
            )
        finally:
            stop_process(worker.proc)
    finally:
        if not args.keep:
            drop_pipeline(dsn, bootstrap, [tag], [], tag, f"TABLE IF EXISTS {table}", prefix)
    return result


def latency(args: argparse.Namespace, dsn: str, bootstrap: str, work: Path) -> dict[str, Any]:
    debezium = debezium_latency(args, dsn, bootstrap, work)
    ours = run_mode("new", args, dsn, bootstrap, work)
    del ours["mode"]
    return {"Debezium": debezium, "slotbridge": ours}


# (label, key, format) per table row; throughput keys are catch_up's, latency keys measure's.
THROUGHPUT_ROWS = [
    ("changes/s", "changes_per_s", "{:,.0f}"),
    ("changes/s from start", "changes_per_s_from_spawn", "{:,.0f}"),
    ("CPU s per 1M changes", "cpu_s_per_1m_changes", "{:,.1f}"),
    ("peak RSS MB", "peak_rss_mb", "{:,.0f}"),
]
LATENCY_ROWS = [("p50 ms", "p50_ms", "{:,.1f}"), ("p99 ms", "p99_ms", "{:,.1f}")]


def _median(runs: list[dict[str, Any]], rows: list[tuple[str, str, str]]) -> dict[str, Any]:
    """Per system, the median of each figure over the runs, and slotbridge / Debezium."""
    out: dict[str, Any] = {
        system: {key: statistics.median(r[system][key] for r in runs) for _, key, _ in rows}
        for system in SYSTEMS
    }
    out["ratio"] = {key: out["slotbridge"][key] / out["Debezium"][key] for _, key, _ in rows}
    return out


def _print_rows(title: str, median: dict[str, Any], rows: list[tuple[str, str, str]]) -> None:
    for i, (label, key, fmt) in enumerate(rows):
        theirs, ours = (fmt.format(median[system][key]) for system in SYSTEMS)
        print(
            f"{title if i == 0 else '':22} {label:26} {theirs:>12} {ours:>12}"
            f" {median['ratio'][key]:8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, 200_000)
    add_rate_arguments(parser, warm_up=20)
    parser.add_argument(
        "--dbz-poll-ms",
        type=int,
        default=10,
        help="Debezium's poll.interval.ms (its default: 500)",
    )
    parser.add_argument(
        "--format",
        choices=("slotbridge", "debezium", "debezium-lean"),
        default="slotbridge",
        help="the daemon's record format (debezium: the same records as Debezium's with its "
        "defaults, which Debezium then keeps too; debezium-lean: both without Connect "
        "schemas and context headers)",
    )
    parser.add_argument(
        "--broker-warm-up",
        type=int,
        default=3,
        metavar="PASSES",
        help="untimed passes of bridge_bench's insert before the runs, for the broker's JIT "
        "(default 3; 0: none)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    chosen = workloads(parser, args)

    started = time.monotonic()
    with _stdout_to_stderr():
        ensure_jars(cache_dir(), {DEBEZIUM_SET: MAVEN_SETS[DEBEZIUM_SET]})
    with _stdout_to_stderr(), bench_stack(args) as stack:
        report = compare(args, stack, chosen)
    report["seconds"] = time.monotonic() - started
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(args, report)


def compare(args: argparse.Namespace, stack: Stack, chosen: list[Workload]) -> dict[str, Any]:
    """Every run of both systems, then their medians per workload and shape."""
    args.jars = jars_dir(cache_dir(), DEBEZIUM_SET)
    work = args.stack_dir / "vs-debezium"
    work.mkdir(parents=True, exist_ok=True)
    dsn, bootstrap = stack.primary_dsn, stack.kafka_bootstrap
    warm_up(stack, args.stack_dir, work, args.broker_warm_up, args.txn_size)
    runs: list[dict[str, Any]] = []
    latencies: list[dict[str, Any]] = []
    for i in range(args.repeat):
        for workload in chosen:
            runs.extend(
                throughput(args, dsn, bootstrap, workload, size, i, work)
                for size in txn_sizes(args, workload)
            )
        latencies.append(latency(args, dsn, bootstrap, work))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["workload"], r["shape"]), []).append(r)
    shapes = [
        {
            "workload": workload,
            "shape": shape,
            "ceiling_changes_per_s": statistics.median(
                r["ceiling"]["changes_per_s"] for r in group
            ),
            **_median(group, THROUGHPUT_ROWS),
        }
        for (workload, shape), group in groups.items()
    ]
    settings = {k: v for k, v in vars(args).items() if k not in ("jars", "stack_dir", "json")}
    return {
        "settings": settings,
        "versions": {"debezium": DEBEZIUM_VERSION, "connect": KAFKA_TOOLS_VERSION},
        "debezium_tuning": debezium_tuning(args.dbz_poll_ms),
        "throughput": runs,
        "latency": latencies,
        "median": {"throughput": shapes, "latency": _median(latencies, LATENCY_ROWS)},
    }


def print_report(args: argparse.Namespace, report: dict[str, Any]) -> None:
    print(
        f"\nslotbridge vs Debezium {DEBEZIUM_VERSION} (Kafka Connect {KAFKA_TOOLS_VERSION}"
        f" standalone), {args.repeat} run(s) each{', medians' if args.repeat > 1 else ''};"
        " ratio = slotbridge / Debezium"
    )
    print(
        f"\nthroughput: changes caught up from a loaded slot (--rows {args.rows:,});"
        f" slotbridge in its {args.format} format"
    )
    print(f"{'workload, shape':22} {'':26} {'Debezium':>12} {'slotbridge':>12} {'ratio':>8}")
    for shape in report["median"]["throughput"]:
        _print_rows(f"{shape['workload']}, {shape['shape']}", shape, THROUGHPUT_ROWS)
        print(
            f"{'':22} (bare receive ceiling of the slot:"
            f" {shape['ceiling_changes_per_s']:,.0f} changes/s)"
        )
    print(
        f"\nlatency: insert -> read_committed consumer, {args.rate:,} rows/s in "
        f"{args.txn_rows}-row transactions, {args.seconds:.0f}s after {args.warm_up:.0f}s"
        " of warm-up"
    )
    _print_rows("", report["median"]["latency"], LATENCY_ROWS)
    print(f"\n{report['seconds'] / 60:.1f} min in all")


if __name__ == "__main__":
    main()
