"""A batch's changes as the history and current-state writes both see them: their
positions, their keys and key range, and their columns aligned to a Delta table's.

Every write is guarded by a change's position ``(commit_lsn, total_order)``, a total order
over a table's changes (see ``merge``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ByteType,
    DataType,
    IntegerType,
    LongType,
    ShortType,
    StructType,
)

from spark_consumers import schema as s
from spark_consumers.parse import REASON
from spark_consumers.tables import quote

Position = tuple[int, int]
# The position of the key's next change in the batch (``with_neighbours``).
NEXT_CHANGE = "_next_change"
# The Spark SQL type of a position.
POINT = f"struct<{quote(s.COMMIT_LSN)}:bigint,{quote(s.TOTAL_ORDER)}:bigint>"


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
    # How many of the batch's changes are this table's (``of_batch_keys``).
    changes: int
    # About the bytes the table's typed rows of the batch take in memory, TOAST values
    # not filled in yet (``parse.RowTyping.row_bytes``).
    row_bytes: int
    # Whether a change comes twice in the batch (``is_repeated``): only then do the ends
    # within the batch need a window of their own (``history._ends_in_batch``).
    repeats: bool
    # The smallest and largest key of the batch's changes when the key is one integer
    # column: Delta skips the files whose key range lies outside it (serial keys).
    key_range: tuple[int, int] | None = None


def newer(a: str, b: str) -> str:
    """SQL: change ``a`` comes after change ``b`` (aliases or a literal position)."""
    c, t = quote(s.COMMIT_LSN), quote(s.TOTAL_ORDER)
    return f"({a}.{c} > {b}.{c} OR ({a}.{c} = {b}.{c} AND {a}.{t} > {b}.{t}))"


def older_than(position: Position) -> str:
    """SQL: the row's position is before ``position``."""
    c, t = quote(s.COMMIT_LSN), quote(s.TOTAL_ORDER)
    lsn, order = position
    return f"({c} < {lsn} OR ({c} = {lsn} AND {t} < {order}))"


def newer_than(position: Position) -> str:
    """SQL: the row's position is after ``position``."""
    c, t = quote(s.COMMIT_LSN), quote(s.TOTAL_ORDER)
    lsn, order = position
    return f"({c} > {lsn} OR ({c} = {lsn} AND {t} > {order}))"


class Held(Enum):
    """How many of the batch's keys have a row in the current-state table: what its write
    must be able to do."""

    NONE = "none"  # only insert: an append
    SOME = "some"  # update, delete and insert: a MERGE
    ALL = "all"  # update and delete: a MERGE without an insert clause


# The most changes of one table in a batch whose keys are sent to every task of a join
# with a stored table (``of_batch_keys``). The driver collects them first: a million keys
# of a uuid are ~60 MB, within a default driver's memory; a batch above it is rare (a
# ``max_offsets_per_trigger`` of millions) and joins as before.
_BROADCAST_KEYS = 1_000_000


def of_batch_keys(stored: DataFrame, batch_keys: DataFrame, changes: int) -> DataFrame:
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


def key_match(keys: tuple[str, ...]) -> str:
    return " AND ".join(f"t.{quote(k)} <=> s.{quote(k)}" for k in keys)


def in_key_range(table: s.TableSchema, key_range: tuple[int, int] | None, alias: str = "") -> str:
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


def align(frame: DataFrame, target: StructType, extra: tuple[str, ...] = ()) -> DataFrame:
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


def assign(target: StructType) -> dict[str, Column | str]:
    return {quote(f.name): f"s.{quote(f.name)}" for f in target.fields}


def position_order() -> list[Column]:
    return [F.col(s.COMMIT_LSN), F.col(s.TOTAL_ORDER)]


def with_neighbours(rows: DataFrame, table: s.TableSchema) -> DataFrame:
    """Typed rows + ``NEXT_CHANGE``: the position of the key's next change in the batch (null for
    its newest), which the current-state MERGE needs.

    The window rides along with the batch's one cached copy. Truncates (no key) and rows
    with a ``_reason`` (dead letters) get partitions of their own, so they are nobody's
    neighbour.
    """
    if not table.key_columns:
        return rows.withColumn(NEXT_CHANGE, F.lit(None).cast(POINT))
    by_key = Window.partitionBy(
        *[F.col(quote(k)) for k in table.key_columns], F.col(s.OP) == "t", F.col(REASON).isNull()
    ).orderBy(*position_order())
    return rows.withColumn(NEXT_CHANGE, F.lead(F.struct(*position_order())).over(by_key))


def is_repeated() -> Column:
    """True for a row of ``with_neighbours`` whose key's next change in the batch is at its
    own position: the same change twice in the batch (a change published twice)."""
    following = F.col(NEXT_CHANGE)
    same = (following[s.COMMIT_LSN] == F.col(s.COMMIT_LSN)) & (
        following[s.TOTAL_ORDER] == F.col(s.TOTAL_ORDER)
    )
    return F.coalesce(same, F.lit(False))
