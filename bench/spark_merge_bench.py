"""Changes applied per second into the Delta tables, per phase, next to a plain append.

    .venv/bin/python bench/spark_merge_bench.py --bootstrap HOST:PORT
        [--shapes mix,insert,update,delete,wide] [--changes 400000] [--batch 200000]
        [--seed-rows 10000000] [--repeat 1]

``--repeat N`` runs the shapes N times in turn (``mix,insert,mix,insert,...``: a shape's
runs meet the JVM in the same state) and the summary gives each shape's median of its
runs beside them, the figure the goals of #34 are stated in. A shape may also be named
more than once (``--shapes mix,mix,mix``). Every run has its own topic.

Per shape it publishes ``--changes`` synthetic changes in the bridge's format, then times,
in one Spark session and on the same Kafka records with the same records per trigger
(``--batch``): (1) the consumer (history, current state, tombstones) and (2) an append of
the raw records to Parquet. Shapes:

- ``mix``: inserts, updates and deletes (a tenth) over a key space of a tenth of the
  changes; a delete also brings its Kafka tombstone.
- ``insert``: every change inserts a new key.
- ``update``: the current-state and history tables first hold ``--seed-rows`` keys
  (written directly, as if consumed before, in files of a million rows), then every
  change updates a random one of them: few keys per file, where rewriting files hurts most.
- ``delete``: after the same seeded rows, every change deletes another random seeded key
  (a purge by a condition the key does not follow), with its Kafka tombstone.
- ``wide``: the ``mix`` over a table of 40 columns (jsonb, text[], bytea, numeric,
  timestamptz, text and bigint), whose updates leave a TOASTed text unchanged (the
  placeholder in the record, filled in by the consumer from the key's stored row).
- ``insert-seeded`` (not in the default list): inserts of new, growing keys after the same
  seeded rows, as a serial key grows: the MERGEs should not read the seeded files.
- ``keyless`` (not in the default list): inserts into a table without a key (an append-only
  log) whose history already holds the same seeded rows; it has no current-state table.
  A batch should not read the stored rows, which no change of a keyless table can end.

``--seed-tombstones N`` (seeded shapes with a key; refused with any other shape): the
tombstone table first holds N deletes spread over the seeded keys, older than their seeded
rows (keys deleted and created again), as a table in service holds a week of deletes until
housekeeping trims them. A batch in the stream's order should not read them.

Fairness:

- Warm-up. The first query of a JVM pays for class loading, JIT compilation, Spark's code
  generation and the first Kafka/Delta/Parquet setup. Both pipelines first run untimed over
  a small ``mix`` topic (``--warmup`` changes, in its own warehouse), in batches of a
  quarter of it: a table's first batch only appends, so a warm-up of one batch left the
  paths of every later one (stored versions, history ends, the current state's MERGE) to
  be loaded, generated and compiled in the timed run. ``wide`` and ``keyless`` write
  tables of other columns, whose plans are their own: each gets a warm-up over its table
  too (``wide``: the mix's changes; ``keyless``: inserts).
- Same input, same unit. Both read every record of the topic (tombstones included) under
  the same trigger cap; the ratio is of records per second.
- JVM CPU seconds are printed next to wall seconds: on a shared machine the wall time
  moves with the neighbours' load, the CPU time much less.

``--fold``: after the run, housekeeping's fold of the history ends into the history
(``fold_history_ends``), timed in wall and JVM CPU seconds; the verification then reads the
folded tables.

Per batch it prints the consumer's own phase breakdown (wall seconds and Spark jobs of
read/parse/survey, typing, history, current state and, inside it, tombstones) and the JVM
CPU seconds of the batch; after the run, Delta's operationMetrics of each MERGE commit
(files rewritten and added, rows copied), read from the tables' logs once the timed run
is over.

Afterwards the results are verified, and the script exits non-zero when they are wrong:
the current-state table holds exactly the live keys, each with its last change's values;
the history holds each change (seeded rows included) exactly once and one open version
per live key; the Parquet copy holds every record; nothing was dead-lettered. The tables,
files and checkpoints (a folder ``spark-bench-*`` in the temporary directory, up to a GB
with ``update``) are removed at the end, unless ``--keep``.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# This checkout's code, not the installed one (the venv may be shared with another tree).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery

from services.common.logs import setup_logging
from services.contract.records import TOAST_PLACEHOLDER
from slotbridge_dev.bootstrap import SPARK_SET, cache_dir, jars_dir
from slotbridge_dev.synthetic import SynthColumn, SynthTable, TransactionalWriter
from spark_consumers import schema as s
from spark_consumers.housekeeping import fold_history_ends
from spark_consumers.job import build_session, start_query
from spark_consumers.kafka import kafka_options
from spark_consumers.settings import ConsumerSettings
from spark_consumers.status import Status
from spark_consumers.tables import (
    IS_TRUNCATE,
    current_struct,
    dead_letter_path,
    ensure_table,
    history_struct,
    resolved_history,
    table_paths,
    tombstone_struct,
)
from spark_consumers.timings import BatchTimings

NUM = ((12 << 16) | 2) + 4
TABLE = "public.bench"
SHAPES = ("mix", "insert", "update", "delete", "wide", "insert-seeded", "keyless")
SEEDED = ("update", "delete", "insert-seeded", "keyless")
# The seeded shapes whose table has a key, so a tombstone table (--seed-tombstones).
TOMBSTONED = tuple(s for s in SEEDED if s != "keyless")
# Seeded rows are one transaction before every published change (those start at 1000).
SEED_LSN = 500
SEED_FILE_ROWS = 1_000_000
# The warm-up runs in this many batches, so it takes every path a later batch takes.
_WARM_UP_BATCHES = 4
# The warm-up's shape for a shape whose table has other columns than the mix's: the plans
# a batch runs are its table's (the typing of each column, the TOAST fill-in, no key). With
# the mix's warm-up alone, the JIT compiled 33-35 s in each of the two first batches of
# ``wide`` (704 and 350 new classes), 4-6 s once a ``wide`` run had gone before in the JVM.
_WARM_UP_SHAPES = {"wide": "wide", "keyless": "keyless"}
AT = "2024-05-01T10:00:00.000001Z"


# The ``wide`` shape's columns after the four of every shape: 40 in all, with JSON, an
# array, binary and a text of TOAST size that updates leave unchanged.
WIDE = (
    SynthColumn("doc", "jsonb", 3802),
    SynthColumn("tags", "text[]", 1009),
    SynthColumn("blob", "bytea", 17),
    SynthColumn("body", "text", 25),
    *(SynthColumn(f"n{i}", "bigint", 20) for i in range(12)),
    *(SynthColumn(f"t{i}", "text", 25) for i in range(12)),
    *(SynthColumn(f"d{i}", "numeric(12,2)", 1700, NUM) for i in range(4)),
    *(SynthColumn(f"ts{i}", "timestamp with time zone", 1184) for i in range(4)),
)
# PostgreSQL moves a value out of line (TOAST) from about 2 kB on.
BODY = "b" * 2100


def synth_table(prefix: str, shape: str = "mix") -> SynthTable:
    return SynthTable(
        prefix,
        "public",
        "bench",
        (
            SynthColumn("id", "bigint", 20, key=shape != "keyless"),
            SynthColumn("name", "text", 25),
            SynthColumn("amount", "numeric(12,2)", 1700, NUM),
            SynthColumn("at", "timestamp with time zone", 1184),
            *(WIDE if shape == "wide" else ()),
        ),
    )


def _wide_values(n: int, update: bool) -> dict[str, Any]:
    """The ``wide`` columns of change ``n``; an update sends the TOASTed text's placeholder,
    as the bridge does for a TOASTed value the update left unchanged."""
    return {
        "doc": {"n": n, "tags": ["a", "b"], "nested": {"x": n % 7, "ok": True}},
        "tags": [f"t{n % 5}", "x", None],
        "blob": base64.b64encode(n.to_bytes(8, "big")).decode(),
        "body": TOAST_PLACEHOLDER if update else BODY,
        **{f"n{i}": n * (i + 1) for i in range(12)},
        **{f"t{i}": f"text {i} of change {n}" for i in range(12)},
        **{f"d{i}": f"{n % 100000}.{i:02d}" for i in range(4)},
        **{f"ts{i}": AT for i in range(4)},
    }


@dataclass
class Published:
    """What the publisher sent, and the state it leaves: key -> number of its last change
    (seeded keys no change touched are not in ``live``), and the seeded keys deleted."""

    topic: str
    shape: str
    changes: int
    seeded: int = 0
    records: int = 0
    live: dict[int, int] = field(default_factory=dict)
    deleted_seeded: set[int] = field(default_factory=set)


def _ops(shape: str, changes: int, seeded: int) -> Iterator[tuple[str, int]]:
    """(op, key) of each change; ``live`` decides c/u, so only deletes are chosen here."""
    rng = random.Random(1)
    keys = max(1, changes // 10)
    seeded_keys = rng.sample(range(seeded), changes) if shape == "delete" else []
    for n in range(changes):
        if shape.startswith("insert") or shape == "keyless":
            yield "c", seeded + n
        elif shape == "update":
            yield "u", rng.randrange(seeded)
        elif shape == "delete":
            yield "d", seeded_keys[n]
        else:
            yield ("d" if rng.random() < 0.1 else "w"), rng.randrange(keys)


def publish(bootstrap: str, prefix: str, shape: str, changes: int, seeded: int) -> Published:
    table = synth_table(prefix, shape)
    writer = TransactionalWriter(bootstrap, f"{prefix}-bench")
    writer.create_topics([table.topic], compacted=[f"{prefix}.schema"])
    writer.send([table.schema_record()])
    out = Published(table.topic, shape, changes, seeded)
    batch = []
    for n, (op, key) in enumerate(_ops(shape, changes, seeded)):
        if op == "d" and (key in out.live or key < seeded):
            batch += table.change("d", {"id": key}, 1000 + n, 1, n)
            out.live.pop(key, None)
            if key < seeded:
                out.deleted_seeded.add(key)
        else:
            values = {"id": key, "name": f"name {n}", "amount": f"{n % 100000}.50", "at": AT}
            was = key in out.live or key < seeded
            if shape == "wide":
                values |= _wide_values(n, was)
            batch += table.change("u" if was else "c", values, 1000 + n, 1, n)
            out.live[key] = n
        if len(batch) >= 20_000:
            out.records += writer.send(batch)
            batch = []
    out.records += writer.send(batch)
    return out


def _seed_rows(spark: SparkSession, rows: int) -> DataFrame:
    """The seeded keys as one committed transaction at ``SEED_LSN``, history columns too."""
    ids = spark.range(rows, numPartitions=max(1, rows // SEED_FILE_ROWS))
    return ids.select(
        F.col("id"),
        F.concat(F.lit("seed "), F.col("id").cast("string")).alias("name"),
        (F.col("id") % 100000 + 0.25).cast("decimal(12,2)").alias("amount"),
        F.lit(AT).cast("timestamp").alias("at"),
        F.lit("c").alias(s.OP),
        F.lit(SEED_LSN).cast("long").alias(s.COMMIT_LSN),
        (F.col("id") + 1).alias(s.TOTAL_ORDER),
        F.lit(SEED_LSN - 8).cast("long").alias(s.LSN),
        F.lit(1).cast("long").alias(s.TX_ID),
        F.lit(AT).cast("timestamp").alias(s.COMMIT_TS),
        F.lit(1).alias(s.SCHEMA_VERSION),
        F.lit(SEED_LSN).cast("long").alias(s.VALID_FROM),
        F.lit(None).cast("long").alias(s.VALID_TO),
    )


def _seed_tombstones(spark: SparkSession, rows: int, tombstones: int) -> DataFrame:
    """Deletes of ``tombstones`` seeded keys, spread over them, before their seeded rows."""
    ids = spark.range(tombstones, numPartitions=max(1, tombstones // SEED_FILE_ROWS))
    return ids.select(
        (F.col("id") * max(1, rows // tombstones)).alias("id"),
        F.lit(SEED_LSN - 16).cast("long").alias(s.COMMIT_LSN),
        (F.col("id") + 1).alias(s.TOTAL_ORDER),
        F.lit(AT).cast("timestamp").alias(s.COMMIT_TS),
        F.lit(False).alias(IS_TRUNCATE),
    )


def seed(
    spark: SparkSession,
    settings: ConsumerSettings,
    prefix: str,
    shape: str,
    rows: int,
    tombstones: int,
) -> None:
    """The tables as the consumer would have left them after ``rows`` inserts (a keyless
    table has no current state), and ``tombstones`` deletes before them."""
    record = synth_table(prefix, shape).schema_record()[2]
    assert record is not None
    table = s.TableSchema.from_record(json.loads(record))
    paths = table_paths(settings.warehouse, TABLE)
    frame = _seed_rows(spark, rows)
    tables = [(paths.history, history_struct(table), frame)]
    if table.key_columns:
        tables.append((paths.current, current_struct(table), frame))
        if tombstones:
            stones = _seed_tombstones(spark, rows, tombstones)
            tables.append((paths.tombstones, tombstone_struct(table), stones))
    for path, struct, rows_of in tables:
        columns = ensure_table(spark, path, struct, settings.deletion_vectors).fieldNames()
        rows_of.select(*columns).write.format("delta").mode("append").save(path)


def jvm_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the driver JVM, which runs local mode's tasks, has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def jvm_pid(spark: SparkSession) -> int:
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    return int(jvm.java.lang.ProcessHandle.current().pid())


@dataclass
class BatchSeen:
    batch_id: int
    applied: int
    seconds: float
    cpu_s: float
    timings: BatchTimings


@dataclass
class Recorder(Status):
    """The consumer's status, keeping every batch's breakdown and JVM CPU seconds."""

    pid: int = 0
    seen: list[BatchSeen] = field(default_factory=list)
    cpu_mark: float = 0.0

    def record_batch(self, *args: Any, **kwargs: Any) -> None:
        super().record_batch(*args, **kwargs)
        cpu = jvm_cpu_s(self.pid)
        applied = sum(c.applied for c in self.tables.values())
        assert self.last_batch_id is not None and self.last_batch_seconds is not None
        self.seen.append(
            BatchSeen(
                self.last_batch_id,
                applied - sum(b.applied for b in self.seen),
                self.last_batch_seconds,
                cpu - self.cpu_mark,
                self.last_batch_timings,
            )
        )
        self.cpu_mark = cpu


@dataclass
class Run:
    wall_s: float
    cpu_s: float
    batches: list[BatchSeen]


def timed(spark: SparkSession, start: Callable[[Recorder], StreamingQuery]) -> Run:
    pid = jvm_pid(spark)
    recorder = Recorder(pid=pid)
    cpu, started = jvm_cpu_s(pid), time.monotonic()
    recorder.cpu_mark = cpu
    query = start(recorder)
    query.awaitTermination()
    wall, cpu = time.monotonic() - started, jvm_cpu_s(pid) - cpu
    if query.exception() is not None:
        raise SystemExit(f"query failed: {query.exception()}")
    return Run(wall, cpu, recorder.seen)


def consume(spark: SparkSession, settings: ConsumerSettings) -> Run:
    return timed(spark, lambda status: start_query(spark, settings, status, once=True))


def append(
    spark: SparkSession, settings: ConsumerSettings, topic: str, root: Path, batch: int
) -> Run:
    return timed(
        spark,
        lambda _: (
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


def settings_for(args: argparse.Namespace, prefix: str, root: Path, batch: int) -> ConsumerSettings:
    return ConsumerSettings(
        deletion_vectors=args.deletion_vectors,
        spark_conf=dict(c.split("=", 1) for c in args.conf),
        kafka_bootstrap=args.bootstrap,
        topic_prefix=prefix,
        warehouse=str(root / "wh"),
        checkpoint_dir=str(root / "ck"),
        spark_master="local[2]",
        jars_dir=jars_dir(cache_dir(), SPARK_SET),
        max_offsets_per_trigger=batch,
        log_format="text",
        http_port=0,
    )


def verify(
    spark: SparkSession, settings: ConsumerSettings, sent: Published, parquet: Path
) -> list[str]:
    """Everything that is wrong with the tables the two runs left (empty when right)."""
    problems = []
    paths = table_paths(settings.warehouse, TABLE)
    changed = spark.createDataFrame(
        [(k, f"name {n}") for k, n in sent.live.items()], "id bigint, name string"
    )
    gone = spark.createDataFrame([(k,) for k in sent.deleted_seeded], "id bigint")
    seeded = _seed_rows(spark, sent.seeded).select("id", "name").join(gone, "id", "left_anti")
    expected = seeded.join(changed, "id", "left_anti").unionByName(changed)
    live = expected.count()
    if sent.shape != "keyless":
        problems += _current_state_problems(spark, paths.current, expected, live)
    if sent.shape == "wide":
        current = spark.read.format("delta").load(paths.current)
        unfilled = current.where(F.col("body").isNull() | (F.col("body") != BODY)).count()
        if unfilled:
            problems.append(f"current state: {unfilled} rows without their unchanged TOAST text")
    history = resolved_history(spark, paths)
    counts = history.agg(
        F.count("*").alias("rows"),
        F.count_distinct(s.COMMIT_LSN, s.TOTAL_ORDER, s.OP).alias("distinct"),
        F.sum(F.col(s.VALID_TO).isNull().cast("int")).alias("open"),
    ).first()
    assert counts is not None
    stored = sent.changes + sent.seeded
    if counts["rows"] != stored or counts["distinct"] != stored:
        problems.append(
            f"history: {counts['rows']} rows, {counts['distinct']} distinct changes; "
            f"{stored} changes were published or seeded"
        )
    if counts["open"] != live:
        problems.append(f"history: {counts['open']} open versions, {live} live keys")
    dead = dead_letter_path(settings.warehouse)
    if DeltaTable.isDeltaTable(spark, dead):
        problems.append(f"{spark.read.format('delta').load(dead).count()} dead letters")
    copied = spark.read.parquet(str(parquet)).count()
    if copied != sent.records:
        problems.append(f"parquet: {copied} rows, {sent.records} records were published")
    return problems


def _current_state_problems(
    spark: SparkSession, path: str, expected: DataFrame, live: int
) -> list[str]:
    """What is wrong with the current-state table: the ``live`` keys of ``expected``, each
    with its last change's name."""
    problems = []
    current = spark.read.format("delta").load(path)
    rows = current.count()
    if rows != live:
        problems.append(f"current state: {rows} rows, {live} live keys")
    wrong = (
        current.select("id", "name")
        .join(expected.withColumnRenamed("name", "want"), "id", "full_outer")
        .where(~F.col("name").eqNullSafe(F.col("want")))
        .count()
    )
    if wrong:
        problems.append(f"current state: {wrong} rows differ from the last change")
    return problems


