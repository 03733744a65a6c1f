"""The Spark consumer next to the bridge on pgbench's OLTP mix: whose changes/s is higher.

    .venv/bin/python bench/spark_oltp_bench.py [--rows 400000] [--batch 200000]
        [--repeat 1] [--warm-up-rows 40000] [--conf KEY=VALUE ...]
        [--stack-dir .stack/bench] [--keep-stack]

Per repeat, on the local stack (started and stopped by the bench unless it was running or
``--keep-stack``):

1. the bridge: ``bench/bridge_bench.py``'s ``oltp`` run. pgbench's TPC-B-like
   transactions (three single-row UPDATEs of ``pgbench_accounts``, ``_tellers`` and
   ``_branches`` and one INSERT into ``pgbench_history`` each, from many clients) are
   loaded while the slots exist, and the daemon of this checkout, in the default record
   format, catches up on its own slot: its end-to-end changes/s, measured as that bench
   measures it (its "streaming" log line to the progress record of the last commit);
2. the consumer: ``spark_consumers`` (the job's own stream, ``availableNow``, local[2],
   at most ``--batch`` records a micro-batch; 0: no cap, the job's default) builds the
   four tables' Delta history and current state from the change topics the daemon just
   wrote: its changes/s (the catch-up's wall time, the stream's start to its end), the JVM's
   CPU seconds and each batch's phases.

It prints both rates and the consumer's as a share of the bridge's (#34's goal: at least
1), and with ``--repeat`` above 1 the median of each column. The JVM first consumes a
smaller run of the same mix untimed (``--warm-up-rows``, in four batches), so the timed
catch-up does not pay the JVM's class loading and first compilations.

The consumer starts from the change stream: the rows pgbench's initialisation wrote
(``-s 10``, 1M accounts) were never published, so its current-state tables hold only the
keys the stream touched, and an update of an account it holds no row of is written as a
new row. That is more work for its MERGEs than a consumer that had read the tables'
snapshot (the batch's keys are then only partly stored, so the MERGE joins by an outer
join), so the figure is a low one.

Verified after each catch-up, and the bench exits non-zero when wrong: each table's history
holds one row per change (``(commit_lsn, total_order)`` distinct, as many as pgbench's
transactions made), the current state of ``pgbench_history`` holds every row PostgreSQL
has, and the current state of the other three tables holds, for every key it has, the
balance PostgreSQL has.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
from pyspark.sql import SparkSession

from bench.bridge_bench import Run as BridgeRun
from bench.bridge_bench import add_stack_arguments, bench_stack, new_tag, say
from bench.spark_merge_bench import Run, consume, print_batches, report_verification
from bench.workloads import Oltp
from services.common.logs import setup_logging
from slotbridge_dev.bootstrap import SPARK_SET, cache_dir, jars_dir
from slotbridge_dev.stack.stack import Stack
from spark_consumers import schema as s
from spark_consumers.job import build_session
from spark_consumers.settings import ConsumerSettings
from spark_consumers.tables import table_paths

OLTP = Oltp()
# The tables pgbench's transactions update: each one's key and the balance they change.
UPDATED = (
    ("pgbench_accounts", "aid", "abalance"),
    ("pgbench_tellers", "tid", "tbalance"),
    ("pgbench_branches", "bid", "bbalance"),
)
# The record format the daemon writes, and so the topic prefix's last part.
FORMAT = "slotbridge"


def consumer_settings(
    run: BridgeRun, work: Path, batch: int, conf: dict[str, str]
) -> ConsumerSettings:
    """The consumer of the daemon's change topics of ``run``, its tables under ``work``."""
    return ConsumerSettings(
        spark_conf=conf,
        kafka_bootstrap=run.bootstrap,
        topic_prefix=run.format_prefix(FORMAT),
        tables=run.tables,
        warehouse=str(work / run.tag / "warehouse"),
        checkpoint_dir=str(work / run.tag / "checkpoint"),
        spark_master="local[2]",
        jars_dir=jars_dir(cache_dir(), SPARK_SET),
        max_offsets_per_trigger=batch or None,
        log_format="text",
        http_port=0,
    )


