"""Table schemas from the ``{prefix}.schema`` topic and their Spark column types.

The bridge publishes one ``TableSchemaRecord`` per table version; change records name the
version they were built with. This module keeps those versions (pure, no Spark session)
and decides, from PostgreSQL's ``format_type`` text, which Spark type a column gets:

- integer types keep their width; ``numeric(p,s)`` becomes ``decimal(p,s)`` (p <= 38);
- unconstrained ``numeric`` (and p > 38) stays an exact *string*: Spark decimals hold at most
  38 digits with a fixed scale, PostgreSQL's hold up to 131072 digits and NaN, and silently
  rounding money is worse than asking the reader to cast;
- ``timestamp`` -> TIMESTAMP_NTZ, ``timestamptz`` -> TIMESTAMP (UTC instant), ``date`` -> DATE;
- ``json``/``jsonb`` -> string holding the JSON text; ``bytea`` -> binary;
- ``x[]`` -> array of x's type, nested as many levels as the column declares
  (``int[][]``: array of arrays); anything else (time, interval, enums, inet, ...) ->
  string with PostgreSQL's text form.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from services.contract.records import GapRecord
from services.contract.topics import table_key

# Metadata columns the consumer adds; a source column of the same name cannot be stored.
OP = "_cdc_op"
COMMIT_LSN = "_cdc_commit_lsn"
TOTAL_ORDER = "_cdc_total_order"
LSN = "_cdc_lsn"
TX_ID = "_cdc_tx_id"
COMMIT_TS = "_cdc_commit_ts"
SCHEMA_VERSION = "_cdc_schema_version"
VALID_FROM = "valid_from_lsn"
VALID_TO = "valid_to_lsn"
RESERVED = frozenset(
    {OP, COMMIT_LSN, TOTAL_ORDER, LSN, TX_ID, COMMIT_TS, SCHEMA_VERSION, VALID_FROM, VALID_TO}
)

_SIMPLE: dict[str, DataType] = {
    "smallint": ShortType(),
    "integer": IntegerType(),
    "bigint": LongType(),
    "real": FloatType(),
    "double precision": DoubleType(),
    "boolean": BooleanType(),
    "date": DateType(),
    "timestamp without time zone": TimestampNTZType(),
    "timestamp with time zone": TimestampType(),
    "bytea": BinaryType(),
}
_PRECISION = re.compile(r"^\((\d+)\)$")
_NUMERIC_OID = 1700
MAX_DECIMAL_PRECISION = 38


def _strip_precision(pg_type: str) -> str:
    """``timestamp(3) with time zone`` -> ``timestamp with time zone``: precision does not
    change the Spark type, and format_type puts it in the middle of the name."""
    return re.sub(r"\(\d+\)", "", pg_type).replace("  ", " ").strip()


def numeric_precision_scale(type_modifier: int) -> tuple[int, int] | None:
    """``numeric(p,s)`` from its typmod; None when unconstrained (typmod -1)."""
    if type_modifier < 4:
        return None
    raw = type_modifier - 4
    precision, scale = (raw >> 16) & 0xFFFF, raw & 0xFFFF
    # Scale is an 11-bit signed field since PostgreSQL 15 (numeric(3,-2)).
    if scale >= 0x400:
        scale -= 0x800
    return precision, scale


def spark_type(
    pg_type: str, type_oid: int = 0, type_modifier: int = -1, dimensions: int = 1
) -> DataType:
    """The Spark type of a column from its ``format_type`` text (and numeric's typmod);
    ``dimensions``: an array column's declared ones (format_type prints ``x[]`` for all)."""
    text = pg_type.strip().lower()
    if text.endswith("[]"):
        nested = spark_type(text[:-2], 0, type_modifier)
        for _ in range(max(1, dimensions)):
            nested = ArrayType(nested, containsNull=True)
        return nested
    if text.startswith("numeric") or type_oid == _NUMERIC_OID:
        ps = numeric_precision_scale(type_modifier)
        if ps is None:
            match = re.match(r"^numeric\((\d+)(?:,\s*(-?\d+))?\)$", text)
            ps = (int(match.group(1)), int(match.group(2) or 0)) if match else None
        if ps is None or ps[0] > MAX_DECIMAL_PRECISION or ps[1] < 0 or ps[1] > ps[0]:
            return StringType()
        return DecimalType(ps[0], ps[1])
    return _SIMPLE.get(_strip_precision(text), StringType())


def is_json(pg_type: str) -> bool:
    return pg_type.strip().lower() in ("json", "jsonb")


@dataclass(frozen=True)
class Column:
    name: str
    pg_type: str
    type_oid: int
    type_modifier: int
    nullable: bool
    key: bool
    dimensions: int = 1

    @property
    def spark_type(self) -> DataType:
        return spark_type(self.pg_type, self.type_oid, self.type_modifier, self.dimensions)

    @property
    def is_json(self) -> bool:
        return is_json(self.pg_type)


@dataclass(frozen=True)
class TableSchema:
    """One version of a source table's shape, as the schema topic announced it."""

    schema: str
    table: str
    version: int
    columns: tuple[Column, ...]
    key_columns: tuple[str, ...]

    @property
    def name(self) -> str:
        """``schema.table`` as the change topic names it (the warehouse paths too)."""
        return table_key(self.schema, self.table)

    @classmethod
    def from_record(cls, value: dict[str, Any]) -> TableSchema:
        """Build from a ``TableSchemaRecord`` JSON object; KeyError/TypeError if malformed."""
        columns = tuple(
            Column(
                name=c["name"],
                pg_type=c["type"],
                type_oid=int(c["type_oid"]),
                type_modifier=int(c["type_modifier"]),
                nullable=bool(c["nullable"]),
                key=bool(c["key"]),
                dimensions=int(c.get("dimensions") or 1),
            )
            for c in value["columns"]
        )
        reserved = [c.name for c in columns if c.name in RESERVED]
        if reserved:
            raise ValueError(
                f"{value['schema']}.{value['table']}: column name(s) {reserved} "
                "collide with the consumer's metadata columns"
            )
        return cls(
            schema=value["schema"],
            table=value["table"],
            version=int(value["version"]),
            columns=columns,
            key_columns=tuple(value["key_columns"]),
        )

    def case_collisions(self) -> list[tuple[str, str]]:
        """Column names equal but for case (``x`` and ``X``): PostgreSQL keeps both, a
        Delta table cannot (its names are case-insensitive, mapped or not)."""
        seen: dict[str, str] = {}
        pairs = []
        for column in self.columns:
            other = seen.setdefault(column.name.lower(), column.name)
            if other != column.name:
                pairs.append((other, column.name))
        return pairs

    def struct(self) -> StructType:
        """Spark schema of the source columns (all nullable: old rows may lack new columns)."""
        return StructType(
            [StructField(c.name, c.spark_type, True, {"pg_type": c.pg_type}) for c in self.columns]
        )


@dataclass
class SchemaRegistry:
    """Every known version of every table, and every gap the bridge recorded (``slotbridge
    resync``: changes Kafka does not hold), filled from schema-topic record values."""

    versions: dict[str, dict[int, TableSchema]] = field(default_factory=dict)
    gaps: dict[tuple[str, int], GapRecord] = field(default_factory=dict)

    def add_records(self, values: Iterable[str | bytes | None]) -> list[str]:
        """Add schema-topic values; returns one problem line per value that is unusable."""
        problems = []
        for raw in values:
            if raw is None:
                continue  # a compaction tombstone: nothing to learn
            try:
                value = json.loads(raw)
                if "after_lsn" in value:  # a GapRecord's field, never a table version's
                    gap = GapRecord.model_validate(value)
                    self.gaps[(gap.slot, gap.after_lsn)] = gap
                    continue
                schema = TableSchema.from_record(value)
            except (ValueError, KeyError, TypeError) as exc:
                problems.append(f"unusable schema record: {exc!r}")
                continue
            self.versions.setdefault(schema.name, {})[schema.version] = schema
        return problems

    def get(self, table: str, version: int) -> TableSchema | None:
        return self.versions.get(table, {}).get(version)

    def has(self, table: str, version: int) -> bool:
        return version in self.versions.get(table, {})

    def merged(self, table: str) -> TableSchema:
        """The columns of every known version, the newest version's type and key winning.

        A Delta table keeps a column once it exists (a dropped source column is only
        absent from new records), so the target schema is the union across versions.
        """
        known = self.versions[table]
        newest = known[max(known)]
        columns: dict[str, Column] = {}
        for version in sorted(known):
            for column in known[version].columns:
                columns[column.name] = column
        ordered = [columns.pop(c.name) for c in newest.columns]
        # Dropped columns go last, in the order they first appeared.
        return TableSchema(
            newest.schema,
            newest.table,
            newest.version,
            tuple(ordered) + tuple(columns.values()),
            newest.key_columns,
        )