def fold(spark: SparkSession, settings: ConsumerSettings) -> str:
    """Housekeeping's fold of the ends the run left into the history, timed (after the
    run, so the verification then reads the folded history)."""
    pid = jvm_pid(spark)
    cpu, started = jvm_cpu_s(pid), time.monotonic()
    ends = fold_history_ends(spark, table_paths(settings.warehouse, TABLE))
    wall, cpu = time.monotonic() - started, jvm_cpu_s(pid) - cpu
    return f"history ends fold: {ends} ends, {wall:.1f} s wall, {cpu:.1f} s JVM CPU"


def _merge_line(name: str, m: dict[str, int]) -> str:
    def sec(metric: str) -> str:
        return f"{m.get(metric, 0) / 1000:.1f}"

    return (
        f"    {name} MERGE {sec('executionTimeMs')} s (source {sec('materializeSourceTimeMs')}, "
        f"scan {sec('scanTimeMs')}, rewrite {sec('rewriteTimeMs')}): files rewritten "
        f"{m.get('numTargetFilesRemoved', 0)}, added {m.get('numTargetFilesAdded', 0)}, rows "
        f"copied {m.get('numTargetRowsCopied', 0)}, inserted "
        f"{m.get('numTargetRowsInserted', 0)}, updated {m.get('numTargetRowsUpdated', 0)}, "
        f"deletion vectors {m.get('numTargetDeletionVectorsAdded', 0)}"
    )


