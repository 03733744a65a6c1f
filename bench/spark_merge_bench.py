"""Changes applied per second into current-state tables, next to a plain Kafka->Parquet append.

    .venv/bin/python bench/spark_merge_bench.py --bootstrap HOST:PORT [--changes 1000000]
                                                [--batch 200000]

Publishes ``--changes`` synthetic changes (inserts, updates, deletes over a key space of a
tenth of that; a delete also brings its Kafka tombstone) in the bridge's format, then
times, in one Spark session and on the same Kafka records with the same records per
trigger (``--batch``): (1) the consumer (history + current-state MERGE) and (2) an append
of the raw records to Parquet. Prints both rates and their ratio.

Fairness:

- Warm-up. The first query of a JVM pays for class loading, JIT compilation, Spark's code
  generation and the first Kafka/Delta/Parquet setup; whichever pipeline ran first used to
  pay it alone. Both pipelines first run untimed over a small topic of the same shape
  (``--warmup`` changes, in its own warehouse), so both timed runs start on a warm JVM.
- Same input, same unit. Both read every record of the topic (tombstones included) under
  the same trigger cap; the ratio is of records per second. Changes per second (what the
  consumer is for) are printed too.
- JVM CPU seconds are printed next to wall seconds: on a shared machine the wall time
  moves with the neighbours' load, the CPU time much less.

Afterwards the results are verified, and the script exits non-zero when they are wrong:
the current-state table holds exactly the publisher's live keys, each with its last
change's values; the history holds each published change exactly once and one open
version per live key; the Parquet copy holds every record; nothing was dead-lettered.

Per batch it prints Spark's own timing of the trigger (``durationMs.addBatch``: the
foreachBatch function, or the Parquet write) and, per Delta table, Delta's MERGE metrics
(execution, source materialization, scan for touched files, rewrite).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from services.common.logs import setup_logging
from slotbridge_dev.bootstrap import SPARK_SET, cache_dir, jars_dir
from slotbridge_dev.synthetic import SynthColumn, SynthTable, TransactionalWriter
from spark_consumers.job import build_session, start_query
from spark_consumers.kafka import kafka_options
from spark_consumers.settings import ConsumerSettings
from spark_consumers.status import Status
from spark_consumers.tables import dead_letter_path, table_paths

NUM = ((12 << 16) | 2) + 4
TABLE = "public.bench"


@dataclass
class Published:
    """What the publisher sent, and the state it leaves: key -> number of its last change."""

    topic: str
    changes: int = 0
    records: int = 0
    live: dict[int, int] = field(default_factory=dict)


def publish(bootstrap: str, prefix: str, changes: int) -> Published:
    table = SynthTable(
        prefix,
        "public",
        "bench",
        (
            SynthColumn("id", "bigint", 20, key=True),
            SynthColumn("name", "text", 25),
            SynthColumn("amount", "numeric(12,2)", 1700, NUM),
            SynthColumn("at", "timestamp with time zone", 1184),
        ),
    )
    writer = TransactionalWriter(bootstrap, f"{prefix}-bench")
    writer.create_topics([table.topic], compacted=[f"{prefix}.schema"])
    writer.send([table.schema_record()])
    out = Published(table.topic, changes)
    rng = random.Random(1)
    keys = max(1, changes // 10)
    batch = []
    for n in range(changes):
        key = rng.randrange(keys)
        if key in out.live and rng.random() < 0.1:
            batch += table.change("d", {"id": key}, 1000 + n, 1, n)
            del out.live[key]
        else:
            batch += table.change(
                "u" if key in out.live else "c",
                {
                    "id": key,
                    "name": f"name {n}",
                    "amount": f"{n % 100000}.50",
                    "at": "2024-05-01T10:00:00.000001Z",
                },
                1000 + n,
                1,
                n,
            )
            out.live[key] = n
        if len(batch) >= 20_000:
            out.records += writer.send(batch)
            batch = []
    out.records += writer.send(batch)
    return out


def jvm_cpu_s(spark: SparkSession) -> float:
    """CPU seconds (user + system) the driver JVM, which runs local mode's tasks, has used."""
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()  # type: ignore[union-attr]
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Run:
    wall_s: float
    cpu_s: float
    batches: list[tuple[int, int, float]]  # batch id, input rows, addBatch seconds


