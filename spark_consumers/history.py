"""The history table of one source table: every change once, with SCD type 2 validity.

Every change is inserted once (only if ``(commit_lsn, total_order, op)`` is not there
yet), and a change is valid from its commit LSN to the commit LSN of the first thing after
it that ends it: the key's next change or the next truncate. That does not depend on how
the changes were split into batches. In the common case a batch's rows are appended
without rewriting a stored file and the ends of the stored versions it closes go to the
small ``_history_ends`` table (``HistoryWriter._append_history``); otherwise one MERGE
moves the ends in the history itself (``HistoryWriter._merge_history``).
"""

from __future__ import annotations

from dataclasses import dataclass

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from spark_consumers import schema as s
from spark_consumers.changes import (
    NEXT_CHANGE,
    POINT,
    BatchFacts,
    Held,
    Position,
    align,
    assign,
    in_key_range,
    key_match,
    of_batch_keys,
    older_than,
    position_order,
)
from spark_consumers.current import DELETED_AT, newest_deletes
from spark_consumers.table_memory import TableMemory
from spark_consumers.tables import (
    TablePaths,
    current_struct,
    history_ends_struct,
    history_struct,
    quote,
)
from spark_consumers.timings import BatchTimings

_STORED = "_stored"
_OLD_END = "_stored_valid_to"
_FIRST = "_first_change"
_LIVE_AT = "_current_position"


@dataclass(frozen=True)
class HistoryWrite:
    """What a batch's history write found that the current-state write goes by."""

    # The MERGE into the history, when the write took one (its metrics); None: appends.
    merged: DataFrame | None
    # How many of the batch's keys have a current-state row (SOME when it did not look).
    held: Held
    # Whether every change of the batch was found to come after its key's newest
    # tombstone: the current-state write then need not read the tombstones.
    after_tombstones: bool