def print_batches(label: str, run: Run, table_prefix: str = TABLE + " ") -> None:
    """Each batch's changes, times and phases; ``table_prefix`` is left out of the phases'
    names."""
    print(f"{label}: {run.wall_s:.1f} s wall, {run.cpu_s:.1f} s JVM CPU")
    for b in run.batches:
        phases = " | ".join(
            f"{name.removeprefix(table_prefix)} {sec:.1f} ({b.timings.jobs.get(name, 0)} jobs)"
            for name, sec in b.timings.phases.items()
        )
        print(
            f"  batch {b.batch_id}: {b.applied:>7} changes, {b.seconds:5.1f} s wall, "
            f"{b.cpu_s:5.1f} s JVM CPU (loaded {b.timings.jvm.get('classes_loaded', '-')} "
            f"classes, JIT {b.timings.jvm.get('jit_ms', '-')} ms); {phases}"
        )


def print_merges(spark: SparkSession, settings: ConsumerSettings) -> None:
    """Delta's metrics of every MERGE commit of both tables, oldest first."""
    paths = table_paths(settings.warehouse, TABLE)
    for kind, path in (
        ("history", paths.history),
        ("history ends", paths.history_ends),
        ("current", paths.current),
    ):
        if not DeltaTable.isDeltaTable(spark, path):
            continue
        commits = (
            DeltaTable.forPath(spark, path)
            .history()
            .where(F.col("operation") == "MERGE")
            .orderBy("version")
            .collect()
        )
        for commit in commits:
            metrics = {k: int(v) for k, v in (commit["operationMetrics"] or {}).items()}
            print(_merge_line(f"{kind} v{commit['version']}", metrics))


