"""Where the Delta tables live, what columns they have, and how they grow.

Per source table ``schema.table`` under the warehouse:

    current/schema.table      one row per live key: the source columns + position
    history/schema.table      every change, SCD type 2 validity, op and source metadata
    _history_ends/schema.table  the ends of stored history versions not yet written into
                              the history (see ``resolved_history_sql``); folded into it by
                              housekeeping
    _tombstones/schema.table  internal: position of each deleted key and of the last
                              truncate, so a late older record cannot resurrect a row;
                              appended (a key may have several), trimmed by housekeeping
    _dead_letter              records that could not be applied, with the reason
    _gaps                     changes Kafka does not hold, as ``slotbridge resync``
                              recorded them (see gaps.py)

Tables are created on first use and only ever gain columns (``ALTER TABLE ADD COLUMNS``):
Delta cannot drop or retype a column without rewriting it, so a dropped source column stays
(null in new rows) and a retyped one keeps its first Delta type (values are cast to it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from delta.tables import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DateType,
    IntegerType,
    LongType,
    NumericType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from services.common.logs import log_event
from spark_consumers import schema as s

log = logging.getLogger("slotbridge.consume")

_POSITION = [StructField(s.COMMIT_LSN, LongType()), StructField(s.TOTAL_ORDER, LongType())]
_HISTORY_META = [
    StructField(s.OP, StringType()),
    *_POSITION,
    StructField(s.LSN, LongType()),
    StructField(s.TX_ID, LongType()),
    StructField(s.COMMIT_TS, TimestampType()),
    StructField(s.SCHEMA_VERSION, IntegerType()),
    StructField(s.VALID_FROM, LongType()),
    StructField(s.VALID_TO, LongType()),
]
DEAD_LETTER_SCHEMA = StructType(
    [
        StructField("table", StringType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("key_text", StringType()),
        StructField("value_text", StringType()),
        StructField("reason", StringType()),
        StructField("batch_id", LongType()),
        StructField("quarantined_at", TimestampType()),
    ]
)
GAPS_SCHEMA = StructType(
    [
        StructField("slot", StringType()),
        StructField("kind", StringType()),
        StructField("after_lsn", LongType()),
        StructField("reason", StringType()),
        StructField("tables", ArrayType(StringType())),
        StructField("recorded_at", TimestampType()),
        StructField("noticed_at", TimestampType()),
    ]
)
IS_TRUNCATE = "_cdc_truncate"


@dataclass(frozen=True)
class TablePaths:
    current: str
    history: str
    history_ends: str
    tombstones: str


def table_paths(warehouse: str, table: str) -> TablePaths:
    root = warehouse.rstrip("/")
    return TablePaths(
        current=f"{root}/current/{table}",
        history=f"{root}/history/{table}",
        history_ends=f"{root}/_history_ends/{table}",
        tombstones=f"{root}/_tombstones/{table}",
    )


def dead_letter_path(warehouse: str) -> str:
    return f"{warehouse.rstrip('/')}/_dead_letter"


def gaps_path(warehouse: str) -> str:
    return f"{warehouse.rstrip('/')}/_gaps"


def current_struct(table: s.TableSchema) -> StructType:
    return StructType([*table.struct().fields, *_POSITION])


def history_struct(table: s.TableSchema) -> StructType:
    return StructType([*table.struct().fields, *_HISTORY_META])


def history_ends_struct(table: s.TableSchema) -> StructType:
    """A stored version's key and start position, and where it ends."""
    keys = [f for f in table.struct().fields if f.name in table.key_columns]
    return StructType([*keys, *_POSITION, StructField(s.VALID_TO, LongType())])


_END_COLUMNS = (s.COMMIT_LSN, s.TOTAL_ORDER, s.VALID_TO)


