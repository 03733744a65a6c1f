"""Text values as a PostgreSQL 17 walsender prints them under the bridge's session settings
(DateStyle=ISO, IntervalStyle=iso_8601, TimeZone=UTC, extra_float_digits=3,
lc_monetary=C)."""

from __future__ import annotations

import json

import orjson
import pytest

from services.bridge.records.values import (
    ARRAY_ELEMENT,
    JSON_NULL,
    TYPE_NAMES,
    JsonValue,
    converter_for,
    parse_array,
)

BOOL, BYTEA, CHAR, NAME, INT8, INT2, INT4, TEXT, OID = 16, 17, 18, 19, 20, 21, 23, 25, 26
JSON, FLOAT4, FLOAT8, BPCHAR, VARCHAR = 114, 700, 701, 1042, 1043
DATE, TIME, TIMESTAMP, TIMESTAMPTZ, INTERVAL, TIMETZ = 1082, 1083, 1114, 1184, 1186, 1266
NUMERIC, UUID, JSONB, MONEY = 1700, 2950, 3802, 790


@pytest.mark.parametrize(
    ("oid", "text", "expected"),
    [
        (INT2, "-32768", -32768),
        (INT4, "2147483647", 2147483647),
        (INT8, "-9223372036854775808", -9223372036854775808),
        (OID, "4294967295", 4294967295),
        (NUMERIC, "-12.340", "-12.340"),
        (NUMERIC, "0.00000000000000000001", "0.00000000000000000001"),
        (NUMERIC, "123456789012345678901234567890.123", "123456789012345678901234567890.123"),
        (NUMERIC, "NaN", "NaN"),
        (NUMERIC, "Infinity", "Infinity"),
        (NUMERIC, "-Infinity", "-Infinity"),
        (FLOAT8, "1.5", 1.5),
        (FLOAT8, "-0", -0.0),
        (FLOAT8, "1e+300", 1e300),
        (FLOAT8, "5e-324", 5e-324),
        (FLOAT8, "0.30000000000000004", 0.30000000000000004),
        (FLOAT4, "1.10000002", 1.10000002),
        (FLOAT8, "NaN", "NaN"),
        (FLOAT8, "Infinity", "Infinity"),
        (FLOAT4, "-Infinity", "-Infinity"),
        (BOOL, "t", True),
        (BOOL, "f", False),
        (TEXT, "", ""),
        (TEXT, "multi\nline \u00e9\U0001f600", "multi\nline \u00e9\U0001f600"),
        (VARCHAR, "NULL", "NULL"),  # the text NULL is not SQL NULL
        (BPCHAR, "ab   ", "ab   "),  # blank padding is part of the value
        (NAME, "pg_class", "pg_class"),
        (CHAR, "x", "x"),
        (UUID, "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11", "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"),
        (MONEY, "$0.00", "0.00"),
        (MONEY, "-$1,234.56", "-1234.56"),
        (MONEY, "$92,233,720,368,547,758.07", "92233720368547758.07"),
        (BYTEA, "\\x", ""),
        (BYTEA, "\\x00ff0a1b", "AP8KGw=="),
        (BYTEA, "\\xDEADBEEF", "3q2+7w=="),
        (BYTEA, "ab\\\\c\\000\\377", "YWJcYwD/"),  # bytea_output=escape forced on the server
        (DATE, "2024-02-29", "2024-02-29"),
        (DATE, "infinity", "infinity"),
        (DATE, "-infinity", "-infinity"),
        (DATE, "0044-03-15 BC", "0044-03-15 BC"),
        (DATE, "10000-01-01", "10000-01-01"),
        (TIME, "23:59:59.999999", "23:59:59.999999"),
        (TIMETZ, "12:00:00+05:30", "12:00:00+05:30"),
        (TIMESTAMP, "2024-11-21 00:43:10", "2024-11-21T00:43:10"),
        (TIMESTAMP, "2024-11-21 00:43:10.5", "2024-11-21T00:43:10.5"),
        (TIMESTAMP, "infinity", "infinity"),
        (TIMESTAMP, "-infinity", "-infinity"),
        (TIMESTAMP, "0044-03-15 12:00:00 BC", "0044-03-15T12:00:00 BC"),
        (TIMESTAMPTZ, "2024-11-21 00:43:10+00", "2024-11-21T00:43:10Z"),
        (TIMESTAMPTZ, "2024-11-21 00:43:10.123456+00", "2024-11-21T00:43:10.123456Z"),
        (TIMESTAMPTZ, "infinity", "infinity"),
        (TIMESTAMPTZ, "-infinity", "-infinity"),
        (TIMESTAMPTZ, "0044-03-15 12:00:00+00 BC", "0044-03-15T12:00:00Z BC"),
        (TIMESTAMPTZ, "1999-12-31 23:00:00.25-01", "2000-01-01T00:00:00.250000Z"),  # not UTC
        (TIMESTAMPTZ, "2024-01-01 05:30:00+05:30", "2024-01-01T00:00:00Z"),
        (INTERVAL, "P1Y2M3DT4H5M6.5S", "P1Y2M3DT4H5M6.5S"),
        (INTERVAL, "PT-0.000001S", "PT-0.000001S"),
    ],
)
def test_scalar(oid: int, text: str, expected: JsonValue) -> None:
    value = converter_for(oid)(text)
    assert value == expected
    assert type(value) is type(expected)
    json.dumps(value, allow_nan=False)  # every value is plain JSON


