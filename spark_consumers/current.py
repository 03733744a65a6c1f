"""The current-state table of one source table: each key's newest change.

MERGE by key: a row is replaced or deleted only by a newer position, and a truncate
deletes every row older than it. Deleted keys and the last truncate are kept in a small
tombstone table, so a late, older insert cannot bring a row back.
"""

from __future__ import annotations

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from spark_consumers import schema as s
from spark_consumers.changes import (
    NEXT_CHANGE,
    BatchFacts,
    Held,
    Position,
    align,
    assign,
    in_key_range,
    key_match,
    newer,
    newer_than,
    of_batch_keys,
    older_than,
    position_order,
)
from spark_consumers.table_memory import TableMemory
from spark_consumers.tables import IS_TRUNCATE, TablePaths, current_struct, quote, tombstone_struct
from spark_consumers.timings import BatchTimings

# A key's newest stored delete, beside the batch's changes of the key (``newest_deletes``).
DELETED_AT = "_deleted_at"


class CurrentStateWriter:
    """Writes batches into one source table's current state and its tombstones; lives as
    long as the job, and remembers whether any tombstone is stored and the last truncate."""

    def __init__(self, spark: SparkSession, paths: TablePaths, memory: TableMemory) -> None:
        self.spark = spark
        self.paths = paths
        self._memory = memory
        self._floor: Position | None = None  # the newest truncate stored
        self._tombstones: bool | None = None  # whether a deleted key is stored; None: unread

    def has_tombstones(self) -> bool:
        """Whether the tombstones hold a deleted key: read once per job (with the last
        truncate), then kept up to date by this writer."""
        if self._tombstones is None:
            if not DeltaTable.isDeltaTable(self.spark, self.paths.tombstones):
                self._tombstones = False  # created on the first delete or truncate
                return False
            stones = DeltaTable.forPath(self.spark, self.paths.tombstones).toDF()
            row = stones.where(F.col(IS_TRUNCATE)).select(s.COMMIT_LSN, s.TOTAL_ORDER).first()
            self._floor = None if row is None else (int(row[0]), int(row[1]))
            self._tombstones = stones.where(~F.col(IS_TRUNCATE)).limit(1).count() > 0
        return self._tombstones

    def write(
        self,
        rows: DataFrame,
        unfilled: DataFrame,
        table: s.TableSchema,
        facts: BatchFacts,
        timings: BatchTimings,
        held: Held,
        after_tombstones: bool,
    ) -> None:
        """Bring the current-state table to the newest change of every key in the batch.

        ``held``: how many of the batch's keys the table holds (see ``_upsert``).
        ``unfilled``: ``rows`` before their TOAST placeholders were filled in, which is
        where the tombstones come from. Filling them in reads the current state, and once
        this writes it Spark computes every cached plan reading it again (it re-caches by
        path): the tombstones of a TOASTed table would pay the windows and the join once
        more. A delete's key and position are the same in both. ``after_tombstones``: every
        change of the batch is known to come after its key's newest tombstone."""
        self._memory.target(self.paths.current, table, current_struct(table))
        stones = (
            self._memory.target(self.paths.tombstones, table, tombstone_struct(table))
            if facts.has_deletes or facts.truncates or self._tombstones
            else None
        )
        if facts.truncates:
            current = DeltaTable.forPath(self.spark, self.paths.current)
            current.delete(older_than(max(facts.truncates)))
        floor = max([*facts.truncates, *([self._floor] if self._floor else [])], default=None)
        deleted = None
        if held is not Held.NONE and not after_tombstones:
            deleted = self._newest_deletes(unfilled, table, facts)
        keys = list(table.key_columns)
        self._upsert(_newest(rows, keys, floor, deleted), table, facts, timings, held)
        if stones is not None:
            self._remember_deletes(
                _newest(unfilled, keys, floor, deleted), stones, table, facts, timings
            )

    def _newest_deletes(
        self, unfilled: DataFrame, table: s.TableSchema, facts: BatchFacts
    ) -> DataFrame | None:
        """Per key of the batch, the position of its newest stored delete (``newest_deletes``);
        None where none can be newer than a change of the batch.

        Only batches that took the history's MERGE come here (a late change, a truncate);
        the history's write already compared every change of an appended batch with its
        key's newest delete. Read twice when the batch deletes (the MERGE's rows and the
        tombstones'), as the rare path it is.
        """
        if not self._tombstones:
            return None
        keys = [F.col(quote(k)) for k in table.key_columns]
        batch_keys = unfilled.where(F.col(s.OP) != "t").select(*keys).distinct()
        return newest_deletes(self.spark, self.paths, self._memory, table, facts, batch_keys)

    def _upsert(
        self,
        latest: DataFrame,
        table: s.TableSchema,
        facts: BatchFacts,
        timings: BatchTimings,
        held: Held,
    ) -> None:
        """Each key's newest change into the current state.

        ``held``: None (new serial keys, see ``HistoryWriter._only_new_keys``, or
        ``HistoryWriter._stored_versions`` found none: keys of concurrent transactions
        commit out of their serial order, and keys that are not serial): the MERGE would
        only insert, and an append does that in one commit without its jobs. All (updates
        and deletes of stored rows): the MERGE has no insert clause. With one, Delta joins
        the batch to the table as an outer join whose outer side is the batch, so Spark
        cannot send the small batch to every task and sorts the whole table through a
        shuffle instead; without one the join is inner and the batch can be sent, which
        it is when its size allows (``fits_a_broadcast``; 50,000 updates of a 10M-row
        table: 11 s -> 7.7 s here)."""
        target = self._memory.target(self.paths.current, table, current_struct(table))
        if self.paths.current in self._memory.unwritten or held is Held.NONE:
            # What the MERGE would insert into a table without these keys, without its join.
            live = latest.where(F.col(s.OP) != "d")
            align(live, target).write.format("delta").mode("append").save(self.paths.current)
        else:
            in_range = in_key_range(table, facts.key_range, "t.")
            source = align(latest, target, (s.OP,))
            if held is Held.ALL and fits_a_broadcast(facts):
                source = F.broadcast(source)
            merge = (
                DeltaTable.forPath(self.spark, self.paths.current)
                .alias("t")
                .merge(
                    source.alias("s"),
                    f"{key_match(table.key_columns)} AND {in_range}",
                )
                .whenMatchedDelete(condition=f"s.{quote(s.OP)} = 'd' AND {newer('s', 't')}")
                .whenMatchedUpdate(condition=newer("s", "t"), set=assign(target))
            )
            if held is not Held.ALL:
                merge = merge.whenNotMatchedInsert(
                    condition=f"s.{quote(s.OP)} <> 'd'", values=assign(target)
                )
            timings.merged(f"{table.name} current", merge.execute())
        self._memory.wrote(self.paths.current, facts)

    def _remember_deletes(
        self,
        latest: DataFrame,
        stones: StructType,
        table: s.TableSchema,
        facts: BatchFacts,
        timings: BatchTimings,
    ) -> None:
        """The batch's deleted keys and its last truncate into the tombstones."""
        if facts.has_deletes:
            with timings.phase(f"{table.name} tombstones"):
                _append_tombstones(latest, stones, self.paths.tombstones)
            self._tombstones = True
            self._memory.wrote(self.paths.tombstones, facts)
        if facts.truncates and (self._floor is None or max(facts.truncates) > self._floor):
            self._floor = max(facts.truncates)
            _store_truncate(
                self.spark, DeltaTable.forPath(self.spark, self.paths.tombstones), self._floor
            )
            self._memory.wrote(self.paths.tombstones, facts)