@dataclass
class Figures:
    shape: str
    changes_s: float
    ratio: float


def run_shape(
    spark: SparkSession, args: argparse.Namespace, shape: str, root: Path, run_id: str
) -> tuple[Figures, list[str]]:
    prefix = f"{shape}{run_id}"
    seeded = args.seed_rows if shape in SEEDED else 0
    started = time.monotonic()
    sent = publish(args.bootstrap, prefix, shape, args.changes, seeded)
    print(
        f"\n== {shape}: published {sent.changes} changes ({sent.records} records) in "
        f"{time.monotonic() - started:.1f} s"
    )
    folder = root / prefix
    settings = settings_for(args, prefix, folder, args.batch)
    if seeded:
        started = time.monotonic()
        seed(spark, settings, prefix, shape, seeded, args.seed_tombstones)
        print(
            f"seeded {seeded} rows and {args.seed_tombstones} tombstones into its tables in "
            f"{time.monotonic() - started:.1f} s"
        )
    merged = consume(spark, settings)
    plain = append(spark, settings, sent.topic, folder, args.batch)
    print_batches("consumer", merged)
    if args.fold:
        print(fold(spark, settings))
    print_merges(spark, settings)
    print(f"parquet append: {plain.wall_s:.1f} s wall, {plain.cpu_s:.1f} s JVM CPU")
    problems = verify(spark, settings, sent, folder / "parquet")
    merge_rate, append_rate = sent.records / merged.wall_s, sent.records / plain.wall_s
    figures = Figures(shape, sent.changes / merged.wall_s, merge_rate / append_rate)
    print(
        f"{shape}: consumer {figures.changes_s:,.0f} changes/s, {merge_rate:,.0f} records/s "
        f"({merged.wall_s:.1f} s, {merged.cpu_s:.1f} s JVM CPU); parquet append "
        f"{append_rate:,.0f} records/s ({plain.wall_s:.1f} s, {plain.cpu_s:.1f} s JVM CPU); "
        f"ratio {figures.ratio:.3f}"
    )
    return figures, [f"{shape}: {p}" for p in problems]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES[:5]), help="comma-separated")
    parser.add_argument("--changes", type=int, default=400_000)
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs of the shapes, in turn; medians printed"
    )
    parser.add_argument("--batch", type=int, default=200_000, help="max records per batch")
    parser.add_argument("--seed-rows", type=int, default=10_000_000, help="update shape")
    parser.add_argument(
        "--seed-tombstones", type=int, default=0, help="seeded shapes: deletes before the rows"
    )
    parser.add_argument("--warmup", type=int, default=20_000, help="changes of the warm-up")
    parser.add_argument(
        "--deletion-vectors", action="store_true", help="the consumer's deletion_vectors"
    )
    parser.add_argument(
        "--fold",
        action="store_true",
        help="after the run, time housekeeping's fold of the history ends (its MERGE is "
        "listed with the history's)",
    )
    parser.add_argument(
        "--conf", action="append", default=[], help="KEY=VALUE: a Spark setting to try"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the tables and files (their folder is printed)"
    )
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat takes 1 or more")
    shapes = args.shapes.split(",") * args.repeat
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; known: {', '.join(SHAPES)}")
    # A shape without seeded rows, or without a key, has no tombstone table to seed: the
    # option would be ignored there, and its figures read as if it were not.
    unstoned = sorted(set(shapes) - set(TOMBSTONED))
    if args.seed_tombstones and unstoned:
        parser.error(
            f"--seed-tombstones applies to seeded shapes with a key ({', '.join(TOMBSTONED)}), "
            f"not to {', '.join(unstoned)}: run those shapes without it"
        )
    setup_logging("text", "WARNING")
    root = Path(tempfile.mkdtemp(prefix="spark-bench-"))
    try:
        problems = run(args, shapes, root)
    finally:
        if args.keep:
            print(f"kept: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    report_verification(
        problems,
        "current state = live keys with their last values (a keyless table has none), "
        "history = one row per change, parquet = every record, no dead letters",
    )