@pytest.mark.parametrize(
    ("oid", "text"),
    [
        (BOOL, "true"),
        (INT4, "1.5"),
        (FLOAT8, "abc"),
        (BYTEA, "\\xzz"),
        (TIMESTAMPTZ, "yesterday"),
        (TIMESTAMPTZ, "0044-03-15 12:00:00+01 BC"),
    ],
)
def test_malformed_scalar_raises_value_error(oid: int, text: str) -> None:
    with pytest.raises(ValueError):
        converter_for(oid)(text)


@pytest.mark.parametrize(
    ("oid", "text"),
    [
        (JSON, '{"a":1,"a":2,"big":1e400}'),  # duplicate keys and a huge number stay as written
        (JSON, ' [1, "two"]\n '),  # json keeps the input text, whitespace too
        (JSON, '{"s": "\\u0000 \\" \\\\ \u00e9"}'),  # escapes, a NUL escape among them
        (JSON, '"just a string"'),
        (JSONB, '{"n": 0.1000000000000000000001}'),
        (JSONB, "12345678901234567890"),
        (JSONB, '{"a": [1, 2.5, null, true], "b": {"c": "\\u00e9"}}'),
    ],
)
def test_json_text_is_embedded_exactly(oid: int, text: str) -> None:
    # Text columns beside it that look like the wrapping must stay text.
    row = {"j": converter_for(oid)(text), "t": '\\u0000"', "u": "a\\u0000\\"}
    encoded = orjson.dumps({"after": row}).decode()
    assert encoded == ('{"after":{"j":' + text + r',"t":"\\u0000\"","u":"a\\u0000\\"}}')
    json.loads(encoded)  # valid JSON, whatever the value holds


@pytest.mark.parametrize(("oid", "text"), [(JSONB, "null"), (JSON, "null"), (JSON, " null\n")])
def test_json_null_is_one_marked_object(oid: int, text: str) -> None:
    # The event builder names these columns in json_nulls; embedded they read as null.
    value = converter_for(oid)(text)
    assert value is JSON_NULL and orjson.dumps(value) == b"null"


@pytest.mark.parametrize("text", ['"null"', "[null]", '{"a": null}', " nulls"])
def test_json_that_is_not_null_is_not_marked(text: str) -> None:
    assert converter_for(JSONB)(text) is not JSON_NULL


def test_json_arrays_embed_each_element() -> None:
    value = converter_for(199)('{"{\\"a\\": 1e400}","[1,2]",NULL}')
    assert orjson.dumps(value) == b'[{"a": 1e400},[1,2],null]'


def test_money_outside_the_c_locale_is_refused() -> None:
    with pytest.raises(ValueError):
        converter_for(MONEY)("12,34 €")


def test_common_converters_are_builtins() -> None:
    assert converter_for(INT4) is int
    assert converter_for(INT8) is int
    assert converter_for(TEXT) is str
    assert converter_for(VARCHAR) is str


@pytest.mark.parametrize("oid", [869, 650, 142, 1560, 3904, 16_500, 16_501])
def test_unknown_types_stay_text(oid: int) -> None:
    """inet, cidr, xml, bit, int4range, an enum, its array: all text."""
    assert converter_for(oid)("{a,b}") == "{a,b}"