def resolved_history_sql(
    history_columns: Sequence[str],
    ends_columns: Sequence[str],
    history: str = "history",
    ends: str = "history_ends",
    quote_char: str = "`",
) -> str:
    """SQL for the exact history: the history table with each version's end taken from the
    ``_history_ends`` table where the history does not hold it yet.

    A batch ends the stored versions of the keys it changes with rows in the small ends
    table instead of rewriting the history's files; housekeeping later writes them into
    the history and deletes them. The end the history holds wins: a version is closed in
    the history only by a change or truncate known then, and an end written later (a late
    record, which takes the MERGE path) is never later than the one in the ends table.
    An end counts only once the history holds the change it ends at (the key's change at
    that commit LSN): a batch writes its ends, then its changes, two Delta commits, and a
    reader between them would otherwise see those keys' versions closed with nothing
    after them, as if deleted. So a reader sees a batch whole or not at all.
    The same text serves Spark (``quote_char`` a backtick; ``history``/``ends`` such as
    ``delta.`<path>```), DuckDB and delta-rs's ``QueryBuilder`` (``quote_char='"'``, the
    names their tables are registered under). The ends table's columns other than the
    position and ``valid_to_lsn`` are the source table's key.
    """

    def q(name: str) -> str:
        return quote_char + name.replace(quote_char, quote_char * 2) + quote_char

    keys = [c for c in ends_columns if c not in _END_COLUMNS]
    columns = ", ".join(
        f"COALESCE(h.{q(c)}, e.{q(c)}) AS {q(c)}" if c == s.VALID_TO else f"h.{q(c)}"
        for c in history_columns
    )
    match = " AND ".join(f"h.{q(c)} = e.{q(c)}" for c in (*keys, s.COMMIT_LSN, s.TOTAL_ORDER))
    successor = " AND ".join(
        [*(f"n.{q(k)} = x.{q(k)}" for k in keys), f"n.{q(s.COMMIT_LSN)} = x.{q(s.VALID_TO)}"]
    )
    visible = f"SELECT * FROM {ends} x WHERE EXISTS (SELECT 1 FROM {history} n WHERE {successor})"
    return f"SELECT {columns} FROM {history} h LEFT JOIN ({visible}) e ON {match}"


def resolved_history(spark: SparkSession, paths: TablePaths) -> DataFrame:
    """The exact history of one table in Spark (``resolved_history_sql``); the history
    table alone for a table without a key (it has no ends table)."""
    history = spark.read.format("delta").load(paths.history)
    if not DeltaTable.isDeltaTable(spark, paths.history_ends):
        return history
    ends = spark.read.format("delta").load(paths.history_ends)
    return spark.sql(
        resolved_history_sql(
            history.columns,
            ends.columns,
            f"delta.{quote(paths.history)}",
            f"delta.{quote(paths.history_ends)}",
        )
    )


def tombstone_struct(table: s.TableSchema) -> StructType:
    keys = [f for f in table.struct().fields if f.name in table.key_columns]
    # The commit time says when a tombstone may be trimmed (housekeeping.py).
    return StructType(
        [
            *keys,
            *_POSITION,
            StructField(s.COMMIT_TS, TimestampType()),
            StructField(IS_TRUNCATE, BooleanType()),
        ]
    )


# Characters Delta refuses in column names unless the table maps names to physical ones.
_UNMAPPED_INVALID = frozenset(" ,;{}()\n\t=")
# Column mapping by name: reader version 2, writer version 5 (Delta protocol).
_COLUMN_MAPPING = {
    "delta.columnMapping.mode": "name",
    "delta.minReaderVersion": "2",
    "delta.minWriterVersion": "5",
}

_DV_KEY = "delta.enableDeletionVectors"
_DV = {_DV_KEY: "true"}
_STATS_KEY = "delta.dataSkippingStatsColumns"
# The consumer's own reads skip files by these columns (and the key): a batch's LSN range,
# the open history versions (``valid_to_lsn``), housekeeping's tombstone trim (commit time).
_SKIPPED_BY = (s.COMMIT_LSN, s.TOTAL_ORDER, s.VALID_TO, s.COMMIT_TS)


def _has_min_max(data_type: DataType) -> bool:
    """Delta keeps min/max statistics of these types only (and refuses the others in
    ``delta.dataSkippingStatsColumns``)."""
    return isinstance(
        data_type, NumericType | StringType | DateType | TimestampType | TimestampNTZType
    )


def stats_columns(table: s.TableSchema, extra: Sequence[str] = ()) -> frozenset[str]:
    """The columns one of ``table``'s Delta tables keeps min/max statistics of, where it
    has them (``ensure_table``): its key, the change position, and the ``extra`` source
    columns the operator named.

    Delta's default is the first 32 columns, computed for every row written and every
    file: most of a write's statistics work went to source columns no read of the
    consumer skips by, and in a table of more than 32 columns the position columns, which
    it does skip by, came after them and had none.
    """
    return frozenset({*table.key_columns, *_SKIPPED_BY, *extra})


