"""Applying one micro-batch of one table's typed changes to its Delta tables.

Every write is guarded by the change's position ``(commit_lsn, total_order)``, a total
order over a table's changes, so applying a batch twice (a job killed after a Delta commit
but before its checkpoint) or applying an older change after a newer one changes nothing:

- current state: MERGE by key, a row is replaced or deleted only by a newer position; a
  truncate deletes every row older than it. Deleted keys and the last truncate are kept
  in a small tombstone table so a late, older insert cannot bring a row back.
- history: every change once (an insert only if ``(commit_lsn, total_order, op)`` is
  not there yet), with SCD type 2 validity that does not depend on how the changes were
  split into batches. In the common case a batch's rows are inserted without rewriting a
  stored file and the ends of the stored versions it closes go to the small
  ``_history_ends`` table (see ``TableWriter._append_history``); otherwise one MERGE
  moves the ends in the history itself (see ``TableWriter._merge_history``).

Unchanged-TOAST values are filled in first, from the key's previous change in the batch or
else from the current-state row, so history and current state both hold real values.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from delta.tables import DeltaTable
from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ByteType,
    DataType,
    IntegerType,
    LongType,
    ShortType,
    StructType,
)

from services.common.failpoints import failpoint
from spark_consumers import schema as s
from spark_consumers.parse import REASON, can_be_toasted, toast_flag
from spark_consumers.tables import (
    IS_TRUNCATE,
    TablePaths,
    current_struct,
    ensure_table,
    history_ends_struct,
    history_struct,
    quote,
    stats_columns,
    tombstone_struct,
)
from spark_consumers.timings import BatchTimings

Position = tuple[int, int]
_NEXT = "_next_change"
_STORED = "_stored"
_OLD_END = "_stored_valid_to"
_FIRST = "_first_change"
_LIVE_AT = "_current_position"
_DELETED_AT = "_deleted_position"
_POINT = f"struct<{quote(s.COMMIT_LSN)}:bigint,{quote(s.TOTAL_ORDER)}:bigint>"


@dataclass(frozen=True)
class BatchFacts:
    """What the driver already knows of this table's part of the batch (no extra job)."""

    truncates: tuple[Position, ...]
    has_deletes: bool
    has_toast_markers: bool
    # The smallest commit LSN among the batch's changes: a stored history row before it
    # can only be matched as an open version, so the history MERGE skips the closed ones.
    oldest_lsn: int
    # The largest: a table whose rows all lie before ``oldest_lsn`` holds none of the
    # batch's, and after the batch none lies after ``newest_lsn``.
    newest_lsn: int
    # How many of the batch's changes are this table's (``_of_batch_keys``).
    changes: int
    # Whether a change comes twice in the batch (``is_repeated``): only then do the ends
    # within the batch need a window of their own (``_ends_in_batch``).
    repeats: bool
    # The smallest and largest key of the batch's changes when the key is one integer
    # column: Delta skips the files whose key range lies outside it (serial keys).
    key_range: tuple[int, int] | None = None


def newer(a: str, b: str) -> str:
    """SQL: change ``a`` comes after change ``b`` (aliases or a literal position)."""
    c, t = quote(s.COMMIT_LSN), quote(s.TOTAL_ORDER)
    return f"({a}.{c} > {b}.{c} OR ({a}.{c} = {b}.{c} AND {a}.{t} > {b}.{t}))"


def _older_than(position: Position) -> str:
    """SQL: the row's position is before ``position``."""
    c, t = quote(s.COMMIT_LSN), quote(s.TOTAL_ORDER)
    lsn, order = position
    return f"({c} < {lsn} OR ({c} = {lsn} AND {t} < {order}))"


def _newer_than(position: Position) -> str:
    """SQL: the row's position is after ``position``."""
    c, t = quote(s.COMMIT_LSN), quote(s.TOTAL_ORDER)
    lsn, order = position
    return f"({c} > {lsn} OR ({c} = {lsn} AND {t} > {order}))"


