"""Settings of the Spark consumer job (file + ``SLOTBRIDGE_*`` environment).

The same model serves ``slotbridge consume`` on a laptop and ``spark-submit`` on a cluster
(the Helm chart renders it into a file), so everything the job needs to find Kafka, its
tables and its checkpoint is here and nothing is read from ad-hoc environment variables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from services.common.settings import (
    HTTP_HOST,
    LOG_FORMAT,
    LOG_LEVEL,
    ServiceSettings,
    kafka_topic_name,
    qualified_tables,
    string_values,
)
from services.contract.topics import MAX_PREFIX, schema_topic, table_topic


class ConsumerSettings(ServiceSettings):
    """Where the change topics are, which tables to build, and where the Delta tables go.

    ``warehouse`` and ``checkpoint_dir`` are Hadoop paths (a local folder, ``s3a://``,
    ``abfss://`` ...). The checkpoint belongs to exactly one warehouse: pointing a
    checkpoint at another warehouse would skip the changes it already consumed.
    """

    kafka_bootstrap: str = Field(description="Kafka bootstrap servers, host:port[,host:port]")
    kafka_options: dict[str, str] = Field(
        default_factory=dict,
        description="extra Kafka client settings without the 'kafka.' prefix "
        "(security.protocol, sasl.jaas.config ...); fetch.max.wait.ms is 10 unless set here",
    )
    topic_prefix: str = Field(
        default="slotbridge", max_length=MAX_PREFIX, description="the bridge's topic_prefix"
    )
    tables: list[str] | None = Field(
        default=None,
        description="schema.table names to consume; every change topic when unset",
    )
    warehouse: str = Field(description="root path of the Delta tables")
    checkpoint_dir: str = Field(description="Structured Streaming checkpoint of this job")
    status_path: Path | None = Field(
        default=None,
        description="JSON status file rewritten after every batch",
    )
    trigger_interval_s: float = Field(
        default=10.0, ge=0, description="micro-batch interval; 0 = as fast as possible"
    )
    max_offsets_per_trigger: int | None = Field(
        default=None,
        ge=1,
        description="cap on records per micro-batch (all topics together)",
    )
    starting_offsets: Literal["earliest", "latest"] = Field(
        default="earliest",
        description="where a job without checkpoint starts",
    )
    spark_master: str | None = Field(
        default=None,
        description="e.g. local[2]; unset under spark-submit (it sets the master)",
    )
    spark_conf: dict[str, str] = Field(
        default_factory=dict,
        description="extra Spark settings for the session; they win over the job's own, so "
        "spark.driver.extraJavaOptions or spark.executor.extraJavaOptions here replaces the "
        "job's -XX:+UseParallelGC: repeat it there to keep it",
    )
    jars_dir: Path | None = Field(
        default=None,
        description="folder of the Kafka source and Delta jars (the chart's image has "
        "them in /opt/slotbridge/jars/spark; a checkout: `slotbridge stack env`); needed "
        "in local mode, optional under spark-submit (--jars / --packages bring them)",
    )
    shuffle_partitions: int | None = Field(
        default=None,
        ge=1,
        description="spark.sql.shuffle.partitions of the job's session (and Delta's "
        "snapshot partitions, and file listings' tasks); none: as many as Spark has cores "
        "once the session started (local[N]: N)",
    )
    stop_grace_s: float = Field(
        default=60.0,
        ge=0,
        description="on SIGTERM, how long a running batch may take to "
        "finish; then it is abandoned (and replayed on the next start). The Helm chart "
        "gives the pod this plus 30 s to stop the JVM",
    )
    deletion_vectors: bool = Field(
        default=False,
        description="MERGE marks the rows it replaces in deletion vectors instead of "
        "rewriting their files (much cheaper updates of big tables); every reader must "
        "then apply deletion vectors (Spark, delta-rs), a plain Parquet reader cannot",
    )
    max_rows_per_file: int = Field(
        default=1_000_000,
        ge=1,
        description="the most rows a data file the job writes holds (Spark's "
        "spark.sql.files.maxRecordsPerFile): a MERGE copies every file holding a key it "
        "changes, and without a bound a table's MERGE writes it back into as many files as "
        "Spark has cores, so a batch of a few updates copies the whole table",
    )
    stats_columns: dict[str, list[str]] = Field(
        default_factory=dict,
        description="per schema.table, source columns besides the key whose min/max Delta "
        "keeps, so that readers filtering on them skip files; the others get none (each "
        "one costs every write)",
    )
    housekeeping_interval_s: float = Field(
        default=3600.0,
        ge=0,
        description="how often the job compacts (OPTIMIZE) and "
        "vacuums its Delta tables and trims tombstones, between batches; 0 = never",
    )
    vacuum_retention_hours: float = Field(
        default=168.0,
        ge=0,
        description="VACUUM keeps the files of the versions this many "
        "hours back (time travel and slow readers need them)",
    )
    tombstone_retention_hours: float = Field(
        default=168.0,
        ge=0,
        description="a deleted key's tombstone is dropped once the "
        "table's newest change is this much later: no record older than the delete may "
        "arrive after that (Kafka's delete.retention.ms has the same meaning)",
    )
    http_host: str = HTTP_HOST
    http_port: int = Field(
        default=9189, ge=0, le=65535, description="/healthz /readyz /metrics; 0 disables the server"
    )
    log_format: Literal["json", "text"] = LOG_FORMAT
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = LOG_LEVEL

    @field_validator("warehouse", "checkpoint_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        # Delta parses a relative path such as ".stack/x" as a table name; URIs (s3a://,
        # file:/) pass through untouched.
        if "://" in value or value.startswith("file:"):
            return value
        return str(Path(value).resolve())

    _topic = field_validator("topic_prefix")(kafka_topic_name)
    _qualified = field_validator("tables")(qualified_tables)

    @field_validator("stats_columns")
    @classmethod
    def _qualified_keys(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        qualified_tables(list(value))
        return value

    _strings = field_validator("kafka_options", "spark_conf", mode="before")(string_values)

    @property
    def schema_topic(self) -> str:
        return schema_topic(self.topic_prefix)

    def change_topics(self) -> list[str] | None:
        """The change topics named by ``tables``; None means "all of this prefix"."""
        if self.tables is None:
            return None
        return [table_topic(self.topic_prefix, *name.split(".")) for name in self.tables]

    def change_topic_pattern(self) -> str:
        """Java regex of the change topics to read: those of ``tables``, or else every
        ``prefix.schema.table`` (the prefix's own topics, ``.schema``, ``.transaction``,
        ``.message``, have one segment less)."""
        topics = self.change_topics()
        if topics is not None:
            return "|".join(rf"\Q{topic}\E" for topic in topics)
        return rf"\Q{self.topic_prefix}\E\.[^.]+\.[^.]+"
