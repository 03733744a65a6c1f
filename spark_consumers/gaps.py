"""Gaps in what the bridge published, kept in the warehouse's ``_gaps`` table.

``slotbridge resync`` writes a ``GapRecord`` on the schema topic when the source lost
changes (an invalidated or dropped slot: kind ``source``) or Kafka lost a topic (kind
``topic``), then publishes every table again through a snapshot. The tables converge on the
source's current state, but what happened in between is not in the history table, and a row
deleted at the source during a source gap has no delete record: its row stays in the
current-state table with a position (``_cdc_commit_lsn``) at or below the gap's ``after_lsn``,
while every row the resync snapshot published again has a later one. A reader needs the gap
to tell those apart, so the consumer keeps each gap it reads in a table of its own (one row
per gap, merged on slot and ``after_lsn``, so a replayed batch adds nothing) and logs it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, datetime

from delta.tables import DeltaTable
from pyspark.sql import SparkSession

from services.common.logs import log_event
from services.contract.records import GapRecord
from spark_consumers.tables import GAPS_SCHEMA, ensure_table

log = logging.getLogger("slotbridge.consume")

# Spark's Kafka source keeps offsets by topic name: in a topic created again they point
# past records it never read, which it skips with a warning (failOnDataLoss is off).
_TOPIC_GAP = (
    "; a topic was created again, so this job's offsets for it are stale: start the "
    "consumer with a new checkpoint_dir (it reads every topic again, and the tables come "
    "out the same)"
)


def record_gaps(spark: SparkSession, path: str, gaps: Iterable[GapRecord]) -> None:
    """Store ``gaps`` in the ``_gaps`` table at ``path``, once each, with a WARNING line
    for every gap the table did not hold yet."""
    ensure_table(spark, path, GAPS_SCHEMA)
    stored = {
        (row["slot"], row["after_lsn"])
        for row in DeltaTable.forPath(spark, path).toDF().select("slot", "after_lsn").collect()
    }
    new = [g for g in gaps if (g.slot, g.after_lsn) not in stored]
    if not new:
        return
    now = datetime.now(UTC)
    rows = [
        (
            g.slot,
            g.kind,
            g.after_lsn,
            g.reason,
            g.tables,
            datetime.fromtimestamp(g.ts_ms / 1000, UTC),
            now,
        )
        for g in new
    ]
    spark.createDataFrame(rows, GAPS_SCHEMA).write.format("delta").mode("append").save(path)
    for gap in new:
        log_event(
            log,
            logging.WARNING,
            "gap recorded: Kafka lacks changes of these tables, and the bridge publishes "
            "them again (the _gaps table says how to find the rows the gap leaves behind)"
            + _TOPIC_GAP
            * (gap.kind == "topic"),
            slot=gap.slot,
            kind=gap.kind,
            after_lsn=gap.after_lsn,
            reason=gap.reason,
            tables=gap.tables,
            table=path,
        )