def _same_change() -> str:
    """SQL: target ``t`` and source ``s`` are the same change (its position and op)."""
    return " AND ".join(f"t.{quote(c)} = s.{quote(c)}" for c in (s.COMMIT_LSN, s.TOTAL_ORDER, s.OP))


class _Held(Enum):
    """How many of the batch's keys have a row in the current-state table: what its write
    must be able to do."""

    NONE = "none"  # only insert: an append
    SOME = "some"  # update, delete and insert: a MERGE
    ALL = "all"  # update and delete: a MERGE without an insert clause


@dataclass(frozen=True)
class _StoredVersions:
    """``TableWriter._stored_versions``' answer: per key of the batch its first change
    (``_FIRST``) and stored open version (``_LIVE_AT``, null if none), persisted, how
    many keys the batch changes and how many stored versions it ends."""

    checked: DataFrame
    keys: int
    ending: int

    def held(self) -> _Held:
        """A stored open version of a key is its current-state row."""
        if self.ending == 0:
            return _Held.NONE
        return _Held.ALL if self.ending == self.keys else _Held.SOME


# The most changes of one table in a batch whose keys are sent to every task of a join
# with a stored table (``_of_batch_keys``). The driver collects them first: a million keys
# of a uuid are ~60 MB, within a default driver's memory; a batch above it is rare (a
# ``max_offsets_per_trigger`` of millions) and joins as before.
_BROADCAST_KEYS = 1_000_000


def _of_batch_keys(stored: DataFrame, batch_keys: DataFrame, changes: int) -> DataFrame:
    """``stored``'s rows whose key is one of ``batch_keys`` (distinct keys of the batch).

    A stored table can be far larger than a batch: a batch of 50,000 updates over a
    current state of 10M rows. Joined as they are, Spark sorts both sides by key, all 10M
    rows through a shuffle (5.7 s a batch here); with the batch's keys sent to every task
    first, each task drops the rows of other keys as it reads them (1.8 s). Without
    adaptive execution, sending them is a Spark job of its own, cheap beside either.
    """
    if changes > _BROADCAST_KEYS:
        return stored
    return stored.join(F.broadcast(batch_keys), batch_keys.columns, "left_semi")


def _key_match(keys: tuple[str, ...]) -> str:
    return " AND ".join(f"t.{quote(k)} <=> s.{quote(k)}" for k in keys)


def _in_key_range(table: s.TableSchema, key_range: tuple[int, int] | None, alias: str = "") -> str:
    """SQL: the row's key lies within the batch's key range widened to a grid
    (``grid_bounds``); TRUE without a range.

    Only a condition on the target's own columns lets Delta skip files by their min/max
    statistics; a join condition on the key does not. Spark writes an integer literal into
    the code it generates for a query, so bounds that moved with every batch made each
    batch's filters new code, compiled by Janino and then by the JIT all over again (five
    to seven classes a batch of random keys, ``spark_merge_bench``'s mix). On the grid,
    batches over the same keys give the same bounds and run the code of the batch before.
    """
    if key_range is None:
        return "TRUE"
    key = next(c for c in table.columns if c.name == table.key_columns[0])
    low, high = grid_bounds(*key_range, _INTEGER_BITS[type(key.spark_type)])
    return f"{alias}{quote(key.name)} BETWEEN {low} AND {high}"


# The integer types a key range is kept for (``batch._key_bounds``), by their width.
_INTEGER_BITS: dict[type[DataType], int] = {
    ByteType: 8,
    ShortType: 16,
    IntegerType: 32,
    LongType: 64,
}


def grid_bounds(low: int, high: int, bits: int) -> tuple[int, int]:
    """``low``..``high`` widened outwards to multiples of the largest power of two not above
    its span, within the values of a ``bits``-bit integer. At most three times as wide:
    where keys are serial, a filter by it may read a few files more than the exact range."""
    step = 1 << max(0, (high - low).bit_length() - 1)
    lowest, highest = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    return max(lowest, low - low % step), min(highest, high - high % step + step - 1)