def report_verification(problems: list[str], held: str) -> None:
    """What the verification found wrong, and exit non-zero; else what it found to hold."""
    if problems:
        print("VERIFICATION FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        raise SystemExit(1)
    print(f"verified: {held}")


def warm_up(args: argparse.Namespace, shapes: list[str], root: Path, run_id: str) -> SparkSession:
    """The session, after both pipelines ran untimed over a small topic of each table the
    shapes write (``_WARM_UP_SHAPES``)."""
    spark = None
    warm_batch = max(1, args.warmup // _WARM_UP_BATCHES)
    for shape in sorted({_WARM_UP_SHAPES.get(shape, "mix") for shape in shapes}):
        prefix = f"warm{shape}{run_id}"
        warm = publish(args.bootstrap, prefix, shape, args.warmup, 0)
        settings = settings_for(args, prefix, root / prefix, warm_batch)
        if spark is None:
            spark = build_session(settings)
        consume(spark, settings)
        append(spark, settings, warm.topic, root / prefix, warm_batch)
    assert spark is not None  # shapes is never empty
    return spark


def run(args: argparse.Namespace, shapes: list[str], root: Path) -> list[str]:
    """Every shape of ``shapes``, its tables under ``root``; prints the figures and
    returns what the verification found wrong."""
    run_id = uuid.uuid4().hex[:6]
    spark = warm_up(args, shapes, root, run_id)
    results, problems = [], []
    # A shape named again (``mix,mix,mix`` for a median) runs on its own topic and folder.
    for index, shape in enumerate(shapes):
        figures, wrong = run_shape(spark, args, shape, root, f"{index}{run_id}")
        results.append(figures)
        problems += wrong
    spark.stop()
    print("\nshape    changes/s  ratio to plain append")
    for f in results:
        print(f"{f.shape:<8} {f.changes_s:>9,.0f}  {f.ratio:.3f}")
    print_medians(results)
    return problems


def print_medians(results: list[Figures]) -> None:
    """Each shape's median changes/s and ratio, for the shapes that ran more than once."""
    runs: dict[str, list[Figures]] = {}
    for f in results:
        runs.setdefault(f.shape, []).append(f)
    repeated = {shape: of for shape, of in runs.items() if len(of) > 1}
    if not repeated:
        return
    print("\nshape    runs  median changes/s  median ratio")
    for shape, of in repeated.items():
        rate = statistics.median(f.changes_s for f in of)
        ratio = statistics.median(f.ratio for f in of)
        print(f"{shape:<8} {len(of):>4}  {rate:>16,.0f}  {ratio:.3f}")


if __name__ == "__main__":
    main()
