"""Raw Kafka rows -> change envelopes -> typed rows of one table, with a reason when bad.

Column values are parsed as VARIANT first rather than straight into the table's types, for
two reasons: a value that does not fit its column (or an unchanged-TOAST marker in a
numeric column) must fail *that row* with a reason instead of turning the whole record
into nulls, and JSON columns must keep their JSON text, which a string-typed parse would
unquote. Each column is then converted from its text form, so scalars and array elements
share one conversion per Spark type.

A row image (``after``, ``before``) is parsed as one VARIANT, and where its table's rows
are typed it is cast to a struct of the table's columns, each a VARIANT. The batch's parsed
records are cached, read by the survey and again by each table, and one variant a record is
less to build and to cache than a map of variants (parse, survey and typing of 200,000
inserts: 2.33 s against 2.56). The cast finds each column once among the variant's sorted
field names, where a map's lookup scanned all its keys for each column (typing 30,000
changes of 40 columns: 1.7 s against 4.8, warm). Both gave the same typed rows.

Nothing here raises on bad data: every row comes out with ``_reason`` null (good) or the
first problems found (dead letter).
"""

from __future__ import annotations

from functools import reduce
from operator import add, or_

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    DateType,
    DecimalType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
    VariantType,
)

from services.contract.records import OPS, TOAST_PLACEHOLDER, ChangeValue
from spark_consumers import schema as s
from spark_consumers.contract import spark_schema
from spark_consumers.tables import quote

# A change record as the consumer parses it: all of it but the parts of ``source`` it
# does not read.
ENVELOPE = spark_schema(
    ChangeValue,
    only={
        "source": (
            "schema",
            "table",
            "txId",
            "lsn",
            "commit_lsn",
            "ts_ms",
            "snapshot",
            "schema_version",
        )
    },
)
REASON = "_reason"
TABLE = "_table"
# A Kafka record's coordinates, and all a dead letter keeps of it.
COORDINATES = ("topic", "partition", "offset")
_NON_NUMBERS = ("NaN", "Infinity", "-Infinity")


def toast_flag(index: int) -> str:
    """Name of the column telling that source column ``index`` was unchanged TOAST."""
    return f"_toast_{index}"


def can_be_toasted(data_type: DataType) -> bool:
    """Only variable-length values are TOASTed: text-like, binary, numeric, arrays, JSON."""
    return isinstance(data_type, StringType | BinaryType | DecimalType | ArrayType)


def kafka_texts(raw: DataFrame) -> DataFrame:
    """The non-tombstone records: their ``COORDINATES``, key and value as text."""
    return raw.where(F.col("value").isNotNull()).select(
        *COORDINATES,
        F.col("key").cast("string").alias("key_text"),
        F.col("value").cast("string").alias("value_text"),
    )


def envelopes(raw: DataFrame, topic_prefix: str) -> DataFrame:
    """Parse the value of every non-tombstone record: ``COORDINATES``, ``e`` (struct) and
    ``_table``. The texts are left out: only dead letters need them (``kafka_texts``)."""
    prefix_len = len(topic_prefix) + 1
    return kafka_texts(raw).select(
        *COORDINATES,
        F.from_json("value_text", ENVELOPE).alias("e"),
        F.expr(f"substring(topic, {prefix_len + 1})").alias(TABLE),
    )


def envelope_reason(table: s.TableSchema, image: Column) -> Column:
    """Why a record of ``table``'s topic is not a usable change record (null when it is);
    ``image`` is its row image as the table's columns (null when missing or not a JSON
    object)."""
    e = F.col("e")
    op = e["op"]
    checks: list[tuple[Column, str]] = [
        (~op.isin(*OPS), "unknown op"),
        (e["source"]["commit_lsn"].isNull(), "source.commit_lsn missing"),
        (e["transaction"]["total_order"].isNull(), "transaction.total_order missing"),
        (e["source"]["schema_version"].isNull(), "source.schema_version missing"),
        # The topic may name the table mapped (services/contract/topics.py); the record has
        # its real name.
        (
            (e["source"]["schema"] != F.lit(table.schema))
            | (e["source"]["table"] != F.lit(table.table)),
            "source.schema/table does not match the topic",
        ),
        (op.isin("c", "u", "r") & image.isNull(), "after missing or not a JSON object"),
        (op.isin("d") & image.isNull(), "before missing or not a JSON object"),
    ]
    return F.when(e.isNull() | op.isNull(), F.lit("value is not a change record")).otherwise(
        _reasons(checks)
    )


