"""Text-format column values -> Kafka Connect JSON values, as Debezium's PostgreSQL connector
writes them with its defaults through Connect's ``JsonConverter`` (``schemas.enable=true``).

The Debezium record format (``value_format: debezium``) uses this table instead of
``values.py``: per column a Connect schema (the ``{"type": ..., "name": ...}`` object of the
record's ``schema`` block) and a converter from the server's text to the value that schema
describes. The defaults it follows: ``decimal.handling.mode=precise`` (numeric as
``org.apache.kafka.connect.data.Decimal`` bytes, numeric without a fixed scale as
``io.debezium.data.VariableScaleDecimal``), ``time.precision.mode=adaptive`` (a time or
timestamp of precision 0-3 in milliseconds, else microseconds), ``interval.handling.mode=
numeric`` (``MicroDuration``), ``binary.handling.mode=bytes`` (base64 in JSON).

Every expected value here was read off records the real connector (Debezium 3.7.0.Final
in Kafka Connect 4.3.1) wrote for the same rows; ``tests/integration/
test_debezium_format.py`` compares the two field by field.

Types Debezium has no mapping for (``include.unknown.datatypes=false`` leaves such a column
out of its records: interval[], money[], point[], xml[], name[], bit varying[], and any type
it cannot resolve) are published as an optional plain string holding the server's text,
so no column is silently lost; a Debezium consumer sees one more optional string field.

Pure: no I/O; a converter raises ``ValueError`` on text its type cannot print.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
import struct
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from services.bridge.records.values import (
    ARRAY_ELEMENT,
    ArrayOf,
    Converter,
    JsonValue,
    bool_from_text,
    bytea_base64,
    float_or_text,
    money_decimal,
)
from services.contract.records import TOAST_PLACEHOLDER

Schema = dict[str, Any]

_DAYS_PER_MONTH_AVG = 30.4375  # MicroDuration.DAYS_PER_MONTH_AVG (365.25 / 12)
_US_PER_DAY = 86_400_000_000
# What the connector printed for the server's infinite values (pgjdbc's stand-ins).
_DATE_INFINITY = 2_146_033_979
_LONG_MAX = 9_223_372_036_854_775_807


def _bytes(n: int) -> str:
    """An integer as Java's ``BigInteger.toByteArray()`` (minimal two's complement,
    big-endian), base64: how Connect's Decimal travels in JSON."""
    size = (n if n >= 0 else ~n).bit_length() // 8 + 1
    return base64.b64encode(n.to_bytes(size, "big", signed=True)).decode("ascii")


def _unscaled(text: str, scale: int) -> int | None:
    """The unscaled integer of a decimal text at ``scale`` digits; None for NaN/Infinity,
    which a Connect Decimal cannot hold (the connector logs a warning and writes null)."""
    if text[-1] not in "0123456789":
        return None
    whole, _, frac = text.partition(".")
    if len(frac) > scale:
        raise ValueError(f"numeric {text!r} has more than {scale} fraction digits")
    return int(whole + frac.ljust(scale, "0"))


@functools.cache  # one converter per scale: the compiled kinds know it (COMPILED_KINDS)
def _decimal(scale: int) -> Converter:
    def convert(text: str) -> JsonValue:
        n = _unscaled(text, scale)
        return None if n is None else _bytes(n)

    COMPILED_KINDS[convert] = (b"D", scale)
    return convert


def _variable_decimal(text: str) -> JsonValue:
    # BigDecimal.stripTrailingZeros(), then a negative scale back to 0: 100 -> scale 0.
    if text[-1] not in "0123456789":
        return None
    whole, _, frac = text.partition(".")
    frac = frac.rstrip("0")
    return {"scale": len(frac), "value": _bytes(int(whole + frac))}


