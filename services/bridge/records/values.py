"""Text-format column values -> typed JSON values, by PostgreSQL type OID.

The contract with the Spark consumers and ``schemas/`` is the one table ``_TYPES``; a type
not in it (enums, domains, extension types such as citext, arrays of those) stays text.
The bridge configures the walsender session with ``DateStyle=ISO``,
``IntervalStyle=iso_8601``, ``TimeZone=UTC``, ``extra_float_digits=3`` and
``client_encoding=UTF8``, so each converter parses the one textual form the server
prints under those settings. Converters run per column per row: the common ones are the
builtins themselves (``int``, ``str``), the others use string operations on their usual
path and leave regexes and ``datetime`` to the rare forms (escaped bytea, quoted or
multi-dimensional arrays, a session time zone that is not UTC).

A converter raises ``ValueError`` on text its type cannot print.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TypeAlias

import orjson

JsonValue: TypeAlias = (
    "bool | int | float | str | orjson.Fragment | list[JsonValue] | dict[str, JsonValue] | None"
)
Converter: TypeAlias = Callable[[str], JsonValue]


def float_or_text(text: str) -> JsonValue:
    value = float(text)
    # JSON has no NaN/Infinity; the server prints exactly "NaN", "Infinity", "-Infinity",
    # which is what the contract wants. ``v - v`` is 0.0 only for finite values.
    return value if value - value == 0.0 else text


def bool_from_text(text: str) -> JsonValue:
    if text == "t":
        return True
    if text == "f":
        return False
    raise ValueError(f"not a boolean: {text!r}")


_BYTEA_ESCAPE = re.compile(rb"\\(\\|[0-3][0-7]{2})")


def bytea_base64(text: str) -> JsonValue:
    if text.startswith("\\x"):
        raw = bytes.fromhex(text[2:])
    else:
        # bytea_output=escape set on the server, database or role wins over our session
        # default; it prints printable ASCII as is, '\\' for a backslash, '\ooo' otherwise.
        raw = _BYTEA_ESCAPE.sub(_unescape_octet, text.encode("ascii"))
    return base64.b64encode(raw).decode("ascii")


def _unescape_octet(match: re.Match[bytes]) -> bytes:
    code = match.group(1)
    return b"\\" if code == b"\\" else bytes((int(code, 8),))


def timestamp_iso(text: str) -> JsonValue:
    # 'infinity' has no space and stays as is; a BC timestamp keeps its ' BC' suffix.
    return text.replace(" ", "T", 1)


def timestamptz_iso(text: str) -> JsonValue:
    if text.endswith("+00"):
        return text[:-3].replace(" ", "T", 1) + "Z"
    if text.endswith("infinity"):
        return text
    if text.endswith(" BC"):
        if text.endswith("+00 BC"):
            return text[:-6].replace(" ", "T", 1) + "Z BC"
        raise ValueError(f"BC timestamp with a non-UTC offset: {text!r}")
    # Only reached when the session time zone is not UTC after all: convert rather than
    # publish a wrong instant.
    try:
        moment = datetime.fromisoformat(text).astimezone(UTC)
    except ValueError:
        raise ValueError(f"not a timestamp with time zone: {text!r}") from None
    return moment.replace(tzinfo=None).isoformat() + "Z"


# json and jsonb values are published as the very text PostgreSQL printed: parsed and
# re-encoded they would lose digits, duplicate keys, and turn 1e400 into Infinity, which
# is not JSON. An orjson Fragment is text the encoder writes out as it is.
# A JSON null embedded so looks just like SQL NULL; this one object stands for it, so the
# event builder can tell the two apart (``json_nulls`` in the record).
JSON_NULL = orjson.Fragment(b"null")


def raw_json(text: str) -> JsonValue:
    # json keeps the input's blanks around the value; jsonb prints exactly "null".
    if len(text) < 16 and text.strip() == "null":
        return JSON_NULL
    return orjson.Fragment(text)


_MONEY = re.compile(r"-?[0-9]+(\.[0-9]+)?")


def money_decimal(text: str) -> JsonValue:
    # The session runs with lc_monetary=C: '-$1,234.56'. Published as an exact decimal
    # string, like numeric, whatever the database's locale.
    value = text.replace("$", "", 1).replace(",", "")
    if not _MONEY.fullmatch(value):
        raise ValueError(f"not a money value in the C locale: {text!r}")
    return value


# oid, array oid, format_type() name, converter
_TYPES: tuple[tuple[int, int, str, Converter], ...] = (
    (16, 1000, "boolean", bool_from_text),
    (17, 1001, "bytea", bytea_base64),
    (18, 1002, '"char"', str),
    (19, 1003, "name", str),
    (20, 1016, "bigint", int),
    (21, 1005, "smallint", int),
    (23, 1007, "integer", int),
    (25, 1009, "text", str),
    (26, 1028, "oid", int),
    (114, 199, "json", raw_json),
    (700, 1021, "real", float_or_text),
    (701, 1022, "double precision", float_or_text),
    (790, 791, "money", money_decimal),
    (1042, 1014, "character", str),
    (1043, 1015, "character varying", str),
    (1082, 1182, "date", str),
    (1083, 1183, "time without time zone", str),
    (1114, 1115, "timestamp without time zone", timestamp_iso),
    (1184, 1185, "timestamp with time zone", timestamptz_iso),
    (1186, 1187, "interval", str),
    (1266, 1270, "time with time zone", str),
    (1700, 1231, "numeric", str),  # exact: the string as sent, NaN/Infinity included
    (2950, 2951, "uuid", str),
    (3802, 3807, "jsonb", raw_json),
)

# An array element is quoted ("..." with \" and \\ escapes), or unquoted up to the next
# ',' or '}'; braces open and close dimensions; an element or a '}' may be followed by ','.
_ARRAY_TOKEN = re.compile(r'(\{)|(?:(\})|"((?:[^"\\]|\\.)*)"|((?:[^,{}"\\]|\\.)+))(,?)', re.DOTALL)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)


def parse_array(text: str, element: Converter) -> JsonValue:
    """A PostgreSQL array literal -> (nested) lists of converted elements, NULL -> None.

    Parses what the server's ``array_out`` prints: the ``[lo:hi]=`` dimension decoration
    (dropped: JSON arrays start at 0 whatever the lower bound), quoted elements with
    backslash escapes, NULL versus "NULL" (an element spelled null in any case is quoted),
    any number of dimensions. Input-only forms of ``array_in`` (blanks around elements,
    lowercase null) are not accepted.
    """
    if text.startswith("["):
        text = text[text.index("=") + 1 :]
    if '"' not in text and "\\" not in text and not text.startswith("{{"):
        # One dimension, nothing quoted: the common case, split without a tokenizer.
        if text[:1] != "{" or text[-1] != "}" or "{" in text[1:-1] or "}" in text[1:-1]:
            raise ValueError(f"malformed array literal: {text!r}")
        if len(text) == 2:
            return []
        items = text[1:-1].split(",")
        if "" in items:  # array_out quotes an empty string
            raise ValueError(f"malformed array literal: {text!r}")
        return [None if item == "NULL" else element(item) for item in items]
    return _parse_nested(text, element)


def _parse_nested(text: str, element: Converter) -> JsonValue:
    stack: list[list[JsonValue]] = []
    pos, end = 0, len(text)
    # What the previous token allows next: an element or '{' after '{' or ',', a '}'
    # after '{' (empty) or an element or '}' not followed by ','.
    want_value, may_close = True, False
    while pos < end:
        match = _ARRAY_TOKEN.match(text, pos)
        if match is None:
            break
        opened, closed, quoted, bare, comma = match.groups()
        if closed:
            if not may_close:
                break
            done = stack.pop()
            if not stack:
                if comma or match.end() != end:
                    break
                return done
        elif not want_value or (opened is None and not stack):
            break
        elif opened:
            inner: list[JsonValue] = []
            if stack:
                stack[-1].append(inner)
            stack.append(inner)
        elif quoted is not None:
            stack[-1].append(element(_ESCAPE.sub(r"\1", quoted) if "\\" in quoted else quoted))
        elif bare == "NULL":
            stack[-1].append(None)
        else:
            stack[-1].append(element(_ESCAPE.sub(r"\1", bare) if "\\" in bare else bare))
        pos = match.end()
        want_value = bool(opened or comma)
        may_close = bool(opened or not comma)
    raise ValueError(f"malformed array literal at offset {pos}: {text!r}")


class ArrayOf:
    """The converter of an array type: ``parse_array`` with its element's converter.

    An object rather than a closure so that ``catalog.row_plan`` can see the element's
    converter and let the compiled builder write arrays of the kinds it knows."""

    __slots__ = ("element",)

    def __init__(self, element: Converter) -> None:
        self.element = element

    def __call__(self, text: str) -> JsonValue:
        return parse_array(text, self.element)


TYPE_NAMES: dict[int, str] = {oid: name for oid, _, name, _ in _TYPES}
TYPE_NAMES.update({array: name + "[]" for _, array, name, _ in _TYPES})
ARRAY_ELEMENT: dict[int, int] = {array: oid for oid, array, _, _ in _TYPES}
_CONVERTERS: dict[int, Converter] = {oid: convert for oid, _, _, convert in _TYPES}
_CONVERTERS.update({array: ArrayOf(convert) for _, array, _, convert in _TYPES})


def converter_for(type_oid: int) -> Converter:
    """The converter of a column type; unknown types keep their text."""
    return _CONVERTERS.get(type_oid, str)
