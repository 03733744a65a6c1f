"""Raw Kafka rows -> change envelopes -> typed rows of one table, with a reason when bad.

Column values are parsed as VARIANT first (``after map<string, variant>``) rather than
straight into the table's types, for two reasons: a value that does not fit its column (or
an unchanged-TOAST marker in a numeric column) must fail *that row* with a reason instead
of turning the whole record into nulls, and JSON columns must keep their JSON text, which
a string-typed parse would unquote. Each column is then converted from its text form, so
scalars and array elements share one conversion per Spark type.

Nothing here raises on bad data: every row comes out with ``_reason`` null (good) or the
first problems found (dead letter).
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    DecimalType,
    StringType,
)

from services.bridge.records import UNCHANGED_TOAST
from spark_consumers import schema as s

ENVELOPE = (
    "before map<string,variant>, after map<string,variant>, "
    "source struct<schema:string,table:string,txId:bigint,lsn:bigint,commit_lsn:bigint,"
    "ts_ms:bigint,snapshot:string,schema_version:int>, op string, ts_ms bigint, "
    "transaction struct<id:string,total_order:bigint,data_collection_order:bigint>"
)
REASON = "_reason"
TABLE = "_table"
# Kafka coordinates carried to the dead-letter table.
KAFKA_COLUMNS = ("topic", "partition", "offset", "key_text", "value_text")
_NON_NUMBERS = ("NaN", "Infinity", "-Infinity")


def toast_flag(index: int) -> str:
    """Name of the column telling that source column ``index`` was unchanged TOAST."""
    return f"_toast_{index}"


def can_be_toasted(data_type: DataType) -> bool:
    """Only variable-length values are TOASTed: text-like, binary, numeric, arrays, JSON."""
    return isinstance(data_type, StringType | BinaryType | DecimalType | ArrayType)


def envelopes(raw: DataFrame, topic_prefix: str) -> DataFrame:
    """Parse the value of every non-tombstone record; adds ``e`` (struct) and ``_table``."""
    prefix_len = len(topic_prefix) + 1
    return (
        raw.where(F.col("value").isNotNull())
        .select(
            "topic", "partition", "offset",
            F.col("key").cast("string").alias("key_text"),
            F.col("value").cast("string").alias("value_text"),
        )
        .withColumn("e", F.from_json("value_text", ENVELOPE))
        .withColumn(TABLE, F.expr(f"substring(topic, {prefix_len + 1})"))
    )


def envelope_reason() -> Column:
    """Why a record is not a usable change record at all (null when it is)."""
    e = F.col("e")
    op = e["op"]
    checks: list[tuple[Column, str]] = [
        (~op.isin("c", "u", "d", "r", "t"), "unknown op"),
        (e["source"]["commit_lsn"].isNull(), "source.commit_lsn missing"),
        (e["transaction"]["total_order"].isNull(), "transaction.total_order missing"),
        (e["source"]["schema_version"].isNull(), "source.schema_version missing"),
        (F.concat_ws(".", e["source"]["schema"], e["source"]["table"]) != F.col(TABLE),
         "source.schema/table does not match the topic"),
        (op.isin("c", "u", "r") & e["after"].isNull(), "after missing"),
        (op.isin("d") & e["before"].isNull(), "before missing"),
    ]
    return F.when(e.isNull() | op.isNull(), F.lit("value is not a change record")).otherwise(
        _first_reasons(checks))


def _first_reasons(checks: list[tuple[Column, str]]) -> Column:
    parts = [F.when(cond, F.lit(text)) for cond, text in checks]
    return F.nullif(F.concat_ws("; ", *parts), F.lit(""))


def _scalar(raw: Column, data_type: DataType) -> Column:
    """Typed value from the text form; null when it does not convert."""
    if isinstance(data_type, StringType):
        return raw
    if isinstance(data_type, BinaryType):
        return F.try_to_binary(raw, F.lit("base64"))
    return raw.try_cast(data_type)


def _converter(data_type: DataType, json_text: bool) -> tuple[
        Callable[[Column, Column], Column], Callable[[Column, Column], Column]]:
    """(convert, failed) for one column type: both take (variant, text form).

    ``failed`` is true when a present value did not convert. NaN/Infinity in a decimal
    column convert to null on purpose (a Spark decimal cannot hold them).
    """
    if json_text:
        return (lambda v, raw: F.when(raw.isNotNull(), F.to_json(v)),
                lambda v, raw: F.lit(False))
    if isinstance(data_type, ArrayType):
        element = data_type.elementType

        def convert(v: Column, raw: Column) -> Column:
            texts = F.from_json(raw, ArrayType(StringType()))
            return F.transform(texts, lambda x: _scalar(x, element))

        def failed(v: Column, raw: Column) -> Column:
            texts = F.from_json(raw, ArrayType(StringType()))
            typed = convert(v, raw)
            present = F.size(F.filter(texts, lambda x: x.isNotNull()))
            converted = F.size(F.filter(typed, lambda x: x.isNotNull()))
            return raw.isNotNull() & (texts.isNull() | (present != converted))
        return convert, failed

    def convert_scalar(v: Column, raw: Column) -> Column:
        return _scalar(raw, data_type)

    def failed_scalar(v: Column, raw: Column) -> Column:
        bad = raw.isNotNull() & convert_scalar(v, raw).isNull()
        if isinstance(data_type, DecimalType):
            bad = bad & ~raw.isin(*_NON_NUMBERS)
        return bad
    return convert_scalar, failed_scalar


def typed_rows(envs: DataFrame, table: s.TableSchema, known_versions: list[int]) -> DataFrame:
    """One table's envelopes as typed rows: source columns, TOAST flags, metadata, reason.

    The row image is ``after`` for c/u/r and ``before`` for d (the key, or the whole old row
    under REPLICA IDENTITY FULL); a truncate has none.
    """
    e = F.col("e")
    op = e["op"]
    image = F.when(op == "d", e["before"]).otherwise(e["after"])
    values: list[Column] = []
    flags: list[Column] = []
    checks: list[tuple[Column, str]] = []
    for index, column in enumerate(table.columns):
        data_type = column.spark_type
        v = F.try_element_at(image, F.lit(column.name))
        raw = F.try_variant_get(v, "$", "string")
        convert, failed = _converter(data_type, column.is_json)
        if can_be_toasted(data_type):
            marker = F.coalesce(raw == F.lit(UNCHANGED_TOAST), F.lit(False))
            flags.append(marker.alias(toast_flag(index)))
            values.append(F.when(~marker, convert(v, raw)).alias(column.name))
            bad = ~marker & failed(v, raw)
        else:
            flags.append(F.lit(False).alias(toast_flag(index)))
            values.append(convert(v, raw).alias(column.name))
            bad = failed(v, raw)
        checks.append((bad, f"column {column.name}: cannot convert to {data_type.simpleString()}"))
    for key in table.key_columns:
        checks.append(((op != "t") & F.try_element_at(image, F.lit(key)).isNull(),
                       f"key column {key} missing"))
    checks.append((~e["source"]["schema_version"].isin(*known_versions),
                   "unknown schema version"))
    reason = F.coalesce(envelope_reason(), _first_reasons(checks))
    return envs.select(
        *KAFKA_COLUMNS,
        *values,
        *flags,
        op.alias(s.OP),
        e["source"]["commit_lsn"].alias(s.COMMIT_LSN),
        e["transaction"]["total_order"].alias(s.TOTAL_ORDER),
        e["source"]["lsn"].alias(s.LSN),
        e["source"]["txId"].alias(s.TX_ID),
        F.timestamp_millis(e["source"]["ts_ms"]).alias(s.COMMIT_TS),
        e["source"]["schema_version"].alias(s.SCHEMA_VERSION),
        reason.alias(REASON),
    )
