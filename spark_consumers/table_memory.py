"""What a table's writers remember of its Delta tables between micro-batches.

It spares every micro-batch several Delta log reads and Spark jobs. Only this job writes
these tables, so the memory cannot go stale.
"""

from __future__ import annotations

from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import StructType

from spark_consumers import schema as s
from spark_consumers.changes import BatchFacts
from spark_consumers.tables import ensure_table, quote, stats_columns


class TableMemory:
    """One source table's Delta tables (history, its ends, current state, tombstones) as
    this job knows them: their schemas, which ones it created and has not written yet,
    and the newest commit LSN each table written by appends holds."""

    def __init__(
        self, spark: SparkSession, deletion_vectors: bool, stats_extra: tuple[str, ...]
    ) -> None:
        self.spark = spark
        self._deletion_vectors = deletion_vectors
        # Source columns the operator wants statistics of, besides the key and positions.
        self._stats_extra = stats_extra
        # Tables this job created and has not written yet: nothing stored to look at.
        self.unwritten: set[str] = set()
        self._schemas: dict[str, tuple[s.TableSchema, StructType]] = {}
        # Per table written by appends (the history, its ends, the tombstones): the largest
        # commit LSN of a change it holds (None: none), read once per job, then kept up to
        # date.
        self._newest: dict[str, int | None] = {}

    def target(self, path: str, table: s.TableSchema, wanted: StructType) -> StructType:
        """The schema of the Delta table at ``path``, created or evolved to ``wanted``
        once per job and source schema."""
        known = self._schemas.get(path)
        if known is None or known[0] != table:
            if not DeltaTable.isDeltaTable(self.spark, path):
                self.unwritten.add(path)
                self._newest[path] = None
            stats = stats_columns(table, self._stats_extra)
            known = self._schemas[path] = (
                table,
                ensure_table(self.spark, path, wanted, self._deletion_vectors, stats),
            )
        return known[1]

    def may_hold_batch(self, path: str, column: str, facts: BatchFacts) -> bool:
        """Whether the table at ``path`` may hold rows of this batch: rows whose ``column``
        (a commit LSN of one of its changes) is ``facts.oldest_lsn`` or later. If not, the
        batch is appended without an insert-only MERGE's look at the stored rows, and no
        stored tombstone can make one of its changes late (``HistoryWriter``).

        A stream's batches follow each other in LSN order, so this is the common case; a
        replay (a restart before the checkpoint, or from older offsets) or a change held
        back on a slower Kafka partition is not. The largest LSN is read once per job (a
        Spark job), then raised by every write (``wrote``).
        """
        if path not in self._newest:
            row = DeltaTable.forPath(self.spark, path).toDF().agg(F.max(quote(column))).first()
            self._newest[path] = None if row is None or row[0] is None else int(row[0])
        newest = self._newest[path]
        return newest is not None and newest >= facts.oldest_lsn

    def wrote(self, path: str, facts: BatchFacts) -> None:
        """The table at ``path`` now holds this batch's rows: it is no longer one with
        nothing stored, and holds rows up to the batch's newest commit LSN."""
        self.unwritten.discard(path)
        if path in self._newest:
            known = self._newest[path]
            self._newest[path] = facts.newest_lsn if known is None else max(known, facts.newest_lsn)