def newest_deletes(
    spark: SparkSession,
    paths: TablePaths,
    memory: TableMemory,
    table: s.TableSchema,
    facts: BatchFacts,
    batch_keys: DataFrame,
) -> DataFrame | None:
    """Per key of ``batch_keys`` (the batch's distinct keys) the position of its newest
    stored delete (``DELETED_AT``), for a table whose tombstones hold a deleted key; None
    when no tombstone can be newer than a change of the batch.

    Tombstones are appended, so a key deleted several times has several. A tombstone before
    the batch's oldest change is before every change of it, so when all are
    (``TableMemory.may_hold_batch``) none is read: in a stream's order there is none, and
    the tombstones are a week of deletes until housekeeping trims them. Otherwise only
    those of the batch's keys (``of_batch_keys``) within its key range are read.
    """
    if not memory.may_hold_batch(paths.tombstones, s.COMMIT_LSN, facts):
        return None
    keys = [F.col(quote(k)) for k in table.key_columns]
    stored = (
        DeltaTable.forPath(spark, paths.tombstones)
        .toDF()
        .where(~F.col(IS_TRUNCATE) & F.expr(in_key_range(table, facts.key_range)))
    )
    return (
        of_batch_keys(stored, batch_keys, facts.changes)
        .groupBy(*keys)
        .agg(F.max(F.struct(*position_order())).alias(DELETED_AT))
    )