def _reasons(checks: list[tuple[Column, str]]) -> Column:
    """The texts of the checks that hold, joined; empty when none does."""
    return F.concat_ws("; ", *[F.when(cond, F.lit(text)) for cond, text in checks])


def _scalar(raw: Column, data_type: DataType) -> Column:
    """Typed value from the text form; null when it does not convert."""
    if isinstance(data_type, StringType):
        return raw
    if isinstance(data_type, BinaryType):
        return F.try_to_binary(raw, F.lit("base64"))
    if isinstance(data_type, DateType | TimestampType | TimestampNTZType):
        return _datetime(raw, data_type)
    return raw.try_cast(data_type)


# PostgreSQL's infinities, stored as the extreme values of the Parquet types: what
# PostgreSQL itself stores for 'infinity', and what DuckDB reads back as infinity.
_MAX_DAYS = 2**31 - 1
_MAX_MICROS = 2**63 - 1


def _datetime(raw: Column, data_type: DataType) -> Column:
    """A date or timestamp from the bridge's text, PostgreSQL's whole range included.

    ``infinity``/``-infinity`` become the largest/smallest (bar one) value of the column's
    Parquet type; a BC value (``0044-03-15T12:00:00Z BC``) becomes its astronomical year
    (``-0043-03-15T12:00:00Z``; 1 BC is year 0), which Spark, delta-rs and DuckDB hold.
    """
    if isinstance(data_type, DateType):
        infinity = F.date_from_unix_date(F.lit(_MAX_DAYS))
        minus_infinity = F.date_from_unix_date(F.lit(-_MAX_DAYS))
    else:
        # The session time zone is UTC (job.build_session), so the cast to
        # timestamp_ntz keeps the very microseconds.
        infinity = F.timestamp_micros(F.lit(_MAX_MICROS)).cast(data_type)
        minus_infinity = F.timestamp_micros(F.lit(-_MAX_MICROS)).cast(data_type)
    year = F.regexp_extract(raw, r"^(\d+)", 1).cast("int")
    astronomical = F.concat(
        F.when(year > 1, F.lit("-")).otherwise(F.lit("")),
        F.lpad((year - 1).cast("string"), 4, "0"),
        F.regexp_extract(raw, r"^\d+(.*) BC$", 1),
    )
    text = F.when(raw.endswith(" BC"), astronomical).otherwise(raw)
    return (
        F.when(raw == "infinity", infinity)
        .when(raw == "-infinity", minus_infinity)
        .otherwise(text.try_cast(data_type))
    )


# The words of a typed row besides one per column and one per column's TOAST flag: the
# null bits and the change's op, position, LSN, transaction, commit time and schema version.
_ROW_WORDS = 8


def _row_bytes(table: s.TableSchema) -> Column:
    """About the bytes a typed row of ``table`` takes in Spark's memory (an UnsafeRow: a
    word a field, then the variable-length values): its words and the length of each text,
    binary or array value (an array by its text form)."""
    variable = [
        F.coalesce(F.octet_length(_bytes_of(F.col(quote(c.name)), c.spark_type)), F.lit(0))
        for c in table.columns
        if isinstance(c.spark_type, StringType | BinaryType | ArrayType)
    ]
    fixed = F.lit(8 * (2 * len(table.columns) + _ROW_WORDS))
    return reduce(add, variable, fixed)


def _bytes_of(value: Column, data_type: DataType) -> Column:
    """A text or binary value as it is; an array as its text form."""
    return value.cast("string") if isinstance(data_type, ArrayType) else value


def _depth_and_leaf(data_type: DataType) -> tuple[int, DataType]:
    depth, leaf = 0, data_type
    while isinstance(leaf, ArrayType):
        depth, leaf = depth + 1, leaf.elementType
    return depth, leaf


def _texts_of(data_type: DataType) -> ArrayType:
    """The array type with text leaves: how an array column's JSON is parsed first."""
    depth, _ = _depth_and_leaf(data_type)
    shape = ArrayType(StringType())
    for _ in range(depth - 1):
        shape = ArrayType(shape)
    return shape