def timed(spark: SparkSession, start: Callable[[], StreamingQuery]) -> Run:
    cpu, started = jvm_cpu_s(spark), time.monotonic()
    query = start()
    query.awaitTermination()
    wall, cpu = time.monotonic() - started, jvm_cpu_s(spark) - cpu
    if query.exception() is not None:
        raise SystemExit(f"query failed: {query.exception()}")
    batches = [
        (int(p["batchId"]), int(p["numInputRows"]), int(p["durationMs"].get("addBatch", 0)) / 1000)
        for p in map(_progress_dict, query.recentProgress)
        if p["numInputRows"]
    ]
    return Run(wall, cpu, batches)


def _progress_dict(progress: Any) -> dict[str, Any]:
    # PySpark 4 returns StreamingQueryProgress objects; older versions plain dicts.
    json_value = getattr(progress, "jsonValue", None)
    return dict(json_value()) if callable(json_value) else dict(progress)


def consume(spark: SparkSession, settings: ConsumerSettings) -> Run:
    return timed(spark, lambda: start_query(spark, settings, Status(), once=True))


def append(
    spark: SparkSession, settings: ConsumerSettings, topic: str, root: Path, batch: int
) -> Run:
    return timed(
        spark,
        lambda: (
            spark.readStream.format("kafka")
            .options(**kafka_options(settings))
            .option("subscribe", topic)
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", str(batch))
            .load()
            .selectExpr("CAST(key AS STRING) key", "CAST(value AS STRING) value")
            .writeStream.format("parquet")
            .option("path", str(root / "parquet"))
            .option("checkpointLocation", str(root / "ck-parquet"))
            .trigger(availableNow=True)
            .start()
        ),
    )


def settings_for(bootstrap: str, prefix: str, root: Path, batch: int) -> ConsumerSettings:
    return ConsumerSettings(
        kafka_bootstrap=bootstrap,
        topic_prefix=prefix,
        warehouse=str(root / "wh"),
        checkpoint_dir=str(root / "ck"),
        spark_master="local[2]",
        jars_dir=jars_dir(cache_dir(), SPARK_SET),
        max_offsets_per_trigger=batch,
        log_format="text",
    )


def verify(
    spark: SparkSession, settings: ConsumerSettings, sent: Published, parquet: Path
) -> list[str]:
    """Everything that is wrong with the tables the two runs left (empty when right)."""
    problems = []
    paths = table_paths(settings.warehouse, TABLE)
    current = spark.read.format("delta").load(paths.current)
    expected = spark.createDataFrame(
        [(k, f"name {n}") for k, n in sent.live.items()], "id bigint, name string"
    )
    rows = current.count()
    if rows != len(sent.live):
        problems.append(f"current state: {rows} rows, publisher left {len(sent.live)} live keys")
    stored = current.select("id", "name")
    wrong = stored.exceptAll(expected).count() + expected.exceptAll(stored).count()
    if wrong:
        problems.append(f"current state: {wrong} rows differ from the publisher's last change")
    history = spark.read.format("delta").load(paths.history)
    counts = history.agg(
        F.count("*").alias("rows"),
        F.count_distinct("_cdc_commit_lsn", "_cdc_total_order", "_cdc_op").alias("distinct"),
        F.sum(F.col("valid_to_lsn").isNull().cast("int")).alias("open"),
    ).first()
    assert counts is not None
    if counts["rows"] != sent.changes or counts["distinct"] != sent.changes:
        problems.append(
            f"history: {counts['rows']} rows, {counts['distinct']} distinct "
            f"changes; {sent.changes} changes were published"
        )
    if counts["open"] != len(sent.live):
        problems.append(f"history: {counts['open']} open versions, {len(sent.live)} live keys")
    dead = dead_letter_path(settings.warehouse)
    if DeltaTable.isDeltaTable(spark, dead):
        problems.append(f"{spark.read.format('delta').load(dead).count()} dead letters")
    copied = spark.read.parquet(str(parquet)).count()
    if copied != sent.records:
        problems.append(f"parquet: {copied} rows, {sent.records} records were published")
    return problems