class HistoryWriter:
    """Writes batches into one source table's history; lives as long as the job, and
    remembers the truncates the history holds, its largest key and whether the last batch
    ended stored versions."""

    def __init__(self, spark: SparkSession, paths: TablePaths, memory: TableMemory) -> None:
        self.spark = spark
        self.paths = paths
        self._memory = memory
        self._truncates: set[Position] | None = None
        # (key column, largest key the history holds, None when it holds none), for a key
        # of one integer column; None until read.
        self._key_ceiling: tuple[str, int | None] | None = None
        # Whether the last batch's write ended stored versions (in the history or in its
        # ends table): the next one most likely does too.
        self._ended_stored = False

    def write(
        self,
        rows: DataFrame,
        unfilled: DataFrame,
        table: s.TableSchema,
        facts: BatchFacts,
        timings: BatchTimings,
        tombstones: bool,
    ) -> HistoryWrite:
        """Insert each change once and keep SCD type 2 validity right.

        ``unfilled``: ``rows`` before their TOAST placeholders were filled in. The look
        for stored versions reads only keys and positions, which the fill-in leaves as
        they are, so it reads them there and does not start the fill-in (its windows and
        its read of the current state), which the history's write then runs once.
        ``tombstones``: whether the table's tombstones hold a deleted key.

        A batch appends (``_append_history``, or ``_add_changes`` for a table without a
        key) unless a truncate can end a version it writes (a truncate in the batch, or a
        stored one at or after its oldest change: a truncate ends every key's version, also
        of keys the batch does not hold, and it reaches the job in any order with the
        changes around it) or ``_stored_versions`` finds a late change. Those take
        ``_merge_history``. A table without a key has no identity to end a version by, so
        only a truncate ends its rows: all of them stay open, and a MERGE matching the
        open ones read its whole history every batch.
        """
        target = self._memory.target(self.paths.history, table, history_struct(table))
        new_keys = self._only_new_keys(table, facts)
        truncates = self._history_truncates() | set(facts.truncates)
        # A truncate before the batch's oldest change ends nothing this batch recomputes:
        # a reachable stored version that old would already be closed at it.
        later = tuple(sorted(t for t in truncates if t[0] >= facts.oldest_lsn))
        fresh = self.paths.history in self._memory.unwritten or new_keys
        stored = None
        if table.key_columns and not later and not fresh:
            with timings.phase(f"{table.name} stored versions"):
                stored = self._stored_versions(unfilled, table, facts, tombstones)
        if stored is None and not table.key_columns and not later:
            self._ended_stored = False
            merged = self._add_changes(rows, table, facts, target)
        elif stored is None:
            merged = self._merge_history(rows, table, facts, target, new_keys, later)
        else:
            try:
                merged = self._append_history(rows, stored, table, facts, target, timings)
            finally:
                stored.checked.unpersist()
        self._truncates = truncates
        self._memory.wrote(self.paths.history, facts)
        if facts.key_range is not None and self._key_ceiling is not None:
            name, ceiling = self._key_ceiling
            high = facts.key_range[1]
            self._key_ceiling = name, high if ceiling is None else max(ceiling, high)
        # New keys have no current-state row; without a look, some of the keys may have.
        held = Held.NONE if new_keys else Held.SOME if stored is None else stored.held()
        return HistoryWrite(merged, held, stored is not None)

    def _only_new_keys(self, table: s.TableSchema, facts: BatchFacts) -> bool:
        """Every key of the batch is larger than every key the history holds (a serial
        key's new rows) and the batch truncates nothing.

        Then no stored version can end or be replayed, and neither the current state nor
        the tombstones (both only hold keys the history has) hold a row of these keys:
        both writes are appends, without a look at the stored rows. The largest stored
        key is read once (a Spark job), then kept up to date in memory.
        """
        if facts.key_range is None or facts.truncates:
            return False
        key = table.key_columns[0]
        if self._key_ceiling is None or self._key_ceiling[0] != key:
            stored = None
            if self.paths.history not in self._memory.unwritten:
                row = self.history.toDF().agg(F.max(F.col(quote(key)))).first()
                stored = None if row is None or row[0] is None else int(row[0])
            self._key_ceiling = key, stored
        ceiling = self._key_ceiling[1]
        return ceiling is None or facts.key_range[0] > ceiling

    def _stored_versions(
        self, rows: DataFrame, table: s.TableSchema, facts: BatchFacts, tombstones: bool
    ) -> _StoredVersions | None:
        """Per key of the batch, the stored open version its first change in the batch
        ends (persisted, with how many there are); None when a key's newest stored change
        is at or after its first change in the batch.

        A stored open version of a key is exactly the key's current-state row, read here
        before this batch writes the current state; a deleted key has none (its delete
        ended its last version) and its newest tombstone says when. A stored change at or
        after the batch's first change of the key is a late record (the key's partition
        reordered, offsets reset) or a replay after the current state was written: the
        batch could end a version that an older stored version's recorded end skips, so
        the MERGE path recomputes the ends. One Spark job, reading the current state (and
        the tombstones, when one may be at or after the batch's oldest change) within the
        batch's key range.
        """
        keys = list(table.key_columns)
        by_key = [F.col(quote(k)) for k in keys]
        position = F.struct(*position_order())
        firsts = rows.where(F.col(s.OP) != "t").groupBy(*by_key).agg(F.min(position).alias(_FIRST))
        batch_keys = firsts.select(*by_key)
        self._memory.target(self.paths.current, table, current_struct(table))
        checked = firsts
        late = F.lit(False)
        if self.paths.current not in self._memory.unwritten:
            live = of_batch_keys(
                DeltaTable.forPath(self.spark, self.paths.current)
                .toDF()
                .where(in_key_range(table, facts.key_range))
                .select(*by_key, position.alias(_LIVE_AT)),
                batch_keys,
                facts.changes,
            )
            # Left are at most the batch's keys. A sort-merge join, not a broadcast: without
            # adaptive execution each broadcast is a Spark job of its own.
            checked = checked.join(live.hint("merge"), keys, "left")
            late = late | F.coalesce(F.col(_LIVE_AT) >= F.col(_FIRST), F.lit(False))
        else:
            checked = checked.withColumn(_LIVE_AT, F.lit(None).cast(POINT))
        # Only a stored tombstone at or after the batch's oldest change can make one of its
        # changes late (``newest_deletes``).
        deleted = (
            newest_deletes(self.spark, self.paths, self._memory, table, facts, batch_keys)
            if tombstones
            else None
        )
        if deleted is not None:
            checked = checked.join(deleted.hint("merge"), keys, "left")
            late = late | F.coalesce(F.col(DELETED_AT) >= F.col(_FIRST), F.lit(False))
        checked = checked.withColumn("_late", late).persist()
        summary = checked.agg(
            F.max(F.col("_late").cast("int")).alias("late"),
            F.count("*").alias("keys"),
            F.count(F.col(_LIVE_AT)).alias("n"),
        ).first()
        if summary is None or summary["late"]:
            checked.unpersist()
            return None
        return _StoredVersions(checked, int(summary["keys"]), int(summary["n"]))

    def _append_history(
        self,
        rows: DataFrame,
        stored: _StoredVersions,
        table: s.TableSchema,
        facts: BatchFacts,
        target: StructType,
        timings: BatchTimings,
    ) -> DataFrame | None:
        """The batch's rows added to the history (``_add_changes``) and the ends of the
        stored versions they close to the ``_history_ends`` table: no stored file is
        rewritten. The result of the insert-only MERGE into the history when that took one
        (None: an append).

        Each write is an append, or, when the table may hold the batch's rows already
        (``TableMemory.may_hold_batch``: a replay), an insert-only MERGE that adds only the missing
        ones. Ends are written first: the resolved history counts an end only once the
        history holds the change it ends at (``tables.resolved_history_sql``), so a reader
        between the two commits sees none of the batch.
        """
        if stored.ending:
            with timings.phase(f"{table.name} history ends"):
                self._write_ends(stored, table, facts)
        self._ended_stored = stored.ending > 0
        return self._add_changes(rows, table, facts, target)

    def _add_changes(
        self, rows: DataFrame, table: s.TableSchema, facts: BatchFacts, target: StructType
    ) -> DataFrame | None:
        """The batch's rows added to the history, each once; the result of the insert-only
        MERGE when that took one (None: an append).

        The rows carry their ends within the batch (the key's next change, a delete its own
        LSN). When the history may hold some of them already (``TableMemory.may_hold_batch``: a
        replay), an insert-only MERGE adds only the missing ones, limited to the batch's LSN
        and key range, so Delta reads only the files that can hold a replayed change.
        """
        new_rows = align(_ends_in_batch(rows, table, facts, target, ()), target)
        in_batch = (
            f"{_same_change()} AND t.{quote(s.COMMIT_LSN)} >= {facts.oldest_lsn} "
            f"AND {in_key_range(table, facts.key_range, 't.')}"
        )
        if not self._memory.may_hold_batch(self.paths.history, s.COMMIT_LSN, facts):
            new_rows.write.format("delta").mode("append").save(self.paths.history)
            return None
        return (
            self.history.alias("t")
            .merge(new_rows.alias("s"), in_batch)
            .whenNotMatchedInsert(values=assign(target))
            .execute()
        )

    def _write_ends(self, stored: _StoredVersions, table: s.TableSchema, facts: BatchFacts) -> None:
        """Add the ends of the stored versions the batch closes to the ``_history_ends``
        table, each once: an append, or an insert-only MERGE on the version's key and
        start when the table may hold the batch's ends already (a replay).

        An end's ``valid_to_lsn`` is the commit LSN of one of the batch's changes, so
        ``TableMemory.may_hold_batch`` looks at that column."""
        path = self.paths.history_ends
        target = self._memory.target(path, table, history_ends_struct(table))
        ends = stored.checked.where(F.col(_LIVE_AT).isNotNull()).select(
            *[F.col(quote(k)) for k in table.key_columns],
            F.col(_LIVE_AT)[s.COMMIT_LSN].alias(s.COMMIT_LSN),
            F.col(_LIVE_AT)[s.TOTAL_ORDER].alias(s.TOTAL_ORDER),
            F.col(_FIRST)[s.COMMIT_LSN].alias(s.VALID_TO),
        )
        if self._memory.may_hold_batch(path, s.VALID_TO, facts):
            position = " AND ".join(
                f"t.{quote(c)} = s.{quote(c)}" for c in (s.COMMIT_LSN, s.TOTAL_ORDER)
            )
            (
                DeltaTable.forPath(self.spark, path)
                .alias("t")
                .merge(ends.alias("s"), f"{key_match(table.key_columns)} AND {position}")
                .whenNotMatchedInsert(values=assign(target))
                .execute()
            )
        else:
            align(ends, target).write.format("delta").mode("append").save(path)
        self._memory.wrote(path, facts)

    def _merge_history(
        self,
        rows: DataFrame,
        table: s.TableSchema,
        facts: BatchFacts,
        target: StructType,
        new_keys: bool,
        later: tuple[Position, ...],
    ) -> DataFrame | None:
        """Insert each change once and move the ends in the history itself; the MERGE's
        result when that took one (None: an append). ``new_keys``: see ``_only_new_keys``;
        ``later``: the truncates at or after the batch's oldest change.

        A change is valid from its commit LSN to the commit LSN of the first thing after it
        that ends it: the key's next change or the next truncate, whichever comes first
        (deletes and truncates end at their own LSN), so the open versions
        (``valid_to_lsn IS NULL``) are exactly the live rows. That is a function of the
        set of changes alone, and a minimum: a batch can only move a stored version's end
        earlier. So every batch recomputes the ends of its own changes and of the stored
        rows it can reach (``_reachable``) over both together, and writes the ones that
        differ: the history is the same however the changes were split into batches,
        including late records (a truncate and the changes around it sit on different
        Kafka partitions) and replays.
        """
        keys = table.key_columns
        history = self.history
        fresh = align(rows, target).withColumn(_STORED, F.lit(False))
        union = fresh
        # Without a truncate, only stored rows of the batch's keys are reachable.
        key_range = None if facts.truncates else facts.key_range
        # A table this writer created holds nothing yet: no stored row to look for.
        only_new = self.paths.history in self._memory.unwritten or new_keys
        if not only_new and (keys or facts.truncates):
            stored = self._with_pending_ends(
                history.toDF().where(
                    f"{_reachable(facts.oldest_lsn)} AND {in_key_range(table, key_range)}"
                ),
                table,
            ).where(_reachable(facts.oldest_lsn))
            if not facts.truncates:
                # Only a truncate reaches keys the batch does not change.
                stored = stored.join(
                    rows.where(F.col(s.OP) != "t").select(*[F.col(quote(k)) for k in keys]),
                    list(keys),
                    "left_semi",
                )
            # No stored row within reach: nothing to close, no change stored before (a
            # replay), so the batch only adds rows. Looking stops at the first row found.
            # It is a Spark job, spent for nothing when there are such rows: after a batch
            # that ended stored versions (updates), the next most likely does too, so it
            # MERGEs without looking (a MERGE that ends nothing only inserts).
            only_new = not self._ended_stored and stored.isEmpty()
            identity = [*keys, s.OP, s.COMMIT_LSN, s.TOTAL_ORDER, s.VALID_TO]
            if not only_new:
                union = fresh.unionByName(
                    align(stored.select(*[F.col(quote(c)) for c in identity]), target).withColumn(
                        _STORED, F.lit(True)
                    )
                )
        result = None
        if only_new:
            ends = _ends_in_batch(rows, table, facts, target, later)
            align(ends, target).write.format("delta").mode("append").save(self.paths.history)
        else:
            ends = _recompute_ends(union, table, later)
            # Stored rows whose end did not move and batch rows already stored (a replay)
            # are left out: a MERGE rewrites every file holding a matched row.
            moved = ~F.col(_STORED) | ~F.col(s.VALID_TO).eqNullSafe(F.col(_OLD_END))
            result = self._close_and_insert(
                history, ends.where(moved), target, in_key_range(table, key_range, "t."), facts
            )
        self._ended_stored = not only_new
        return result

    def _with_pending_ends(self, stored: DataFrame, table: s.TableSchema) -> DataFrame:
        """Stored history rows with the ends the ``_history_ends`` table holds for them
        (``resolved_history_sql``'s join): the ends this path recomputes start from the
        resolved ones. Every end counts here, also one whose change the history does not
        hold yet (which readers skip): only a crash between a batch's two writes leaves
        one, and the replay of that batch, the next write, brings the change. ``stored``
        is first chosen by its own ``valid_to_lsn``, a superset (an end not folded in yet
        is null there), so Delta can still skip files by it.
        """
        if not table.key_columns or not DeltaTable.isDeltaTable(
            self.spark, self.paths.history_ends
        ):
            return stored
        ends = (
            DeltaTable.forPath(self.spark, self.paths.history_ends)
            .toDF()
            .withColumnRenamed(s.VALID_TO, "_pending_end")
        )
        return (
            stored.join(ends, [*table.key_columns, s.COMMIT_LSN, s.TOTAL_ORDER], "left")
            .withColumn(s.VALID_TO, F.coalesce(F.col(s.VALID_TO), F.col("_pending_end")))
            .drop("_pending_end")
        )

    @staticmethod
    def _close_and_insert(
        history: DeltaTable, ends: DataFrame, target: StructType, in_range: str, facts: BatchFacts
    ) -> DataFrame:
        """One MERGE: move the ends of stored rows and insert the new rows."""
        # The stored side of the join is narrowed by the same predicates that chose the
        # reachable rows, so Delta skips files and Spark filters rows before joining.
        return (
            history.alias("t")
            .merge(
                ends.alias("s"),
                f"{_same_change()} AND {_reachable(facts.oldest_lsn, 't.')} AND {in_range}",
            )
            .whenMatchedUpdate(
                condition=f"s.{_STORED}", set={quote(s.VALID_TO): f"s.{quote(s.VALID_TO)}"}
            )
            .whenNotMatchedInsert(condition=f"NOT s.{_STORED}", values=assign(target))
            .execute()
        )

    @property
    def history(self) -> DeltaTable:
        return DeltaTable.forPath(self.spark, self.paths.history)

    def _history_truncates(self) -> set[Position]:
        """Every truncate the history holds; read once, then kept up to date in memory."""
        if self._truncates is None and self.paths.history in self._memory.unwritten:
            self._truncates = set()  # created by this writer: nothing stored yet
        if self._truncates is None:
            stored = (
                self.history.toDF()
                .where(F.col(s.OP) == "t")
                .select(s.COMMIT_LSN, s.TOTAL_ORDER)
                .collect()
            )
            self._truncates = {(int(r[0]), int(r[1])) for r in stored}
        return self._truncates