def verify(spark: SparkSession, settings: ConsumerSettings, run: BridgeRun) -> list[str]:
    """What the consumer's tables hold that PostgreSQL and the load do not say."""
    problems = []
    stored_changes = 0
    for table in OLTP.tables:
        history = spark.read.format("delta").load(
            table_paths(settings.warehouse, f"{run.schema}.{table}").history
        )
        rows = history.count()
        positions = history.select(s.COMMIT_LSN, s.TOTAL_ORDER).distinct().count()
        if rows != positions:
            problems.append(f"{table}: {rows - positions} history rows stored twice")
        stored_changes += positions
    if stored_changes != run.plan.changes:
        problems.append(f"history: {stored_changes} changes, pgbench made {run.plan.changes}")
    with psycopg.connect(run.dsn) as conn:
        for table, key, balance in UPDATED:
            current = spark.read.format("delta").load(
                table_paths(settings.warehouse, f"{run.schema}.{table}").current
            )
            stored = {int(r[0]): int(r[1]) for r in current.select(key, balance).collect()}
            source: dict[int, int] = dict(
                conn.execute(
                    f"SELECT {key}, {balance} FROM {run.schema}.{table} WHERE {key} = ANY(%s)",
                    (list(stored),),
                ).fetchall()
            )
            wrong = len([k for k, v in stored.items() if source.get(k) != v])
            if wrong:
                problems.append(f"{table}: {wrong} of {len(stored)} current rows differ")
        row = conn.execute(f"SELECT count(*) FROM {run.schema}.pgbench_history").fetchone()
        inserted = int(row[0]) if row is not None else 0
    held = (
        spark.read.format("delta")
        .load(table_paths(settings.warehouse, f"{run.schema}.pgbench_history").current)
        .count()
    )
    if held != inserted:
        problems.append(
            f"pgbench_history: the current state holds {held} rows, PostgreSQL {inserted}"
        )
    return problems


def one_run(
    stack: Stack,
    rows: int,
    index: int,
    work: Path,
    spark: SparkSession | None,
    batch: int,
    conf: dict[str, str],
) -> tuple[SparkSession, float, Run, list[str], BridgeRun]:
    """The bridge's catch-up, then the consumer's, over one load of ``rows`` changes."""
    tag = new_tag("soltp", False, index)
    # pgbench's transactions are their own size: the run's transaction size is not used.
    run = BridgeRun(
        stack.primary_dsn,
        stack.kafka_bootstrap,
        OLTP,
        rows,
        txn_size=rows,
        tag=tag,
        spool_dir=work / "spool",
        verify=False,
    )
    with run.prepared(False) as (_, ceiling):
        bridge = run.e2e(FORMAT, ceiling["end_lsn"], work / f"{tag}-bridge.log")
        settings = consumer_settings(run, work, batch, conf)
        if spark is None:
            spark = build_session(settings)
        consumed = consume(spark, settings)
        problems = verify(spark, settings, run)
    return spark, float(bridge["changes_per_s"]), consumed, problems, run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=400_000, help="changes of a timed run")
    parser.add_argument(
        "--batch", type=int, default=200_000, help="max records a micro-batch; 0: no cap"
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--warm-up-rows", type=int, default=40_000)
    parser.add_argument(
        "--conf", action="append", default=[], help="KEY=VALUE: a Spark setting to try"
    )
    add_stack_arguments(parser)
    args = parser.parse_args()
    setup_logging("text", "WARNING")
    conf = dict(c.split("=", 1) for c in args.conf)
    problems: list[str] = []
    figures: list[tuple[float, float]] = []
    with bench_stack(args) as stack:
        work = args.stack_dir / "spark-oltp-bench"
        work.mkdir(parents=True, exist_ok=True)
        say(f"warm-up: {args.warm_up_rows:,} changes, both pipelines, untimed")
        spark, _, _, wrong, _ = one_run(
            stack, args.warm_up_rows, 0, work, None, max(1, args.warm_up_rows // 4), conf
        )
        problems += [f"warm-up: {p}" for p in wrong]
        for i in range(1, args.repeat + 1):
            spark, bridge, consumed, wrong, run = one_run(
                stack, args.rows, i, work, spark, args.batch, conf
            )
            problems += [f"run {i}: {p}" for p in wrong]
            changes = run.plan.changes
            print(
                f"\n== run {i}: {changes:,} changes in {run.plan.transactions:,} pgbench "
                f"transactions ({run.shape})"
            )
            print(f"bridge: {bridge:,.0f} changes/s end to end")
            print_batches("consumer", consumed, f"{run.schema}.")
            rate = changes / consumed.wall_s
            figures.append((bridge, rate))
            print(f"consumer: {rate:,.0f} changes/s; consumer / bridge {rate / bridge:.3f}")
        spark.stop()
    print("\nrun  bridge changes/s  consumer changes/s  consumer / bridge")
    for i, (bridge, rate) in enumerate(figures, 1):
        print(f"{i:<4} {bridge:>16,.0f}  {rate:>18,.0f}  {rate / bridge:.3f}")
    if len(figures) > 1:
        # The median of each column apart: the median run's bridge and consumer may differ.
        bridges, rates = [b for b, _ in figures], [r for _, r in figures]
        shares = [r / b for b, r in figures]
        print(
            f"{'med':<4} {statistics.median(bridges):>16,.0f}  "
            f"{statistics.median(rates):>18,.0f}  {statistics.median(shares):.3f}"
        )
    report_verification(
        problems,
        "every change once in the history, pgbench_history's rows all in the current state, "
        "every stored balance PostgreSQL's",
    )


if __name__ == "__main__":
    main()
