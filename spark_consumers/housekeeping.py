"""Scheduled upkeep of the Delta tables: history ends folded in, compaction, VACUUM,
tombstone trimming.

Every micro-batch adds a few small files to each table it touches (a MERGE rewrites the
files it matched and adds new ones), so without upkeep reads slow down with the number of
batches and old files pile up on storage. Once per ``housekeeping_interval_s`` the job
therefore writes the ends waiting in each ``_history_ends`` table into the history (see
``history.HistoryWriter._append_history``), compacts every table (``OPTIMIZE``), removes files
no version within ``vacuum_retention_hours`` still needs (``VACUUM``) and trims tombstones
no record can be older than any more.

It runs inside the foreachBatch call, after the batch's own writes: the batch writers are
the only other writers of these tables, so upkeep never races a MERGE (a concurrent
OPTIMIZE would make one of them fail on a conflict).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from delta.tables import DeltaTable
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from services.common.failpoints import failpoint
from services.common.logs import log_event
from spark_consumers import schema as s
from spark_consumers.status import Upkeep
from spark_consumers.tables import IS_TRUNCATE, TablePaths, dead_letter_path, quote

_POSITION_AND_END = (s.COMMIT_LSN, s.TOTAL_ORDER, s.VALID_TO)

log = logging.getLogger("slotbridge.consume")


@dataclass
class Housekeeper:
    """Decides when upkeep is due and runs it over every table the schema topic names."""

    interval_s: float
    vacuum_retention_hours: float
    tombstone_retention_hours: float
    _next_due: float = 0.0

    def due(self, now: float) -> bool:
        """``interval_s`` 0 turns upkeep off; the first run comes one interval after start."""
        if self.interval_s <= 0:
            return False
        if self._next_due == 0.0:
            self._next_due = now + self.interval_s
        return now >= self._next_due

    def run(self, spark: SparkSession, warehouse: str, tables: dict[str, TablePaths]) -> Upkeep:
        started = time.monotonic()
        upkeep = Upkeep(tables=sorted(tables))
        for name in sorted(tables):
            paths = tables[name]
            upkeep.tombstones_trimmed += self._trim_tombstones(spark, paths)
            upkeep.history_ends_folded += fold_history_ends(spark, paths)
            for path in (paths.current, paths.history, paths.tombstones, paths.history_ends):
                self._compact_and_vacuum(spark, path, upkeep)
                # Crash tests kill the job here: one table compacted, the next not yet.
                failpoint("consume_in_housekeeping")
        self._compact_and_vacuum(spark, dead_letter_path(warehouse), upkeep)
        upkeep.seconds = round(time.monotonic() - started, 3)
        upkeep.finished_at = time.time()
        self._next_due = time.monotonic() + self.interval_s
        log_event(
            log,
            logging.INFO,
            "housekeeping done",
            seconds=upkeep.seconds,
            tables=len(tables),
            files_compacted=upkeep.files_compacted,
            files_vacuumed=upkeep.files_vacuumed,
            tombstones_trimmed=upkeep.tombstones_trimmed,
            history_ends_folded=upkeep.history_ends_folded,
        )
        return upkeep

    def _compact_and_vacuum(self, spark: SparkSession, path: str, upkeep: Upkeep) -> None:
        if not DeltaTable.isDeltaTable(spark, path):
            return
        table = DeltaTable.forPath(spark, path)
        metrics = table.optimize().executeCompaction().first()
        if metrics is not None:
            upkeep.files_compacted += int(metrics["metrics"]["numFilesRemoved"])
        # The dry run lists what VACUUM deletes: VACUUM itself reports no count.
        doomed = spark.sql(
            f"VACUUM delta.{quote(path)} RETAIN {self.vacuum_retention_hours} HOURS DRY RUN"
        ).count()
        if doomed:
            table.vacuum(self.vacuum_retention_hours)
        upkeep.files_vacuumed += doomed

    def _trim_tombstones(self, spark: SparkSession, paths: TablePaths) -> int:
        """Delete the tombstones of deletes committed more than ``tombstone_retention_hours``
        before the newest change the table's history holds.

        A tombstone only stops a record older than the delete that arrives after it (Kafka
        partitions reordered, a replay from old offsets); like Kafka's own
        ``delete.retention.ms``, this bounds how late such a record may come. The last
        truncate's row is kept: it is one row, and it guards every key.
        """
        if not (
            DeltaTable.isDeltaTable(spark, paths.tombstones)
            and DeltaTable.isDeltaTable(spark, paths.history)
        ):
            return 0
        newest = DeltaTable.forPath(spark, paths.history).toDF().agg(F.max(s.COMMIT_TS)).first()
        if newest is None or newest[0] is None:
            return 0
        horizon = F.lit(newest[0]) - F.expr(
            f"make_interval(0, 0, 0, 0, 0, 0, {self.tombstone_retention_hours * 3600})"
        )
        stones = DeltaTable.forPath(spark, paths.tombstones)
        stale = ~F.col(IS_TRUNCATE) & (F.col(s.COMMIT_TS) < horizon)
        count = stones.toDF().where(stale).count()
        if count:
            stones.delete(stale)
        return count


def fold_history_ends(spark: SparkSession, paths: TablePaths) -> int:
    """Write the ends the ``_history_ends`` table holds into the history's
    ``valid_to_lsn``, then delete them; returns how many there were.

    One MERGE over the history files that hold the ended versions (limited to their LSN
    range), so the files the batches did not rewrite are rewritten here, once per
    interval for many batches. Only a history row without an end takes one: the end the
    history holds wins, as in ``tables.resolved_history_sql``, so the resolved history is
    the same before, during and after a fold. A crash between the two steps leaves rows
    that are folded already: folding them again changes nothing. The delete takes every
    row: the batch writers, the only other writers of the table, do not run meanwhile.
    """
    if not DeltaTable.isDeltaTable(spark, paths.history_ends):
        return 0
    ends_table = DeltaTable.forPath(spark, paths.history_ends)
    ends = ends_table.toDF()
    bounds = ends.agg(
        F.count("*").alias("n"), F.min(s.COMMIT_LSN).alias("low"), F.max(s.COMMIT_LSN).alias("high")
    ).first()
    if bounds is None or not bounds["n"]:
        return 0
    keys = [c for c in ends.columns if c not in _POSITION_AND_END]
    lsn, end = quote(s.COMMIT_LSN), quote(s.VALID_TO)
    match = " AND ".join(
        f"t.{quote(c)} = s.{quote(c)}" for c in (*keys, s.COMMIT_LSN, s.TOTAL_ORDER)
    )
    (
        DeltaTable.forPath(spark, paths.history)
        .alias("t")
        .merge(ends.alias("s"), f"{match} AND t.{lsn} BETWEEN {bounds['low']} AND {bounds['high']}")
        .whenMatchedUpdate(condition=f"t.{end} IS NULL", set={end: f"s.{end}"})
        .execute()
    )
    # Crash tests kill the job here: the ends are in the history and still in their table.
    failpoint("consume_in_history_fold")
    ends_table.delete()
    return int(bounds["n"])