def _same_change() -> str:
    """SQL: target ``t`` and source ``s`` are the same change (its position and op)."""
    return " AND ".join(f"t.{quote(c)} = s.{quote(c)}" for c in (s.COMMIT_LSN, s.TOTAL_ORDER, s.OP))


@dataclass(frozen=True)
class _StoredVersions:
    """``HistoryWriter._stored_versions``' answer: per key of the batch its first change
    (``_FIRST``) and stored open version (``_LIVE_AT``, null if none), persisted, how
    many keys the batch changes and how many stored versions it ends."""

    checked: DataFrame
    keys: int
    ending: int

    def held(self) -> Held:
        """A stored open version of a key is its current-state row."""
        if self.ending == 0:
            return Held.NONE
        return Held.ALL if self.ending == self.keys else Held.SOME


def _ends_in_batch(
    rows: DataFrame,
    table: s.TableSchema,
    facts: BatchFacts,
    target: StructType,
    truncates: tuple[Position, ...],
) -> DataFrame:
    """The batch's rows with ``valid_from``/``valid_to`` among themselves (no stored row
    within reach): a version ends at its key's next change or the next of ``truncates``,
    whichever comes first, a delete or truncate at itself.

    ``with_neighbours`` already found each row's next change (``NEXT_CHANGE``) in the window it
    runs with the batch's cached copy, so the ends need no second window (a shuffle and a
    sort of the batch) unless a change comes twice, whose copy ``_recompute_ends`` drops.
    A table without a key has no neighbours: its copies are found by position there.
    """
    if facts.repeats or not table.key_columns:
        fresh = align(rows, target).withColumn(_STORED, F.lit(False))
        return _recompute_ends(fresh, table, truncates)
    commit_lsn, op = F.col(s.COMMIT_LSN), F.col(s.OP)
    following = F.col(NEXT_CHANGE)[s.COMMIT_LSN]
    if truncates:
        following = F.least(following, _next_truncate(truncates)[s.COMMIT_LSN])
    return rows.withColumns(
        {
            s.VALID_FROM: commit_lsn,
            s.VALID_TO: F.when(op.isin("d", "t"), commit_lsn).otherwise(following),
        }
    )