# The most bytes of a batch's changes to one table (``BatchFacts.row_bytes``) that its
# current state's MERGE sends to every task. Four tables are written at once on two cores
# (``batch._TABLES_PER_CORE``), and each broadcast is held in the driver's memory twice
# while it is built (the rows, then their hash table): at most 256 MB of a 1 GB driver.
BROADCAST_SOURCE_BYTES = 32 * 1024 * 1024


def fits_a_broadcast(facts: BatchFacts) -> bool:
    """Whether the MERGE's source is small enough to send to every task.

    The MERGE of a batch that only updates and deletes stored keys joins the table's files
    with the batch. Spark sends a side of a join to every task only under 10 MB by its own
    estimate, so a batch of 200,000 updates of a narrow table took the other way: all 10M
    rows of the files it touched sorted through a shuffle (docs/spark-performance.md). The
    batch's real size is known (``BatchFacts.row_bytes``), except where TOAST values are
    filled in from the stored rows, which can make a row of a few bytes a row of kilobytes.
    """
    return not facts.has_toast_markers and facts.row_bytes <= BROADCAST_SOURCE_BYTES


def _newest(
    changes: DataFrame, keys: list[str], floor: Position | None, deleted: DataFrame | None
) -> DataFrame:
    """Each key's newest change in the batch, if after the truncates (``floor``) and the
    key's newest stored delete (``deleted``, from ``_newest_deletes``)."""
    latest = changes.where((F.col(s.OP) != "t") & F.col(NEXT_CHANGE).isNull())
    if floor is not None:
        latest = latest.where(newer_than(floor))
    if deleted is not None:
        after = F.col(DELETED_AT).isNull() | (F.struct(*position_order()) > F.col(DELETED_AT))
        latest = latest.join(deleted, keys, "left").where(after).drop(DELETED_AT)
    return latest


def _append_tombstones(latest: DataFrame, target: StructType, path: str) -> None:
    """Remember the keys whose newest change in the batch is a delete.

    An append, not a MERGE: a key's older tombstones and those of keys created again
    later only cost space (a change is compared with the key's newest delete), and
    housekeeping trims them. A replayed batch appends its tombstones again, harmlessly.
    """
    deletes = latest.where(F.col(s.OP) == "d").withColumn(IS_TRUNCATE, F.lit(False))
    align(deletes, target).write.format("delta").mode("append").save(path)


def _store_truncate(spark: SparkSession, stones: DeltaTable, position: Position) -> None:
    source = spark.range(1).select(
        F.lit(position[0]).alias(s.COMMIT_LSN), F.lit(position[1]).alias(s.TOTAL_ORDER)
    )
    columns: dict[str, str | Column] = {
        quote(c): f"s.{quote(c)}" for c in (s.COMMIT_LSN, s.TOTAL_ORDER)
    }
    (
        stones.alias("t")
        .merge(source.alias("s"), f"t.{IS_TRUNCATE}")
        .whenMatchedUpdate(condition=newer("s", "t"), set=columns)
        .whenNotMatchedInsert(values={**columns, IS_TRUNCATE: "true"})
        .execute()
    )