def _money(text: str) -> JsonValue:
    # Scale 2: the connector's money.fraction.digits default, lc_monetary=C's too.
    return _bytes(_unscaled(str(money_decimal(text)), 2) or 0)


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 in the proleptic Gregorian calendar (astronomical years), as
    Java's ``LocalDate.toEpochDay``; Python's ``date`` stops at year 1."""
    year -= month <= 2
    era = year // 400
    yoe = year - era * 400
    doy = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    return era * 146_097 + yoe * 365 + yoe // 4 - yoe // 100 + doy - 719_468


def _date_days(text: str) -> int:
    if text.endswith(" BC"):
        y, m, d = text[:-3].split("-")
        return _days_from_civil(1 - int(y), int(m), int(d))
    y, m, d = text.split("-")
    return _days_from_civil(int(y), int(m), int(d))


def _date(text: str) -> JsonValue:
    if text == "infinity":
        return _DATE_INFINITY
    if text == "-infinity":
        return -_DATE_INFINITY
    return _date_days(text)


def _time_micros(text: str) -> int:
    """'HH:MM:SS[.ffffff]' -> microseconds of the day (24:00:00 included)."""
    hms, _, frac = text.partition(".")
    h, mi, s = hms.split(":")
    return ((int(h) * 60 + int(mi)) * 60 + int(s)) * 1_000_000 + int(frac.ljust(6, "0") or 0)


def _micro_time(text: str) -> JsonValue:
    return _time_micros(text)


def _milli_time(text: str) -> JsonValue:
    return _time_micros(text) // 1000


def _timestamp_micros(text: str) -> int:
    day, _, clock = text.partition(" ")
    if clock.endswith(" BC"):
        clock = clock[:-3]
        y, m, d = day.split("-")
        days = _days_from_civil(1 - int(y), int(m), int(d))
    else:
        days = _date_days(day)
    return days * _US_PER_DAY + _time_micros(clock)


def _micro_timestamp(text: str) -> JsonValue:
    if text == "infinity":
        return _LONG_MAX
    if text == "-infinity":
        return -_LONG_MAX - 1
    return _timestamp_micros(text)


def _milli_timestamp(text: str) -> JsonValue:
    if text == "infinity":
        return _LONG_MAX
    if text == "-infinity":
        return -_LONG_MAX - 1
    return _timestamp_micros(text) // 1000


_OFFSET = re.compile(r"([+-])(\d{2})(?::?(\d{2}))?(?::?(\d{2}))?$")


def _split_offset(text: str) -> tuple[str, int]:
    """'... +05:30' -> (the part before, the offset in seconds)."""
    match = _OFFSET.search(text)
    if match is None:
        raise ValueError(f"no UTC offset in {text!r}")
    sign, h, m, s = match.groups()
    seconds = int(h) * 3600 + int(m or 0) * 60 + int(s or 0)
    return text[: match.start()], -seconds if sign == "-" else seconds


def _iso_clock(micros_of_day: int, width: int | None) -> str:
    """HH:mm:ss plus a fraction: ``width`` digits, or (None) Java's ISO formatters' minimal
    fraction, none at all for a whole second."""
    seconds, micros = divmod(micros_of_day, 1_000_000)
    minutes, s = divmod(seconds, 60)
    h, mi = divmod(minutes, 60)
    clock = f"{h:02d}:{mi:02d}:{s:02d}"
    if width is None:
        return clock + (f".{micros:06d}".rstrip("0") if micros else "")
    return clock + (f".{micros:06d}"[: width + 1] if width else "")


def _zoned_time(text: str) -> JsonValue:
    # Moved to UTC (the day wraps), printed as DateTimeFormatter.ISO_OFFSET_TIME does.
    clock, offset = _split_offset(text)
    micros = (_time_micros(clock) - offset * 1_000_000) % _US_PER_DAY
    return _iso_clock(micros, None) + "Z"


@functools.cache  # one converter per width: the compiled kinds know it (COMPILED_KINDS)
def _zoned_timestamp(width: int) -> Converter:
    """timestamptz -> ISO 8601 in UTC with exactly ``width`` fraction digits (the column's
    precision; ISO_OFFSET_DATE_TIME's minimal fraction for precision 0).

    The usual value (years 1-9999 both as written and in UTC) goes through ``datetime``,
    whose parsing and arithmetic are C: a sixth of the time of the exact path, which takes
    every other value (BC, beyond 9999, infinity) and is the reference the tests hold this
    one to."""
    exact = _zoned_timestamp_exact(width)

    def convert(text: str) -> JsonValue:
        try:
            moment = datetime.fromisoformat(text).astimezone(UTC)
        except (ValueError, OverflowError):
            return exact(text)
        iso = moment.isoformat(timespec="microseconds")  # ...T01:04:05.123000+00:00
        if width:
            return iso[: 20 + width] + "Z"
        fraction = iso[19:26].rstrip("0")
        return iso[:19] + (fraction if fraction != "." else "") + "Z"

    COMPILED_KINDS[convert] = (b"Z", width)
    return convert


def _zoned_timestamp_exact(width: int) -> Converter:
    """``_zoned_timestamp`` by integer arithmetic on the text, for any value PostgreSQL
    prints (BC years, years past 9999, infinity)."""
    digits = width or None

    def convert(text: str) -> JsonValue:
        if text.endswith("infinity"):
            return text
        bc = text.endswith(" BC")
        body, offset = _split_offset(text[:-3] if bc else text)
        day, _, clock = body.partition(" ")
        y, m, d = day.split("-")
        year = 1 - int(y) if bc else int(y)
        micros = (
            _days_from_civil(year, int(m), int(d)) * _US_PER_DAY
            + _time_micros(clock)
            - offset * 1_000_000
        )
        days, of_day = divmod(micros, _US_PER_DAY)
        return f"{_civil_from_days(days)}T{_iso_clock(of_day, digits)}Z"

    return convert


def _civil_from_days(days: int) -> str:
    """Inverse of ``_days_from_civil``, printed as ISO_LOCAL_DATE does (year -0043, +10000)."""
    days += 719_468
    era = days // 146_097
    doe = days - era * 146_097
    yoe = (doe - doe // 1460 + doe // 36_524 - doe // 146_096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    day = doy - (153 * mp + 2) // 5 + 1
    month = mp + (3 if mp < 10 else -9)
    year = yoe + era * 400 + (month <= 2)
    if year < 0:
        return f"-{-year:04d}-{month:02d}-{day:02d}"
    return f"{'+' if year > 9999 else ''}{year:04d}-{month:02d}-{day:02d}"


_ISO_INTERVAL = re.compile(
    r"P(?:(-?\d+)Y)?(?:(-?\d+)M)?(?:(-?\d+)D)?"
    r"(?:T(?:(-?\d+)H)?(?:(-?\d+)M)?(?:(-?[\d.]+)S)?)?"
)


def _micro_duration(text: str) -> JsonValue:
    """An interval (IntervalStyle iso_8601) -> MicroDuration, with the connector's own
    double arithmetic: a month is 30.4375 days."""
    match = _ISO_INTERVAL.fullmatch(text)
    if match is None:
        raise ValueError(f"not an ISO 8601 interval: {text!r}")
    y, mo, d, h, mi, s = match.groups()
    days = (int(y or 0) * 12 + int(mo or 0)) * _DAYS_PER_MONTH_AVG + int(d or 0)
    seconds = ((days * 24 + int(h or 0)) * 60 + int(mi or 0)) * 60 + float(s or 0)
    return int(seconds * 1e6)


def _point(text: str) -> JsonValue:
    x_text, _, y_text = text.strip("()").partition(",")
    x, y = float(x_text), float(y_text)
    # WKB, little-endian, type 1 (Point): what io.debezium.data.geometry.Point carries.
    wkb = base64.b64encode(struct.pack("<BIdd", 1, 1, x, y)).decode("ascii")
    return {"x": x, "y": y, "wkb": wkb, "srid": None}


# How the compiled row builder (catalog.row_plan, _rowjson.c) writes these converters'
# values: its kind and the kind's parameter (a scale, fraction digits). Keyed by the
# converter itself, so the two cannot disagree on a type; the builder calls the converter
# for any text its kind does not read (infinity, BC, NaN, longer numbers), so this module
# stays the reference, which tests/unit/test_rowjson.py holds the builder to.
COMPILED_KINDS: dict[Converter, tuple[bytes, int]] = {
    _variable_decimal: (b"V", 0),
    _micro_timestamp: (b"M", 0),
    _milli_timestamp: (b"m", 0),
    _date: (b"d", 0),
    _micro_time: (b"U", 0),
    _milli_time: (b"u", 0),
}


@dataclass(frozen=True, slots=True)
class ColumnType:
    """What decides a column's Connect schema: its type, modifier and enum labels."""

    type_oid: int
    type_modifier: int
    enum_labels: tuple[str, ...] | None = None
    enum_array: bool = False  # an array of the enum type whose labels these are


def _logical(kind: str, name: str, **extra: Any) -> Schema:
    return {"type": kind, "name": name, "version": 1, **extra}


_VARIABLE_DECIMAL: Schema = {
    "type": "struct",
    "fields": [
        {"type": "int32", "optional": False, "field": "scale"},
        {"type": "bytes", "optional": False, "field": "value"},
    ],
    "name": "io.debezium.data.VariableScaleDecimal",
    "version": 1,
    "doc": "Variable scaled decimal",
}
_POINT: Schema = {
    "type": "struct",
    "fields": [
        {"type": "double", "optional": False, "field": "x"},
        {"type": "double", "optional": False, "field": "y"},
        {"type": "bytes", "optional": True, "field": "wkb"},
        {"type": "int32", "optional": True, "field": "srid"},
    ],
    "name": "io.debezium.data.geometry.Point",
    "version": 1,
    "doc": "Geometry (POINT)",
}
_STRING: Schema = {"type": "string"}

# Types whose schema does not depend on the modifier: oid -> (schema, converter).
_FIXED: dict[int, tuple[Schema, Converter]] = {
    16: ({"type": "boolean"}, bool_from_text),
    17: ({"type": "bytes"}, bytea_base64),
    18: (_STRING, str),
    19: (_STRING, str),
    20: ({"type": "int64"}, int),
    21: ({"type": "int16"}, int),
    23: ({"type": "int32"}, int),
    25: (_STRING, str),
    26: ({"type": "int64"}, int),
    114: (_logical("string", "io.debezium.data.Json"), str),
    142: (_logical("string", "io.debezium.data.Xml"), str),
    600: (_POINT, _point),
    700: ({"type": "float"}, float_or_text),
    701: ({"type": "double"}, float_or_text),
    790: (
        _logical("bytes", "org.apache.kafka.connect.data.Decimal", parameters={"scale": "2"}),
        _money,
    ),
    1042: (_STRING, str),
    1043: (_STRING, str),
    1082: (_logical("int32", "io.debezium.time.Date"), _date),
    1186: (_logical("int64", "io.debezium.time.MicroDuration"), _micro_duration),
    1266: (_logical("string", "io.debezium.time.ZonedTime"), _zoned_time),
    2950: (_logical("string", "io.debezium.data.Uuid"), str),
    3802: (_logical("string", "io.debezium.data.Json"), str),
}
# Arrays the connector leaves out of its records (no mapping): published as their text.
_UNMAPPED_ARRAYS = frozenset({791, 1003, 1187, 1563, 143, 1017})


def _precision(type_modifier: int) -> int:
    """Fractional-second digits of a time/timestamp type (6 when unspecified)."""
    return 6 if type_modifier < 0 else type_modifier


def _scalar(column: ColumnType) -> tuple[Schema, Converter]:
    oid, typmod = column.type_oid, column.type_modifier
    fixed = _FIXED.get(oid)
    if fixed is not None:
        return fixed
    if oid == 1700:
        if typmod < 0:
            return _VARIABLE_DECIMAL, _variable_decimal
        precision, scale = (typmod - 4) >> 16, (typmod - 4) & 0xFFFF
        return _logical(
            "bytes",
            "org.apache.kafka.connect.data.Decimal",
            parameters={"scale": str(scale), "connect.decimal.precision": str(precision)},
        ), _decimal(scale)
    if oid == 1083:  # time: adaptive precision
        if _precision(typmod) <= 3:
            return _logical("int32", "io.debezium.time.Time"), _milli_time
        return _logical("int64", "io.debezium.time.MicroTime"), _micro_time
    if oid == 1114:
        if _precision(typmod) <= 3:
            return _logical("int64", "io.debezium.time.Timestamp"), _milli_timestamp
        return _logical("int64", "io.debezium.time.MicroTimestamp"), _micro_timestamp
    if oid == 1184:
        return (
            _logical("string", "io.debezium.time.ZonedTimestamp"),
            _zoned_timestamp(_precision(typmod)),
        )
    if column.enum_labels is not None:
        return _logical(
            "string", "io.debezium.data.Enum", parameters={"allowed": ",".join(column.enum_labels)}
        ), str
    return _STRING, str


def column_encoding(column: ColumnType) -> tuple[Schema, Converter]:
    """A column's Connect schema (without ``optional``/``field``) and its converter."""
    element = ARRAY_ELEMENT.get(column.type_oid)
    if element is not None and column.type_oid not in _UNMAPPED_ARRAYS:
        # An array's modifier is its element's (numeric(10,2)[] keeps its scale).
        item, convert = _scalar(ColumnType(element, column.type_modifier))
        return ({"type": "array", "items": {**item, "optional": True}}, ArrayOf(convert))
    if column.enum_array:
        item, convert = _scalar(column)
        return {"type": "array", "items": {**item, "optional": True}}, ArrayOf(convert)
    return _scalar(column)


def placeholder(column: ColumnType) -> JsonValue:
    """What the connector writes for an unchanged TOAST value of this column type."""
    raw = TOAST_PLACEHOLDER.encode()
    oid = column.type_oid
    if oid == 17:
        return base64.b64encode(raw).decode("ascii")
    if oid in (1009, 1015, 1014, 199, 3807):  # text, varchar, bpchar, json, jsonb arrays
        return [TOAST_PLACEHOLDER]
    if oid == 1001:
        return [base64.b64encode(raw).decode("ascii")]
    if oid in (1007, 1182, 1016):  # int4[], date[], int8[]: the placeholder's bytes
        return list(raw)
    if oid == 2951:
        return [str(uuid.UUID(bytes=hashlib.md5(raw).digest(), version=3))]
    return TOAST_PLACEHOLDER