@pytest.mark.parametrize(
    ("oid", "text", "expected"),
    [
        (1007, "{}", []),
        (1007, "{1,2,NULL,-4}", [1, 2, None, -4]),
        (1005, "{{1,2},{3,4}}", [[1, 2], [3, 4]]),
        (1016, "{{{1},{2}},{{3},{NULL}}}", [[[1], [2]], [[3], [None]]]),
        (1007, "[0:2]={7,8,9}", [7, 8, 9]),
        (1007, "[1:1][-1:0]={{5,6}}", [[5, 6]]),
        (
            1009,
            '{plain,"with space","a,b","{brace}","q\\"uote","back\\\\slash","NULL",NULL,""}',
            ["plain", "with space", "a,b", "{brace}", 'q"uote', "back\\slash", "NULL", None, ""],
        ),
        (1009, '{{a,"b c"},{NULL,"d"}}', [["a", "b c"], [None, "d"]]),
        (1015, '{"\u00e9t\u00e9",\U0001f600}', ["\u00e9t\u00e9", "\U0001f600"]),
        (1014, '{"a  ","bb "}', ["a  ", "bb "]),
        (1000, "{t,f,NULL}", [True, False, None]),
        (1231, "{1.50,NaN,-Infinity,NULL}", ["1.50", "NaN", "-Infinity", None]),
        (1021, "{1.5,NaN,Infinity}", [1.5, "NaN", "Infinity"]),
        (1022, "{-0.5,-Infinity}", [-0.5, "-Infinity"]),
        (2951, "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}", ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
        (
            1182,
            '{2024-01-01,infinity,"0044-03-15 BC"}',
            ["2024-01-01", "infinity", "0044-03-15 BC"],
        ),
        (1115, '{"2024-01-01 10:00:00",infinity}', ["2024-01-01T10:00:00", "infinity"]),
        (
            1185,
            '{"2024-01-01 10:00:00.5+00",-infinity,NULL}',
            ["2024-01-01T10:00:00.5Z", "-infinity", None],
        ),
        (1001, '{"\\\\x00ff",NULL,"\\\\x"}', ["AP8=", None, ""]),
        (1183, "{10:00:00,23:59:59.5}", ["10:00:00", "23:59:59.5"]),
        (1187, "{P1D,PT1H}", ["P1D", "PT1H"]),
        (1028, "{1,2}", [1, 2]),
        (1009, '{"null","Null",NULL}', ["null", "Null", None]),
        (1009, '{{"x"},{"y"}}', [["x"], ["y"]]),
    ],
)
def test_array(oid: int, text: str, expected: JsonValue) -> None:
    assert converter_for(oid)(text) == expected


@pytest.mark.parametrize(
    ("oid", "text", "encoded"),
    [
        # json elements stay their text; jsonb 'null' is not NULL
        (3807, '{"{\\"a\\": 1}","[1, 2]",null,NULL}', b'[{"a": 1},[1, 2],null,null]'),
        (199, '{"{\\"k\\": \\"v,}\\"}"}', b'[{"k": "v,}"}]'),
    ],
)
def test_json_array_elements_are_their_text(oid: int, text: str, encoded: bytes) -> None:
    assert orjson.dumps(converter_for(oid)(text)) == encoded


@pytest.mark.parametrize(
    "text",
    [
        "",
        "1,2",
        "{1,2",
        "{1,2}}",
        "{{1,2}",
        "{1,2}x",
        '{"a}',
        "{1,{2}",
        "[0:1]={1",
        "{1,,2}",
        "{a,}",
        '{"a""b"}',
        '{"a",}',
        '{,"a"}',
        "{{1}{2}}",
        '{"a"},{"b"}',
        '"a"',
        '{"a"}}',
    ],
)
def test_malformed_array_raises_value_error(text: str) -> None:
    with pytest.raises(ValueError):
        parse_array(text, str)


def test_type_names_follow_format_type() -> None:
    assert TYPE_NAMES[INT4] == "integer"
    assert TYPE_NAMES[INT8] == "bigint"
    assert TYPE_NAMES[FLOAT8] == "double precision"
    assert TYPE_NAMES[TIMESTAMPTZ] == "timestamp with time zone"
    assert TYPE_NAMES[VARCHAR] == "character varying"
    assert TYPE_NAMES[BPCHAR] == "character"
    assert TYPE_NAMES[1007] == "integer[]"
    assert TYPE_NAMES[1185] == "timestamp with time zone[]"
    assert TYPE_NAMES[1002] == '"char"[]'


def test_array_table_is_consistent() -> None:
    expected = {
        1005: INT2,
        1007: INT4,
        1016: INT8,
        1009: TEXT,
        1015: VARCHAR,
        1000: BOOL,
        1231: NUMERIC,
        1021: FLOAT4,
        1022: FLOAT8,
        2951: UUID,
        199: JSON,
        3807: JSONB,
        1182: DATE,
        1115: TIMESTAMP,
        1185: TIMESTAMPTZ,
        1001: BYTEA,
        1183: TIME,
        1187: INTERVAL,
        1014: BPCHAR,
        1270: TIMETZ,
    }
    assert expected.items() <= ARRAY_ELEMENT.items()
    for array, element in ARRAY_ELEMENT.items():
        assert TYPE_NAMES[array] == TYPE_NAMES[element] + "[]"