def _reachable(oldest_lsn: int, alias: str = "") -> str:
    """SQL: a stored history row whose end a batch with changes from ``oldest_lsn`` on can
    move, or that lies after one of them: open, ending after ``oldest_lsn``, or as new.

    Any stored row after a reachable one is reachable too (it starts at or after the
    reachable row's end), so recomputing ends over the batch and these rows is exact.
    """
    end, lsn = f"{alias}{quote(s.VALID_TO)}", f"{alias}{quote(s.COMMIT_LSN)}"
    return f"({end} IS NULL OR {end} > {oldest_lsn} OR {lsn} >= {oldest_lsn})"


def _recompute_ends(
    union: DataFrame, table: s.TableSchema, truncates: tuple[Position, ...]
) -> DataFrame:
    """Batch rows and reachable stored rows with ``valid_from``/``valid_to`` recomputed;
    a change stored and in the batch (a replay) comes out once, as the stored row.

    The stored row's old end is kept as ``_OLD_END``; the new end is never later than it
    (the stored rows outside ``union`` can only end a row earlier, never later).
    """
    keys = [F.col(quote(k)) for k in table.key_columns]
    op, position = F.col(s.OP), F.struct(*position_order())
    rows = union.withColumnRenamed(s.VALID_TO, _OLD_END)
    if keys:
        # Stored copies sort first, so a batch copy of a stored change is the one dropped.
        by_key = Window.partitionBy(*keys, op == "t").orderBy(
            *position_order(), F.col(_STORED).desc()
        )
        rows = (
            rows.withColumn("_previous", F.lag(position).over(by_key))
            .where(F.col("_previous").isNull() | (F.col("_previous") != position))
            .drop("_previous")
        )
        following = F.lead(position).over(by_key)[s.COMMIT_LSN]
    else:
        by_change = Window.partitionBy(*position_order()).orderBy(F.col(_STORED).desc())
        rows = (
            rows.withColumn("_copy", F.row_number().over(by_change))
            .where(F.col("_copy") == 1)
            .drop("_copy")
        )
        following = F.lit(None).cast("long")
    if truncates:
        following = F.least(following, _next_truncate(truncates)[s.COMMIT_LSN])
    return rows.withColumns(
        {
            s.VALID_FROM: F.col(s.COMMIT_LSN),
            s.VALID_TO: F.when(op.isin("d", "t"), F.col(s.COMMIT_LSN)).otherwise(
                F.least(following, F.col(_OLD_END))
            ),
        }
    )


def _next_truncate(truncates: tuple[Position, ...]) -> Column:
    """The position of the batch's first truncate after the row's (null if none).

    The driver knows the batch's truncates, so this is a CASE over them rather than a
    window over the whole batch, which Spark would run in a single task.
    """

    def point(position: Position) -> Column:
        return F.struct(
            F.lit(position[0]).cast("long").alias(s.COMMIT_LSN),
            F.lit(position[1]).cast("long").alias(s.TOTAL_ORDER),
        )

    first, *later = sorted(truncates)
    result = F.when(F.expr(older_than(first)), point(first))
    for position in later:
        result = result.when(F.expr(older_than(position)), point(position))
    return result