def _align(frame: DataFrame, target: StructType, extra: tuple[str, ...] = ()) -> DataFrame:
    """``frame`` with exactly the target's columns (cast to the target's types) + ``extra``.

    A column already of the target's type is taken as it is: a cast costs more round
    trips to the JVM (the type goes over as JSON) than the column itself, and most columns
    need none.
    """
    have = {f.name: f.dataType for f in frame.schema.fields}
    columns = [
        F.col(quote(f.name))
        if have.get(f.name) == f.dataType
        else (F.col(quote(f.name)) if f.name in have else F.lit(None))
        .cast(f.dataType)
        .alias(f.name)
        for f in target.fields
    ]
    return frame.select(*columns, *[F.col(quote(name)) for name in extra])


def _assign(target: StructType) -> dict[str, Column | str]:
    return {quote(f.name): f"s.{quote(f.name)}" for f in target.fields}


def _position_order() -> list[Column]:
    return [F.col(s.COMMIT_LSN), F.col(s.TOTAL_ORDER)]


def with_neighbours(rows: DataFrame, table: s.TableSchema) -> DataFrame:
    """Typed rows + ``_NEXT``: the position of the key's next change in the batch (null for
    its newest), which the current-state MERGE needs.

    The window rides along with the batch's one cached copy. Truncates (no key) and rows
    with a ``_reason`` (dead letters) get partitions of their own, so they are nobody's
    neighbour.
    """
    if not table.key_columns:
        return rows.withColumn(_NEXT, F.lit(None).cast(_POINT))
    by_key = Window.partitionBy(
        *[F.col(quote(k)) for k in table.key_columns], F.col(s.OP) == "t", F.col(REASON).isNull()
    ).orderBy(*_position_order())
    return rows.withColumn(_NEXT, F.lead(F.struct(*_position_order())).over(by_key))


