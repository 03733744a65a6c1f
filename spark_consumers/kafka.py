"""Reading the bridge's topics with Spark's Kafka source.

Everything reads with ``isolation.level=read_committed``: the bridge writes each batch of
source transactions as one Kafka transaction, and an aborted one (a crash before commit)
must never reach a table. The schema topic is read as a small batch query whenever a change
names a table version the job has not seen yet; the bridge publishes that version in the
same Kafka transaction, before the change, so a read after seeing the change finds it.
"""

from __future__ import annotations

from pyspark.sql import DataFrame, SparkSession

from spark_consumers.schema import SchemaRegistry
from spark_consumers.settings import ConsumerSettings

# How long the broker holds a fetch that finds no record (Kafka's fetch.max.wait.ms, 500 ms
# by default). A read's last offset is most often a transaction's commit marker: the
# consumer skips it, but it is no record, so the task that has read every record of a topic
# partition asks for the rest once more, and the broker holds that fetch until new records
# come: on a topic at rest (a quiet table, a backlog's last batch) the whole 500 ms, every
# batch that reads it. The reads here are of offset ranges that exist, never a wait for new
# data, so a short hold costs nothing: a batch read of 5,000 changes of a topic at rest went
# from 0.81-0.93 s to 0.31-0.33 s. The operator's ``kafka_options`` override it.
_FETCH_MAX_WAIT_MS = "10"


def kafka_options(settings: ConsumerSettings) -> dict[str, str]:
    """Options shared by every read: bootstrap, isolation level, the operator's extras."""
    options = {"kafka.fetch.max.wait.ms": _FETCH_MAX_WAIT_MS}
    options.update({f"kafka.{key}": value for key, value in settings.kafka_options.items()})
    options["kafka.bootstrap.servers"] = settings.kafka_bootstrap
    options["kafka.isolation.level"] = "read_committed"
    return options


def change_stream(spark: SparkSession, settings: ConsumerSettings) -> DataFrame:
    """The streaming DataFrame of every configured change topic (raw Kafka rows)."""
    reader = spark.readStream.format("kafka").options(**kafka_options(settings))
    # Always a pattern, also for named tables: with "subscribe" a topic that does not
    # exist yet failed the query after the client's 60 s metadata timeout; a pattern
    # subscription picks the topic up whenever the bridge creates it.
    reader = reader.option("subscribePattern", settings.change_topic_pattern())
    reader = reader.option("startingOffsets", settings.starting_offsets)
    # Topics are created by the bridge on first use; a configured table whose topic does
    # not exist yet must not fail the job, nor must compaction of deleted keys.
    reader = reader.option("failOnDataLoss", "false")
    # A topic partition is otherwise one task, and parsing and typing a batch happen before
    # any shuffle: a table with one partition would use one core of the whole job.
    reader = reader.option("minPartitions", str(spark.sparkContext.defaultParallelism))
    if settings.max_offsets_per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", str(settings.max_offsets_per_trigger))
    return reader.load()


def refresh_registry(
    spark: SparkSession, settings: ConsumerSettings, registry: SchemaRegistry
) -> list[str]:
    """Read the whole (compacted, small) schema topic into ``registry``; returns problems."""
    frame = (
        spark.read.format("kafka")
        .options(**kafka_options(settings))
        .option("subscribe", settings.schema_topic)
        .option("startingOffsets", "earliest")
        .option("endingOffsets", "latest")
        .option("failOnDataLoss", "false")
        .load()
    )
    rows = frame.selectExpr("CAST(value AS STRING) AS value").collect()
    return registry.add_records(row["value"] for row in rows)
