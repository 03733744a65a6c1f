"""Quarantine of records that cannot be applied, so one bad record never stops a stream.

The dead-letter table keeps the raw key and value, the Kafka coordinates and the reason.
Rows are merged on (topic, partition, offset), which names a Kafka record uniquely, so a
replayed batch does not quarantine the same record twice.
"""

from __future__ import annotations

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spark_consumers.tables import DEAD_LETTER_SCHEMA, ensure_table

# Reason prefix of a stopped table's records (see BatchProcessor): the marker that keeps
# the table stopped after a restart.
STOPPED = "table stopped: "


def quarantine(spark: SparkSession, path: str, bad: DataFrame, batch_id: int) -> None:
    """Store ``bad`` (Kafka columns + ``_table`` + ``_reason``) in the dead-letter table."""
    ensure_table(spark, path, DEAD_LETTER_SCHEMA)
    rows = bad.select(
        F.col("_table").alias("table"),
        "topic",
        "partition",
        "offset",
        "key_text",
        "value_text",
        F.col("_reason").alias("reason"),
        F.lit(batch_id).cast("long").alias("batch_id"),
        F.current_timestamp().alias("quarantined_at"),
    )
    (
        DeltaTable.forPath(spark, path)
        .alias("t")
        .merge(
            rows.alias("s"),
            "t.topic = s.topic AND t.partition = s.partition AND t.offset = s.offset",
        )
        .whenNotMatchedInsertAll()
        .execute()
    )


def stopped_tables(spark: SparkSession, path: str) -> dict[str, str]:
    """Tables whose records are set aside since an error of their own -> that error."""
    if not DeltaTable.isDeltaTable(spark, path):
        return {}
    rows = (
        DeltaTable.forPath(spark, path)
        .toDF()
        .where(F.col("reason").startswith(STOPPED))
        .groupBy("table")
        .agg(F.min_by("reason", "offset").alias("reason"))
        .collect()
    )
    return {r["table"]: r["reason"][len(STOPPED) :] for r in rows}