def print_phases(spark: SparkSession, label: str, run: Run, warehouse: str | None) -> None:
    print(f"{label}: {run.wall_s:.1f} s wall, {run.cpu_s:.1f} s JVM CPU")
    for batch_id, rows, seconds in run.batches:
        print(f"  batch {batch_id}: {rows:>7} records, {seconds:5.1f} s in the batch function")
    if warehouse is None:
        return
    paths = table_paths(warehouse, TABLE)
    # Tombstones are appended, not merged: their time is in the "batch applied" phases.
    for name, path in (("history", paths.history), ("current", paths.current)):
        merges = [
            r["operationMetrics"]
            for r in spark.sql(f"DESCRIBE HISTORY delta.`{path}`").orderBy("version").collect()
            if r["operation"] == "MERGE"
        ]

        def total(metric: str, merges: list[dict[str, str]] = merges) -> float:
            return sum(int(m.get(metric, 0)) for m in merges) / 1000

        each = " ".join(f"{int(m['executionTimeMs']) / 1000:.1f}" for m in merges)
        print(
            f"  {name} MERGE x{len(merges)}: {total('executionTimeMs'):.1f} s "
            f"(materialize source {total('materializeSourceTimeMs'):.1f}, scan "
            f"{total('scanTimeMs'):.1f}, rewrite {total('rewriteTimeMs'):.1f}); "
            f"each: {each}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--changes", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=200_000, help="max records per batch")
    parser.add_argument("--warmup", type=int, default=20_000, help="changes of the warm-up")
    args = parser.parse_args()
    # The consumer's "batch applied" lines carry each batch's phase breakdown.
    setup_logging("text", "INFO")
    root = Path(tempfile.mkdtemp(prefix="spark-bench-"))
    run_id = uuid.uuid4().hex[:6]
    started = time.monotonic()
    warm = publish(args.bootstrap, f"warm{run_id}", args.warmup)
    sent = publish(args.bootstrap, f"bench{run_id}", args.changes)
    print(
        f"published {sent.changes} changes ({sent.records} records, {len(sent.live)} live "
        f"keys) in {time.monotonic() - started:.1f}s"
    )

    warm_settings = settings_for(args.bootstrap, f"warm{run_id}", root / "warm", args.batch)
    spark = build_session(warm_settings)
    consume(spark, warm_settings)
    append(spark, warm_settings, warm.topic, root / "warm", args.batch)

    settings = settings_for(args.bootstrap, f"bench{run_id}", root, args.batch)
    merged = consume(spark, settings)
    plain = append(spark, settings, sent.topic, root, args.batch)
    print_phases(spark, "delta merge", merged, settings.warehouse)
    print_phases(spark, "parquet append", plain, None)
    problems = verify(spark, settings, sent, root / "parquet")
    spark.stop()

    merge_rate, append_rate = sent.records / merged.wall_s, sent.records / plain.wall_s
    print(
        f"delta merge (history + current state): {sent.changes / merged.wall_s:,.0f} "
        f"changes/s, {merge_rate:,.0f} records/s ({merged.wall_s:.1f}s, "
        f"{merged.cpu_s:.1f}s JVM CPU)"
    )
    print(
        f"plain kafka -> parquet append:         {append_rate:,.0f} records/s "
        f"({plain.wall_s:.1f}s, {plain.cpu_s:.1f}s JVM CPU)"
    )
    print(f"ratio merge/append (records/s): {merge_rate / append_rate:.3f}")
    if problems:
        print("VERIFICATION FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        raise SystemExit(1)
    print(
        "verified: current state = live keys with their last values, history = one row "
        "per change, parquet = every record, no dead letters"
    )


if __name__ == "__main__":
    main()
