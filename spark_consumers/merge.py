"""Applying one micro-batch of one table's typed changes to its Delta tables.

Every write is guarded by the change's position ``(commit_lsn, total_order)``, a total
order over a table's changes, so applying a batch twice (a job killed after a Delta commit
but before its checkpoint) or applying an older change after a newer one changes nothing:

- history (``history.HistoryWriter``): every change once, with SCD type 2 validity that
  does not depend on how the changes were split into batches;
- current state (``current.CurrentStateWriter``): MERGE by key, a row is replaced or
  deleted only by a newer position; deleted keys and the last truncate are kept in a
  small tombstone table so a late, older insert cannot bring a row back.

Unchanged-TOAST values are filled in first, from the key's previous change in the batch or
else from the current-state row, so history and current state both hold real values.
"""

from __future__ import annotations

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from services.common.failpoints import failpoint
from spark_consumers import schema as s
from spark_consumers.changes import BatchFacts, of_batch_keys, position_order
from spark_consumers.current import CurrentStateWriter
from spark_consumers.history import HistoryWriter
from spark_consumers.parse import can_be_toasted, toast_flag
from spark_consumers.table_memory import TableMemory
from spark_consumers.tables import TablePaths, quote
from spark_consumers.timings import BatchTimings


class TableWriter:
    """Applies batches to one source table's Delta tables; lives as long as the job, and
    so do its writers' memories of the tables (``TableMemory``)."""

    def __init__(
        self,
        spark: SparkSession,
        paths: TablePaths,
        deletion_vectors: bool = False,
        stats_extra: tuple[str, ...] = (),
    ) -> None:
        self.spark = spark
        self.paths = paths
        memory = TableMemory(spark, deletion_vectors, stats_extra)
        self._history = HistoryWriter(spark, paths, memory)
        self._current = CurrentStateWriter(spark, paths, memory)

    def apply(
        self, rows: DataFrame, table: s.TableSchema, facts: BatchFacts, timings: BatchTimings
    ) -> None:
        """Both tables for one batch: history first, so a crash in between leaves the
        current state behind, never ahead of the history (replay fixes either).

        ``rows`` are good rows from ``with_neighbours``, cached by the caller: both MERGEs
        read them.
        """
        tombstones = bool(table.key_columns) and self._current.has_tombstones()
        # Filled-in TOAST values come from windows and a join: computed once for both tables.
        toasted = (
            resolve_toast(self.spark, rows, table, self.paths, facts.changes).persist()
            if facts.has_toast_markers
            else None
        )
        try:
            changes = rows if toasted is None else toasted
            with timings.phase(f"{table.name} history"):
                written = self._history.write(changes, rows, table, facts, timings, tombstones)
                if written.merged is not None:
                    timings.merged(f"{table.name} history", written.merged)
            # Crash tests kill the job here: history committed, current state not yet.
            failpoint("consume_after_history")
            if table.key_columns:
                with timings.phase(f"{table.name} current"):
                    self._current.write(
                        changes, rows, table, facts, timings, written.held, written.after_tombstones
                    )
        finally:
            if toasted is not None:
                toasted.unpersist()


def resolve_toast(
    spark: SparkSession, rows: DataFrame, table: s.TableSchema, paths: TablePaths, changes: int
) -> DataFrame:
    """Replace unchanged-TOAST placeholders with the value the key had just before.

    Within the batch that is the latest earlier change of the key since its last insert or
    delete; otherwise the current-state row (read before this batch touches it).
    ``changes``: how many ``rows`` there are (``of_batch_keys``).
    """
    toastable = [(i, c.name) for i, c in enumerate(table.columns) if can_be_toasted(c.spark_type)]
    if not toastable or not table.key_columns:
        return rows
    keys = [F.col(quote(k)) for k in table.key_columns]
    pending = F.lit(False)
    for index, _ in toastable:
        pending = pending | F.col(toast_flag(index))
    # Keys with a placeholder before the fill-in within the batch: a superset of those
    # still pending after it, read from the cached rows without running the windows.
    marked_keys = rows.where(pending).select(*keys).distinct()
    restart = F.col(s.OP).isin("c", "r", "d", "t").cast("int")
    upto = Window.unboundedPreceding
    by_key = (
        Window.partitionBy(*keys).orderBy(*position_order()).rowsBetween(upto, Window.currentRow)
    )
    rows = rows.withColumn("_segment", F.sum(restart).over(by_key))
    segment = (
        Window.partitionBy(*keys, F.col("_segment"))
        .orderBy(*position_order())
        .rowsBetween(upto, Window.currentRow)
    )
    # One projection for all columns per step, not one per column: a wide table's plan
    # stays a few nodes deep.
    rows = rows.withColumns(
        {
            f"_prior_{index}": F.last(
                F.when(~F.col(toast_flag(index)), F.struct(F.col(quote(name)).alias("v"))),
                ignorenulls=True,
            ).over(segment)
            for index, name in toastable
        }
    )
    filled: dict[str, Column] = {}
    for index, name in toastable:
        flag, prior = F.col(toast_flag(index)), F.col(f"_prior_{index}")
        filled[name] = F.when(flag, prior["v"]).otherwise(F.col(quote(name)))
        filled[toast_flag(index)] = flag & prior.isNull()
    rows = rows.withColumns(filled).drop("_segment", *[f"_prior_{i}" for i, _ in toastable])
    if not DeltaTable.isDeltaTable(spark, paths.current):
        return rows
    stored = DeltaTable.forPath(spark, paths.current).toDF()
    stored_cols = set(stored.columns)
    carried = [(i, n) for i, n in toastable if n in stored_cols]
    stored = of_batch_keys(
        stored.select(*keys, *[F.col(quote(n)).alias(f"_stored_{i}") for i, n in carried]),
        marked_keys,
        changes,
    )
    needs = (
        rows.where(pending)
        .join(stored, list(table.key_columns), "left")
        .withColumns(
            {
                name: F.when(F.col(toast_flag(index)), F.col(f"_stored_{index}")).otherwise(
                    F.col(quote(name))
                )
                for index, name in carried
            }
        )
        .drop(*[f"_stored_{i}" for i, _ in carried])
    )
    return rows.where(~pending).unionByName(needs)
