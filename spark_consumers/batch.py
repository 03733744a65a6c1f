"""The foreachBatch function: one micro-batch of raw change records to every table.

Per batch the driver runs one small aggregation to learn which tables, schema versions,
truncates and deletes the batch holds, refreshes the schema registry if a version is new
or snapshot rows are in the batch (a resync's gap record, see gaps.py),
and then, table by table, counts bad rows (and TOAST markers among the good ones),
quarantines the bad rows and merges the good ones. Tables are applied side by side (twice
as many at once as Spark has cores, ``_TABLES_PER_CORE``): each is a chain of small Spark
jobs whose fixed costs (planning, scheduling, Delta's log) would otherwise leave cores idle
between them.
Every write is idempotent (see merge.py), so Spark replaying a batch after a crash is safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from pyspark import inheritable_thread_target
from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import IntegralType

from services.common.errors import SlotbridgeError
from services.common.logs import log_event
from spark_consumers import schema as s
from spark_consumers.changes import BatchFacts, Position, is_repeated, with_neighbours
from spark_consumers.deadletter import STOPPED, quarantine, stopped_tables
from spark_consumers.errors import error_line
from spark_consumers.gaps import record_gaps
from spark_consumers.housekeeping import Housekeeper
from spark_consumers.kafka import refresh_registry
from spark_consumers.merge import TableWriter
from spark_consumers.parse import (
    COORDINATES,
    REASON,
    TABLE,
    RowTyping,
    envelopes,
    kafka_texts,
)
from spark_consumers.settings import ConsumerSettings
from spark_consumers.status import Status, TableCounts
from spark_consumers.tables import dead_letter_path, gaps_path, quote, table_paths
from spark_consumers.timings import BatchTimings

log = logging.getLogger("slotbridge.consume")

# Tables applied at once per core Spark has. A table's part of a batch is a chain of small
# Spark jobs, and each job has a part on the driver (planning, Delta's log, the calls from
# Python) during which that table has no task running. With one table per core the cores
# idled through those parts; with two, another table's tasks fill them: on local[2] at
# 2,000 changes/s of the pgbench mix the freshness p99 went from 38-40 s to 26-31 s, for
# about a tenth more JVM CPU a change as batches got smaller (bench/spark_freshness_bench.py;
# docs/spark-performance.md).
_TABLES_PER_CORE = 2


@dataclass
class _Survey:
    """The driver's view of one table's part of a batch."""

    versions: set[int] = field(default_factory=set)
    truncates: list[Position] = field(default_factory=list)
    deletes: bool = False
    oldest_lsn: int | None = None
    newest_lsn: int | None = None
    snapshot_rows: bool = False


class BatchProcessor:
    """Callable handed to ``foreachBatch``; holds the schema registry across batches."""

    def __init__(
        self,
        spark: SparkSession,
        settings: ConsumerSettings,
        status: Status,
        registry: s.SchemaRegistry | None = None,
    ) -> None:
        self.spark = spark
        self.settings = settings
        self.status = status
        self.registry = registry if registry is not None else s.SchemaRegistry()
        self.writers: dict[str, TableWriter] = {}
        self.housekeeper = Housekeeper(
            settings.housekeeping_interval_s,
            settings.vacuum_retention_hours,
            settings.tombstone_retention_hours,
        )
        # Tables stopped by an error of their own -> why; read from the dead-letter
        # table at the first batch, so a stopped table stays stopped across restarts.
        self.stopped: dict[str, str] | None = None
        # The gaps already in the ``_gaps`` table.
        self.gaps_stored: set[tuple[str, int]] = set()
        # Tables share one dead-letter table, and two MERGEs into it at once would conflict.
        self._dead_letter_lock = threading.Lock()
        # Per table, its typing expressions for its current schema (see RowTyping).
        self._typings: dict[str, RowTyping] = {}

    def __call__(self, raw: DataFrame, batch_id: int) -> None:
        started = time.monotonic()
        timings = BatchTimings(context=self.spark.sparkContext)
        envs = envelopes(raw, self.settings.topic_prefix).persist()
        try:
            counts = self._process(raw, envs, batch_id, timings)
        finally:
            envs.unpersist()
        timings.finish()
        self.status.record_batch(batch_id, counts, time.monotonic() - started, timings)
        if self.housekeeper.due(time.monotonic()):
            tables = {t: table_paths(self.settings.warehouse, t) for t in self.registry.versions}
            self.status.housekeeping = self.housekeeper.run(
                self.spark, self.settings.warehouse, tables
            )
        self.status.write(self.settings.status_path)

    def _process(
        self, raw: DataFrame, envs: DataFrame, batch_id: int, timings: BatchTimings
    ) -> dict[str, TableCounts]:
        # The survey is the first action on the batch: it reads and parses the records.
        with timings.phase("read, parse, survey"):
            surveys = self._survey(envs)
        missing = [
            t for t, sv in surveys.items() if any(not self.registry.has(t, v) for v in sv.versions)
        ]
        # A resync records its gap on the schema topic before it publishes the tables
        # again through a snapshot, so a batch holding snapshot rows looks there too (one
        # small read of a compacted topic, and only while a snapshot is under way).
        if missing or any(sv.snapshot_rows for sv in surveys.values()):
            for problem in refresh_registry(self.spark, self.settings, self.registry):
                log_event(log, logging.WARNING, problem)
            self._record_gaps()
        if self.stopped is None:
            self.stopped = stopped_tables(self.spark, dead_letter_path(self.settings.warehouse))
        stopped = self.stopped

        def one_table(table: str) -> TableCounts:
            table_envs = envs.where(F.col(TABLE) == table)
            why = stopped.get(table)
            if why is None:
                try:
                    return self._apply_table(
                        raw, table_envs, table, surveys[table], batch_id, timings
                    )
                except (AnalysisException, TableRefused) as exc:
                    # Raised by this table's shape or data, so a retry would raise it again:
                    # stop this table alone. Anything else (Kafka, disk, memory) fails the
                    # job, and the batch is replayed on restart.
                    why = stopped[table] = error_line(exc)
                    log_event(
                        log,
                        logging.ERROR,
                        "table stopped; its records go to the dead-letter table from now on",
                        table=table,
                        reason=why,
                        batch_id=batch_id,
                    )
            return self._set_aside(raw, table_envs, table, why, batch_id)

        tables = sorted(surveys)
        cores = self.spark.sparkContext.defaultParallelism
        workers = max(1, min(len(tables), _TABLES_PER_CORE * cores))
        # Every table's writes finish (or fail) before the batch ends; a failure then
        # fails the batch, which is replayed on restart. Worker threads inherit the
        # query's job group and tags, so stopping the query cancels their jobs too.
        target = inheritable_thread_target(self.spark)(one_table)
        with ThreadPoolExecutor(workers, thread_name_prefix="slotbridge-table") as pool:
            futures = {table: pool.submit(target, table) for table in tables}
        return {table: future.result() for table, future in futures.items()}

    def _quarantine(self, bad: DataFrame, raw: DataFrame, batch_id: int) -> None:
        with self._dead_letter_lock:
            quarantine(
                self.spark,
                dead_letter_path(self.settings.warehouse),
                _with_texts(bad, raw),
                batch_id,
            )

    def _record_gaps(self) -> None:
        """Every gap of the registry in the ``_gaps`` table (see gaps.py) and the status."""
        new = {k: g for k, g in self.registry.gaps.items() if k not in self.gaps_stored}
        if new:
            record_gaps(self.spark, gaps_path(self.settings.warehouse), new.values())
            self.gaps_stored |= new.keys()
            self.status.gaps = [g.model_dump() for g in self.registry.gaps.values()]

    def _set_aside(
        self, raw: DataFrame, envs: DataFrame, table: str, why: str, batch_id: int
    ) -> TableCounts:
        """A stopped table's records of this batch, dead-lettered with the reason. Applying
        later changes over the ones set aside would build a wrong table."""
        bad = envs.select(*COORDINATES, F.col(TABLE), F.lit(STOPPED + why).alias(REASON))
        self._quarantine(bad, raw, batch_id)
        count = bad.count()
        log_event(
            log,
            logging.WARNING,
            "records of a stopped table quarantined",
            table=table,
            count=count,
            batch_id=batch_id,
            reason=why,
        )
        return TableCounts(quarantined=count, stopped=why)

    def _survey(self, envs: DataFrame) -> dict[str, _Survey]:
        op = F.col("e.op")
        rows = (
            envs.groupBy(TABLE, F.col("e.source.schema_version").alias("v"))
            .agg(
                F.collect_list(
                    F.when(
                        op == "t",
                        F.struct(F.col("e.source.commit_lsn"), F.col("e.transaction.total_order")),
                    )
                ).alias("truncates"),
                F.max((op == "d").cast("int")).alias("deletes"),
                F.min("e.source.commit_lsn").alias("oldest"),
                F.max("e.source.commit_lsn").alias("newest"),
                F.max((op == "r").cast("int")).alias("snapshot_rows"),
            )
            .collect()
        )
        surveys: dict[str, _Survey] = defaultdict(_Survey)
        for row in rows:
            survey = surveys[row[TABLE]]
            if row["v"] is not None:
                survey.versions.add(int(row["v"]))
            survey.truncates.extend(
                (int(t[0]), int(t[1]))
                for t in row["truncates"]
                if t[0] is not None and t[1] is not None
            )
            survey.deletes = survey.deletes or bool(row["deletes"])
            survey.snapshot_rows = survey.snapshot_rows or bool(row["snapshot_rows"])
            oldest = row["oldest"]
            if oldest is not None and (survey.oldest_lsn is None or oldest < survey.oldest_lsn):
                survey.oldest_lsn = int(oldest)
            newest = row["newest"]
            if newest is not None and (survey.newest_lsn is None or newest > survey.newest_lsn):
                survey.newest_lsn = int(newest)
        return dict(surveys)

    def _apply_table(
        self,
        raw: DataFrame,
        envs: DataFrame,
        table: str,
        survey: _Survey,
        batch_id: int,
        timings: BatchTimings,
    ) -> TableCounts:
        known = sorted(self.registry.versions.get(table, {}))
        if not known:
            bad = envs.select(
                *COORDINATES, F.col(TABLE), F.lit("no schema record for this table").alias(REASON)
            )
            self._quarantine(bad, raw, batch_id)
            return TableCounts(quarantined=bad.count())
        schema = self.registry.merged(table)
        collisions = schema.case_collisions()
        if collisions:
            raise TableRefused(
                f"columns {' and '.join(collisions[0])} differ only in case; "
                "a Delta table cannot hold both (rename one at the source)"
            )
        typing = self._typings.get(table)
        if typing is None or typing.table != schema or typing.known_versions != tuple(known):
            typing = self._typings[table] = RowTyping(schema, tuple(known))
        typed = (
            with_neighbours(typing.apply(envs), schema).withColumn(TABLE, F.lit(table)).persist()
        )
        try:
            with timings.phase(f"{table} type"):
                split = {
                    bool(r["good"]): r
                    for r in typed.groupBy(F.col(REASON).isNull().alias("good"))
                    .agg(
                        F.count("*").alias("n"),
                        F.max(typing.any_toast).alias("toast"),
                        F.sum(typing.row_bytes).alias("bytes"),
                        F.max(is_repeated()).alias("repeats"),
                        *_key_bounds(schema),
                    )
                    .collect()
                }
            good_n = int(split[True]["n"]) if True in split else 0
            bad_n = int(split[False]["n"]) if False in split else 0
            if bad_n:
                bad = typed.where(F.col(REASON).isNotNull()).select(*COORDINATES, TABLE, REASON)
                self._quarantine(bad, raw, batch_id)
                log_event(
                    log,
                    logging.WARNING,
                    "records quarantined",
                    table=table,
                    count=bad_n,
                    batch_id=batch_id,
                )
            if good_n:
                self._merge(
                    typed.where(F.col(REASON).isNull()),
                    schema,
                    survey,
                    bool(split[True]["toast"]),
                    bool(split[True]["repeats"]),
                    _key_range(split[True]),
                    good_n,
                    int(split[True]["bytes"]),
                    timings,
                )
        finally:
            typed.unpersist()
        return TableCounts(applied=good_n, quarantined=bad_n)

    def _merge(
        self,
        good: DataFrame,
        schema: s.TableSchema,
        survey: _Survey,
        has_toast: bool,
        repeats: bool,
        key_range: tuple[int, int] | None,
        changes: int,
        row_bytes: int,
        timings: BatchTimings,
    ) -> None:
        writer = self.writers.get(schema.name)
        if writer is None:
            paths = table_paths(self.settings.warehouse, schema.name)
            writer = self.writers[schema.name] = TableWriter(
                self.spark,
                paths,
                self.settings.deletion_vectors,
                tuple(self.settings.stats_columns.get(schema.name, ())),
            )
        # Good rows all have a commit LSN, so the survey found one.
        assert survey.oldest_lsn is not None and survey.newest_lsn is not None
        writer.apply(
            good,
            schema,
            BatchFacts(
                truncates=tuple(sorted(survey.truncates)),
                has_deletes=survey.deletes,
                has_toast_markers=has_toast,
                oldest_lsn=survey.oldest_lsn,
                newest_lsn=survey.newest_lsn,
                key_range=key_range,
                changes=changes,
                row_bytes=row_bytes,
                repeats=repeats,
            ),
            timings,
        )


class TableRefused(SlotbridgeError):
    """A table the consumer cannot store as it is; the text says why, in one line."""

    retryable = False  # the table stays stopped until the operator acts


def _key_bounds(schema: s.TableSchema) -> list[Column]:
    """The smallest and largest key, for a key of one integer column (else nothing)."""
    keys = [c for c in schema.columns if c.name in schema.key_columns]
    if len(keys) != 1 or not isinstance(keys[0].spark_type, IntegralType):
        return []
    key = F.col(quote(keys[0].name))
    return [F.min(key).alias("key_low"), F.max(key).alias("key_high")]


def _key_range(good: Row) -> tuple[int, int] | None:
    """The batch's key range from the good rows' aggregate (None without bounds)."""
    bounds = good.asDict()
    if bounds.get("key_low") is None:
        return None
    return int(bounds["key_low"]), int(bounds["key_high"])


def _with_texts(bad: DataFrame, raw: DataFrame) -> DataFrame:
    """Dead letters with their key and value text, read again from the batch's records:
    the texts are too big to carry through parsing and the per-key shuffle for the rare
    bad record."""
    return bad.join(kafka_texts(raw), list(COORDINATES))