def _convert_nested(texts: Column, data_type: DataType) -> Column:
    """Text leaves -> typed leaves, at every level of a (multi-dimensional) array."""
    if isinstance(data_type, ArrayType):
        element = data_type.elementType
        return F.transform(texts, lambda x: _convert_nested(x, element))
    return _scalar(texts, data_type)


def _flat(nested: Column, depth: int) -> Column:
    """All leaves of a ``depth``-level array in one array (null if a level is null)."""
    for _ in range(depth - 1):
        nested = F.flatten(nested)
    return nested


# The columns of the typing's steps for source column ``i`` (see ``RowTyping``).
_variant = "_variant_{}".format
_text = "_text_{}".format
_items = "_items_{}".format
_typed = "_typed_{}".format


def _image(table: s.TableSchema, op: Column, e: Column) -> Column:
    """The record's row image as the table's columns, each a variant, by exact name: a
    column the image lacks is null, one holding JSON null a variant null. An image that is
    JSON null or no object does not convert (nor one naming a column twice, which the
    parse leaves null): the record is refused with a reason."""
    names = [c.name for c in table.columns]
    names += [key for key in table.key_columns if key not in names]
    columns_of_image = StructType([StructField(name, VariantType()) for name in names])
    return F.when(op == "d", e["before"]).otherwise(e["after"]).try_cast(columns_of_image)


def _extraction_steps(table: s.TableSchema) -> list[dict[str, Column]]:
    """The steps that take each column out of the image: its variant (and whether each key
    column is missing), its text form, and an array's elements as texts."""
    columns = list(enumerate(table.columns))
    return [
        {
            **{_variant(i): F.col("_image")[c.name] for i, c in columns},
            **{
                f"_no_key_{n}": F.col("_image")[key].isNull()
                for n, key in enumerate(table.key_columns)
            },
        },
        {_text(i): F.try_variant_get(F.col(_variant(i)), "$", "string") for i, _ in columns},
        {
            _items(i): F.from_json(F.col(_text(i)), _texts_of(c.spark_type))
            for i, c in columns
            if isinstance(c.spark_type, ArrayType) and not c.is_json
        },
    ]


def _conversion_step(table: s.TableSchema, op: Column, e: Column) -> dict[str, Column]:
    """Each column's typed value (null where it does not convert) and whether it holds
    the unchanged-TOAST marker."""
    # The image's json/jsonb columns holding JSON null, which parse as SQL NULL.
    json_nulls = F.when(op == "d", e["json_nulls"]["before"]).otherwise(e["json_nulls"]["after"])
    converted: dict[str, Column] = {}
    for i, column in enumerate(table.columns):
        raw = F.col(_text(i))
        if column.is_json:
            converted[_typed(i)] = F.when(
                F.array_contains(json_nulls, F.lit(column.name)), F.lit("null")
            ).when(raw.isNotNull(), F.to_json(F.col(_variant(i))))
        elif isinstance(column.spark_type, ArrayType):
            converted[_typed(i)] = _convert_nested(F.col(_items(i)), column.spark_type)
        else:
            converted[_typed(i)] = _scalar(raw, column.spark_type)
        converted[toast_flag(i)] = (
            F.coalesce(raw == F.lit(TOAST_PLACEHOLDER), F.lit(False))
            if can_be_toasted(column.spark_type)
            else F.lit(False)
        )
    return converted


def _not_converted(i: int, column: s.Column) -> Column:
    """Whether column ``i`` held a value its type could not take (an array: an element
    lost, or nesting other than declared). NaN and infinities pass in a decimal column,
    which stores them as null."""
    raw, value = F.col(_text(i)), F.col(_typed(i))
    if column.is_json:
        return F.lit(False)
    if isinstance(column.spark_type, ArrayType):
        depth, leaf = _depth_and_leaf(column.spark_type)
        texts, kept = _flat(F.col(_items(i)), depth), _flat(value, depth)
        present = F.size(F.filter(texts, lambda x: x.isNotNull()))
        lost = F.coalesce(present != F.size(F.filter(kept, lambda x: x.isNotNull())), F.lit(True))
        failed = raw.isNotNull() & (texts.isNull() | lost)
        if isinstance(leaf, StringType):
            # A deeper value's inner arrays would pass as text elements: compare the
            # nesting itself (an empty array has none to compare).
            shape = F.expr(f"schema_of_variant(`{_variant(i)}`)")
            levels = (F.length(shape) - F.length(F.replace(shape, F.lit("ARRAY<")))) / 6
            failed = failed | (raw.isNotNull() & (F.size(texts) > 0) & (levels != depth))
        return failed
    failed = raw.isNotNull() & value.isNull()
    if isinstance(column.spark_type, DecimalType):
        failed = failed & ~raw.isin(*_NON_NUMBERS)
    return failed