def is_repeated() -> Column:
    """True for a row of ``with_neighbours`` whose key's next change in the batch is at its
    own position: the same change twice in the batch (a change published twice)."""
    following = F.col(_NEXT)
    same = (following[s.COMMIT_LSN] == F.col(s.COMMIT_LSN)) & (
        following[s.TOTAL_ORDER] == F.col(s.TOTAL_ORDER)
    )
    return F.coalesce(same, F.lit(False))


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

    ``with_neighbours`` already found each row's next change (``_NEXT``) in the window it
    runs with the batch's cached copy, so the ends need no second window (a shuffle and a
    sort of the batch) unless a change comes twice, whose copy ``_recompute_ends`` drops.
    A table without a key has no neighbours: its copies are found by position there.
    """
    if facts.repeats or not table.key_columns:
        fresh = _align(rows, target).withColumn(_STORED, F.lit(False))
        return _recompute_ends(fresh, table, truncates)
    commit_lsn, op = F.col(s.COMMIT_LSN), F.col(s.OP)
    following = F.col(_NEXT)[s.COMMIT_LSN]
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
    op, position = F.col(s.OP), F.struct(*_position_order())
    rows = union.withColumnRenamed(s.VALID_TO, _OLD_END)
    if keys:
        # Stored copies sort first, so a batch copy of a stored change is the one dropped.
        by_key = Window.partitionBy(*keys, op == "t").orderBy(
            *_position_order(), F.col(_STORED).desc()
        )
        rows = (
            rows.withColumn("_previous", F.lag(position).over(by_key))
            .where(F.col("_previous").isNull() | (F.col("_previous") != position))
            .drop("_previous")
        )
        following = F.lead(position).over(by_key)[s.COMMIT_LSN]
    else:
        by_change = Window.partitionBy(*_position_order()).orderBy(F.col(_STORED).desc())
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
    result = F.when(F.expr(_older_than(first)), point(first))
    for position in later:
        result = result.when(F.expr(_older_than(position)), point(position))
    return result


def resolve_toast(
    spark: SparkSession, rows: DataFrame, table: s.TableSchema, paths: TablePaths, changes: int
) -> DataFrame:
    """Replace unchanged-TOAST placeholders with the value the key had just before.

    Within the batch that is the latest earlier change of the key since its last insert or
    delete; otherwise the current-state row (read before this batch touches it).
    ``changes``: how many ``rows`` there are (``_of_batch_keys``).
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
        Window.partitionBy(*keys).orderBy(*_position_order()).rowsBetween(upto, Window.currentRow)
    )
    rows = rows.withColumn("_segment", F.sum(restart).over(by_key))
    segment = (
        Window.partitionBy(*keys, F.col("_segment"))
        .orderBy(*_position_order())
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
    stored = _of_batch_keys(
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


class TableWriter:
    """Applies batches to one source table's Delta tables; lives as long as the job.

    It remembers what it already checked (the Delta schemas, the last truncate, whether
    any tombstone exists), which spares every micro-batch several Delta log reads. Only
    this job writes these tables, so the memory cannot go stale.
    """

    def __init__(
        self,
        spark: SparkSession,
        paths: TablePaths,
        deletion_vectors: bool = False,
        stats_extra: tuple[str, ...] = (),
    ) -> None:
        self.spark = spark
        self.paths = paths
        self.deletion_vectors = deletion_vectors
        # Source columns the operator wants statistics of, besides the key and positions.
        self.stats_extra = stats_extra
        # Tables this writer created and has not written yet: nothing to merge with.
        self._empty: set[str] = set()
        self._schemas: dict[str, tuple[s.TableSchema, StructType]] = {}
        self._floor: Position | None = None
        self._truncates: set[Position] | None = None
        self._tombstones: bool | None = None
        # (key column, largest key the history holds, None when it holds none), for a key
        # of one integer column; None until read.
        self._key_ceiling: tuple[str, int | None] | None = None
        # Whether the last batch's history write ended stored versions (in the history or
        # in its ends table): the next one most likely does too.
        self._ended_stored = False
        # Whether ``_stored_versions`` found every change of this batch after its key's
        # newest tombstone: the current-state write then need not read the tombstones.
        self._after_tombstones = False
        # How many keys of this batch ``_stored_versions`` found in the current state
        # (SOME when it did not look).
        self._held = _Held.SOME
        # Per table written by appends (the history, its ends, the tombstones): the largest
        # commit LSN of a change it holds (None: none), read once per job, then kept up to
        # date.
        self._newest: dict[str, int | None] = {}

    def apply(
        self, rows: DataFrame, table: s.TableSchema, facts: BatchFacts, timings: BatchTimings
    ) -> None:
        """Both tables for one batch: history first, so a crash in between leaves the
        current state behind, never ahead of the history (replay fixes either).

        ``rows`` are good rows from ``with_neighbours``, cached by the caller: both MERGEs
        read them.
        """
        if self._tombstones is None and table.key_columns:
            self._load_tombstone_state(table)
        # Filled-in TOAST values come from windows and a join: computed once for both tables.
        toasted = (
            resolve_toast(self.spark, rows, table, self.paths, facts.changes).persist()
            if facts.has_toast_markers
            else None
        )
        try:
            changes = rows if toasted is None else toasted
            with timings.phase(f"{table.name} history"):
                target = self._target(self.paths.history, table, history_struct(table))
                new_keys = self._only_new_keys(table, facts)
                merged = self._write_history(changes, rows, table, facts, target, new_keys, timings)
                if merged is not None:
                    timings.merged(f"{table.name} history", merged)
            if facts.key_range is not None and self._key_ceiling is not None:
                name, ceiling = self._key_ceiling
                high = facts.key_range[1]
                self._key_ceiling = name, high if ceiling is None else max(ceiling, high)
            # Crash tests kill the job here: history committed, current state not yet.
            failpoint("consume_after_history")
            if table.key_columns:
                with timings.phase(f"{table.name} current"):
                    held = _Held.NONE if new_keys else self._held
                    self._merge_current(changes, rows, table, facts, timings, held)
        finally:
            if toasted is not None:
                toasted.unpersist()

    def _target(self, path: str, table: s.TableSchema, wanted: StructType) -> StructType:
        known = self._schemas.get(path)
        if known is None or known[0] != table:
            if not DeltaTable.isDeltaTable(self.spark, path):
                self._empty.add(path)
                self._newest[path] = None
            stats = stats_columns(table, self.stats_extra)
            known = self._schemas[path] = (
                table,
                ensure_table(self.spark, path, wanted, self.deletion_vectors, stats),
            )
        return known[1]

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
            if self.paths.history not in self._empty:
                row = self.history.toDF().agg(F.max(F.col(quote(key)))).first()
                stored = None if row is None or row[0] is None else int(row[0])
            self._key_ceiling = key, stored
        ceiling = self._key_ceiling[1]
        return ceiling is None or facts.key_range[0] > ceiling

    def _load_tombstone_state(self, table: s.TableSchema) -> None:
        if not DeltaTable.isDeltaTable(self.spark, self.paths.tombstones):
            self._tombstones = False  # created on the first delete or truncate
            return
        stones = DeltaTable.forPath(self.spark, self.paths.tombstones).toDF()
        row = stones.where(F.col(IS_TRUNCATE)).select(s.COMMIT_LSN, s.TOTAL_ORDER).first()
        self._floor = None if row is None else (int(row[0]), int(row[1]))
        self._tombstones = stones.where(~F.col(IS_TRUNCATE)).limit(1).count() > 0

    def _write_history(
        self,
        rows: DataFrame,
        unfilled: DataFrame,
        table: s.TableSchema,
        facts: BatchFacts,
        target: StructType,
        new_keys: bool,
        timings: BatchTimings,
    ) -> DataFrame | None:
        """Insert each change once and keep SCD type 2 validity right; the result of the
        MERGE into the history when that took one (None: a plain append).

        ``unfilled``: ``rows`` before their TOAST placeholders were filled in. The look
        for stored versions reads only keys and positions, which the fill-in leaves as
        they are, so it reads them there and does not start the fill-in (its windows and
        its read of the current state), which the history's write then runs once.

        A batch appends (``_append_history``, or ``_add_changes`` for a table without a
        key) unless a truncate can end a version it writes (a truncate in the batch, or a
        stored one at or after its oldest change: a truncate ends every key's version, also
        of keys the batch does not hold, and it reaches the job in any order with the
        changes around it) or ``_stored_versions`` finds a late change. Those take
        ``_merge_history``. A table without a key has no identity to end a version by, so
        only a truncate ends its rows: all of them stay open, and a MERGE matching the
        open ones read its whole history every batch.
        """
        truncates = self._history_truncates() | set(facts.truncates)
        # A truncate before the batch's oldest change ends nothing this batch recomputes:
        # a reachable stored version that old would already be closed at it.
        later = tuple(sorted(t for t in truncates if t[0] >= facts.oldest_lsn))
        fresh = self.paths.history in self._empty or new_keys
        stored = None
        if table.key_columns and not later and not fresh:
            with timings.phase(f"{table.name} stored versions"):
                stored = self._stored_versions(unfilled, table, facts)
        self._after_tombstones = stored is not None
        self._held = _Held.SOME if stored is None else stored.held()
        if stored is None and not table.key_columns and not later:
            self._ended_stored = False
            result = self._add_changes(rows, table, facts, target)
        elif stored is None:
            result = self._merge_history(rows, table, facts, target, new_keys, later)
        else:
            try:
                result = self._append_history(rows, stored, table, facts, target, timings)
            finally:
                stored.checked.unpersist()
        self._truncates = truncates
        self._wrote(self.paths.history, facts)
        return result

    def _stored_versions(
        self, rows: DataFrame, table: s.TableSchema, facts: BatchFacts
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
        position = F.struct(*_position_order())
        firsts = rows.where(F.col(s.OP) != "t").groupBy(*by_key).agg(F.min(position).alias(_FIRST))
        batch_keys = firsts.select(*by_key)
        self._target(self.paths.current, table, current_struct(table))
        checked = firsts
        late = F.lit(False)
        if self.paths.current not in self._empty:
            live = _of_batch_keys(
                DeltaTable.forPath(self.spark, self.paths.current)
                .toDF()
                .where(_in_key_range(table, facts.key_range))
                .select(*by_key, position.alias(_LIVE_AT)),
                batch_keys,
                facts.changes,
            )
            # Left are at most the batch's keys. A sort-merge join, not a broadcast: without
            # adaptive execution each broadcast is a Spark job of its own.
            checked = checked.join(live.hint("merge"), keys, "left")
            late = late | F.coalesce(F.col(_LIVE_AT) >= F.col(_FIRST), F.lit(False))
        else:
            checked = checked.withColumn(_LIVE_AT, F.lit(None).cast(_POINT))
        # A tombstone before the batch's oldest change is before every key's first change in
        # it, so only a stored tombstone at or after that can make a change late: in a
        # stream's order there is none, and the tombstones, a week of deletes until
        # housekeeping trims them, are not read at all.
        if self._tombstones and self._may_hold_batch(self.paths.tombstones, s.COMMIT_LSN, facts):
            deleted = (
                _of_batch_keys(
                    DeltaTable.forPath(self.spark, self.paths.tombstones)
                    .toDF()
                    .where(~F.col(IS_TRUNCATE) & F.expr(_in_key_range(table, facts.key_range))),
                    batch_keys,
                    facts.changes,
                )
                .groupBy(*by_key)
                .agg(F.max(position).alias(_DELETED_AT))
            )
            checked = checked.join(deleted.hint("merge"), keys, "left")
            late = late | F.coalesce(F.col(_DELETED_AT) >= F.col(_FIRST), F.lit(False))
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
        (``_may_hold_batch``: a replay), an insert-only MERGE that adds only the missing
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
        LSN). When the history may hold some of them already (``_may_hold_batch``: a
        replay), an insert-only MERGE adds only the missing ones, limited to the batch's LSN
        and key range, so Delta reads only the files that can hold a replayed change.
        """
        new_rows = _align(_ends_in_batch(rows, table, facts, target, ()), target)
        in_batch = (
            f"{_same_change()} AND t.{quote(s.COMMIT_LSN)} >= {facts.oldest_lsn} "
            f"AND {_in_key_range(table, facts.key_range, 't.')}"
        )
        if not self._may_hold_batch(self.paths.history, s.COMMIT_LSN, facts):
            new_rows.write.format("delta").mode("append").save(self.paths.history)
            return None
        return (
            self.history.alias("t")
            .merge(new_rows.alias("s"), in_batch)
            .whenNotMatchedInsert(values=_assign(target))
            .execute()
        )

    def _may_hold_batch(self, path: str, column: str, facts: BatchFacts) -> bool:
        """Whether the table at ``path`` may hold rows of this batch: rows whose ``column``
        (a commit LSN of one of its changes) is ``facts.oldest_lsn`` or later. If not, the
        batch is appended without an insert-only MERGE's look at the stored rows, and no
        stored tombstone can make one of its changes late (``_stored_versions``).

        A stream's batches follow each other in LSN order, so this is the common case; a
        replay (a restart before the checkpoint, or from older offsets) or a change held
        back on a slower Kafka partition is not. The largest LSN is read once per job (a
        Spark job), then raised by every write (``_wrote``).
        """
        if path not in self._newest:
            row = DeltaTable.forPath(self.spark, path).toDF().agg(F.max(quote(column))).first()
            self._newest[path] = None if row is None or row[0] is None else int(row[0])
        newest = self._newest[path]
        return newest is not None and newest >= facts.oldest_lsn

    def _wrote(self, path: str, facts: BatchFacts) -> None:
        """The table at ``path`` now holds rows up to the batch's newest commit LSN."""
        if path in self._newest:
            known = self._newest[path]
            self._newest[path] = facts.newest_lsn if known is None else max(known, facts.newest_lsn)

    def _write_ends(self, stored: _StoredVersions, table: s.TableSchema, facts: BatchFacts) -> None:
        """Add the ends of the stored versions the batch closes to the ``_history_ends``
        table, each once: an append, or an insert-only MERGE on the version's key and
        start when the table may hold the batch's ends already (a replay).

        An end's ``valid_to_lsn`` is the commit LSN of one of the batch's changes, so
        ``_may_hold_batch`` looks at that column."""
        path = self.paths.history_ends
        target = self._target(path, table, history_ends_struct(table))
        ends = stored.checked.where(F.col(_LIVE_AT).isNotNull()).select(
            *[F.col(quote(k)) for k in table.key_columns],
            F.col(_LIVE_AT)[s.COMMIT_LSN].alias(s.COMMIT_LSN),
            F.col(_LIVE_AT)[s.TOTAL_ORDER].alias(s.TOTAL_ORDER),
            F.col(_FIRST)[s.COMMIT_LSN].alias(s.VALID_TO),
        )
        if self._may_hold_batch(path, s.VALID_TO, facts):
            position = " AND ".join(
                f"t.{quote(c)} = s.{quote(c)}" for c in (s.COMMIT_LSN, s.TOTAL_ORDER)
            )
            (
                DeltaTable.forPath(self.spark, path)
                .alias("t")
                .merge(ends.alias("s"), f"{_key_match(table.key_columns)} AND {position}")
                .whenNotMatchedInsert(values=_assign(target))
                .execute()
            )
        else:
            _align(ends, target).write.format("delta").mode("append").save(path)
        self._wrote(path, facts)

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
        fresh = _align(rows, target).withColumn(_STORED, F.lit(False))
        union = fresh
        # Without a truncate, only stored rows of the batch's keys are reachable.
        key_range = None if facts.truncates else facts.key_range
        # A table this writer created holds nothing yet: no stored row to look for.
        only_new = self.paths.history in self._empty or new_keys
        if not only_new and (keys or facts.truncates):
            stored = self._with_pending_ends(
                history.toDF().where(
                    f"{_reachable(facts.oldest_lsn)} AND {_in_key_range(table, key_range)}"
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
                    _align(stored.select(*[F.col(quote(c)) for c in identity]), target).withColumn(
                        _STORED, F.lit(True)
                    )
                )
        result = None
        if only_new:
            ends = _ends_in_batch(rows, table, facts, target, later)
            _align(ends, target).write.format("delta").mode("append").save(self.paths.history)
            self._empty.discard(self.paths.history)
        else:
            ends = _recompute_ends(union, table, later)
            # Stored rows whose end did not move and batch rows already stored (a replay)
            # are left out: a MERGE rewrites every file holding a matched row.
            moved = ~F.col(_STORED) | ~F.col(s.VALID_TO).eqNullSafe(F.col(_OLD_END))
            result = self._close_and_insert(
                history, ends.where(moved), target, _in_key_range(table, key_range, "t."), facts
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
            .whenNotMatchedInsert(condition=f"NOT s.{_STORED}", values=_assign(target))
            .execute()
        )

    @property
    def history(self) -> DeltaTable:
        return DeltaTable.forPath(self.spark, self.paths.history)

    def _history_truncates(self) -> set[Position]:
        """Every truncate the history holds; read once, then kept up to date in memory."""
        if self._truncates is None and self.paths.history in self._empty:
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

    def _merge_current(
        self,
        rows: DataFrame,
        unfilled: DataFrame,
        table: s.TableSchema,
        facts: BatchFacts,
        timings: BatchTimings,
        held: _Held,
    ) -> None:
        """Bring the current-state table to the newest change of every key in the batch.

        ``held``: how many of the batch's keys the table holds. None (new serial keys, see
        ``_only_new_keys``, or ``_stored_versions`` found none: keys of concurrent
        transactions commit out of their serial order, and keys that are not serial): the
        MERGE would only insert, and an append does that in one commit without its jobs.
        All (updates and deletes of stored rows): the MERGE has no insert clause. With
        one, Delta joins the batch to the table as an outer join whose outer side is the
        batch, so Spark cannot send the small batch to every task and sorts the whole
        table through a shuffle instead; without one the join is inner and the batch is
        sent (50,000 updates of a 10M-row table: 11 s -> 7.7 s here).

        ``unfilled``: ``rows`` before their TOAST placeholders were filled in, which is
        where the tombstones come from. Filling them in reads the current state, and once
        this writes it Spark computes every cached plan reading it again (it re-caches by
        path): the tombstones of a TOASTed table would pay the windows and the join once
        more. A delete's key and position are the same in both."""
        target = self._target(self.paths.current, table, current_struct(table))
        keys = list(table.key_columns)
        current = DeltaTable.forPath(self.spark, self.paths.current)
        tombstones = (
            self._target(self.paths.tombstones, table, tombstone_struct(table))
            if facts.has_deletes or facts.truncates or self._tombstones
            else None
        )
        stones = DeltaTable.forPath(self.spark, self.paths.tombstones) if tombstones else None
        if facts.truncates:
            latest_truncate = max(facts.truncates)
            current.delete(_older_than(latest_truncate))
        floor = max([*facts.truncates, *([self._floor] if self._floor else [])], default=None)
        deleted = None
        if (
            self._tombstones
            and stones is not None
            and held is not _Held.NONE
            and not self._after_tombstones
        ):
            # Tombstones are appended, so a key deleted several times has several: its
            # newest delete is the one a change must come after. ``_stored_versions``
            # already compared every change with it when the history was appended.
            # Read twice when the batch deletes (the MERGE's rows and the tombstones'), as
            # the rare path it is: only batches that took the history's MERGE come here.
            deleted = (
                stones.toDF()
                .where(~F.col(IS_TRUNCATE))
                .groupBy(*[F.col(quote(k)) for k in keys])
                .agg(F.max(F.struct(*_position_order())).alias("_d"))
            )

        def newest(changes: DataFrame) -> DataFrame:
            """Each key's newest change, if after the truncates and the key's deletes."""
            latest = changes.where((F.col(s.OP) != "t") & F.col(_NEXT).isNull())
            if floor is not None:
                latest = latest.where(_newer_than(floor))
            if deleted is not None:
                latest = (
                    latest.join(deleted, keys, "left")
                    .where(F.col("_d").isNull() | (F.struct(*_position_order()) > F.col("_d")))
                    .drop("_d")
                )
            return latest

        latest = newest(rows)
        in_range = _in_key_range(table, facts.key_range, "t.")
        if self.paths.current in self._empty or held is _Held.NONE:
            # What the MERGE would insert into a table without these keys, without its join.
            live = latest.where(F.col(s.OP) != "d")
            _align(live, target).write.format("delta").mode("append").save(self.paths.current)
            self._empty.discard(self.paths.current)
        else:
            merge = (
                current.alias("t")
                .merge(
                    _align(latest, target, (s.OP,)).alias("s"),
                    f"{_key_match(table.key_columns)} AND {in_range}",
                )
                .whenMatchedDelete(condition=f"s.{quote(s.OP)} = 'd' AND {newer('s', 't')}")
                .whenMatchedUpdate(condition=newer("s", "t"), set=_assign(target))
            )
            if held is not _Held.ALL:
                merge = merge.whenNotMatchedInsert(
                    condition=f"s.{quote(s.OP)} <> 'd'", values=_assign(target)
                )
            result = merge.execute()
            timings.merged(f"{table.name} current", result)
        if facts.has_deletes and tombstones is not None:
            with timings.phase(f"{table.name} tombstones"):
                _append_tombstones(newest(unfilled), tombstones, self.paths.tombstones)
            self._tombstones = True
            self._wrote(self.paths.tombstones, facts)
        if (
            stones is not None
            and facts.truncates
            and (self._floor is None or max(facts.truncates) > self._floor)
        ):
            self._floor = max(facts.truncates)
            _store_truncate(self.spark, stones, self._floor)
            self._wrote(self.paths.tombstones, facts)


def _append_tombstones(latest: DataFrame, target: StructType, path: str) -> None:
    """Remember the keys whose newest change in the batch is a delete.

    An append, not a MERGE: a key's older tombstones and those of keys created again
    later only cost space (a change is compared with the key's newest delete), and
    housekeeping trims them. A replayed batch appends its tombstones again, harmlessly.
    """
    deletes = latest.where(F.col(s.OP) == "d").withColumn(IS_TRUNCATE, F.lit(False))
    _align(deletes, target).write.format("delta").mode("append").save(path)


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