def _stats_property(struct: StructType, stats: frozenset[str]) -> str:
    """``delta.dataSkippingStatsColumns``: the ``stats`` columns of ``struct`` whose type
    Delta keeps min/max of, in the table's order."""
    return ",".join(
        quote(f.name) for f in struct.fields if f.name in stats and _has_min_max(f.dataType)
    )


def needs_column_mapping(struct: StructType) -> bool:
    """A PostgreSQL column name (``"Mixed Case"``, ``"a=b"``) Delta only stores mapped."""
    return any(_UNMAPPED_INVALID & set(f.name) for f in struct.fields)


def ensure_table(
    spark: SparkSession,
    path: str,
    wanted: StructType,
    deletion_vectors: bool = False,
    stats: frozenset[str] | None = None,
) -> StructType:
    """Create the Delta table or add the columns it lacks; returns its schema afterwards.

    Only a table that needs it gets column mapping: its Parquet files then hold
    physical column names, which readers without Delta support cannot interpret.
    ``deletion_vectors`` turns them on (also on an existing table): a MERGE then marks
    the rows it replaces instead of rewriting their files, and readers must apply them.
    ``stats``: the columns Delta keeps statistics of where the table has them
    (``stats_columns``; None: Delta's default), also set on an existing table once its
    columns are added (its older files keep the statistics they have).
    """
    mapped = needs_column_mapping(wanted)
    properties = {
        **(_COLUMN_MAPPING if mapped else {}),
        **(_DV if deletion_vectors else {}),
        **({_STATS_KEY: _stats_property(wanted, stats)} if stats is not None else {}),
    }
    if not DeltaTable.isDeltaTable(spark, path):
        builder = DeltaTable.createIfNotExists(spark).location(path).addColumns(wanted)
        for key, value in properties.items():
            builder = builder.property(key, value)
        builder.execute()
        log_event(
            log,
            logging.INFO,
            "created delta table",
            path=path,
            columns=len(wanted.fields),
            column_mapping=mapped,
        )
        return wanted
    table = DeltaTable.forPath(spark, path)
    detail = table.detail().first()
    assert detail is not None  # a Delta table's detail is one row
    if mapped and detail["properties"].get("delta.columnMapping.mode", "none") == "none":
        settings = ", ".join(f"'{k}' = '{v}'" for k, v in _COLUMN_MAPPING.items())
        spark.sql(f"ALTER TABLE delta.{quote(path)} SET TBLPROPERTIES ({settings})")
        log_event(log, logging.INFO, "column mapping enabled", path=path)
    if deletion_vectors and detail["properties"].get(_DV_KEY) != "true":
        spark.sql(f"ALTER TABLE delta.{quote(path)} SET TBLPROPERTIES ('{_DV_KEY}' = 'true')")
        log_event(log, logging.INFO, "deletion vectors enabled", path=path)
    existing = table.toDF().schema
    have = {f.name: f.dataType for f in existing.fields}
    missing = [f for f in wanted.fields if f.name not in have]
    for field in wanted.fields:
        if field.name in have and have[field.name] != field.dataType:
            log_event(
                log,
                logging.WARNING,
                "column type changed at the source; keeping the delta type",
                path=path,
                column=field.name,
                delta_type=have[field.name].simpleString(),
                source_type=field.dataType.simpleString(),
            )
    if missing:
        ddl = ", ".join(f"{quote(f.name)} {f.dataType.simpleString()}" for f in missing)
        spark.sql(f"ALTER TABLE delta.{quote(path)} ADD COLUMNS ({ddl})")
        log_event(log, logging.INFO, "added columns", path=path, columns=[f.name for f in missing])
        existing = DeltaTable.forPath(spark, path).toDF().schema
    # After the new columns: the setting may name them. The table's own types decide (a
    # retyped source column keeps its first Delta type).
    chosen = None if stats is None else _stats_property(existing, stats)
    if chosen is not None and detail["properties"].get(_STATS_KEY) != chosen:
        setting = f"'{_STATS_KEY}' = {_literal(chosen)}"
        spark.sql(f"ALTER TABLE delta.{quote(path)} SET TBLPROPERTIES ({setting})")
        log_event(log, logging.INFO, "statistics columns set", path=path, columns=chosen)
    return existing


def _literal(text: str) -> str:
    """A Spark SQL string literal (column names may hold quotes and backslashes)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def quote(name: str) -> str:
    """A SQL identifier in backticks (column names may hold anything PostgreSQL allows)."""
    return "`" + name.replace("`", "``") + "`"