class RowTyping:
    """How one table's envelopes become typed rows: source columns, TOAST flags, metadata,
    reason (``apply``). Built once per table schema and set of known versions, applied to
    every batch of that table.

    Every Spark function called from Python is a round trip to the JVM, where py4j looks
    the function up by reflection: building these expressions took about 2,400 round trips
    for a table of 4 columns and 11,000 for one of 40 (0.25 s and 0.7-1.2 s of the
    driver's time a batch, measured). They do not depend on the batch, so the job builds
    them once and only the few calls that apply them to a batch's rows are made per batch.

    The row image is ``after`` for c/u/r and ``before`` for d (the key, or the whole old
    row under REPLICA IDENTITY FULL); a truncate has none.

    Built in steps, each naming what the next uses: a value's variant, text form and typed
    form are each referenced by several checks, and Spark neither merges steps that would
    compute an expression twice nor shares expressions inside CASE branches, so written as
    one expression per output column the variant lookups and casts ran once per reference.
    NaN/Infinity in a decimal column convert to null on purpose (a Spark decimal cannot
    hold them).
    """

    def __init__(self, table: s.TableSchema, known_versions: tuple[int, ...]) -> None:
        self.table = table
        self.known_versions = known_versions
        e = F.col("e")
        op = e["op"]
        self._source = [
            *(F.col(c) for c in COORDINATES),
            e,
            F.col(TABLE),
            _image(table, op, e).alias("_image"),
        ]
        self._steps = [*_extraction_steps(table), _conversion_step(table, op, e)]
        flags = [F.col(toast_flag(i)) for i in range(len(table.columns))]
        values: list[Column] = []
        checks: list[tuple[Column, str]] = []
        for i, column in enumerate(table.columns):
            value, failed = F.col(_typed(i)), _not_converted(i, column)
            if can_be_toasted(column.spark_type):
                # An unchanged-TOAST marker is no value, and no failure: filled in later.
                marker = flags[i]
                values.append(F.when(~marker, value).alias(column.name))
                failed = ~marker & failed
            else:
                values.append(value.alias(column.name))
            checks.append(
                (
                    failed,
                    f"column {column.name}: cannot convert to {column.spark_type.simpleString()}",
                )
            )
        for n, key in enumerate(table.key_columns):
            checks.append(((op != "t") & F.col(f"_no_key_{n}"), f"key column {key} missing"))
        checks.append(
            (~e["source"]["schema_version"].isin(*known_versions), "unknown schema version")
        )
        self._typed = [
            *(F.col(c) for c in COORDINATES),
            *values,
            *flags,
            op.alias(s.OP),
            e["source"]["commit_lsn"].alias(s.COMMIT_LSN),
            e["transaction"]["total_order"].alias(s.TOTAL_ORDER),
            e["source"]["lsn"].alias(s.LSN),
            e["source"]["txId"].alias(s.TX_ID),
            F.timestamp_millis(e["source"]["ts_ms"]).alias(s.COMMIT_TS),
            e["source"]["schema_version"].alias(s.SCHEMA_VERSION),
            envelope_reason(table, F.col("_image")).alias("_envelope_reason"),
            _reasons(checks).alias("_row_reasons"),
        ]
        # Whether a typed row holds an unchanged-TOAST marker (its value is filled in later).
        self.any_toast = reduce(or_, flags, F.lit(False))
        self.row_bytes = _row_bytes(table)
        # The envelope's problems hide the row's: a record that is no change has no columns.
        self._reason = F.coalesce(
            F.nullif(F.col("_envelope_reason"), F.lit("")),
            F.nullif(F.col("_row_reasons"), F.lit("")),
        )

    def apply(self, envs: DataFrame) -> DataFrame:
        """``envs`` (``envelopes`` of this table's topic) as typed rows, ``_reason`` null
        for a good row."""
        steps = envs.select(*self._source)
        for step in self._steps:
            if step:
                steps = steps.withColumns(step)
        return (
            steps.select(*self._typed)
            .withColumn(REASON, self._reason)
            .drop("_envelope_reason", "_row_reasons")
        )
