"""Pure parts of the Spark consumer: type mapping, schema registry, settings, lag, key ranges."""

from __future__ import annotations

import json
import random
import sys
import threading
from pathlib import Path

import pytest
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
    StringType,
    TimestampNTZType,
    TimestampType,
)

from services.contract.records import GapRecord
from slotbridge_dev.synthetic import SynthColumn, SynthTable
from spark_consumers.changes import grid_bounds
from spark_consumers.schema import SchemaRegistry, numeric_precision_scale, spark_type
from spark_consumers.settings import ConsumerSettings
from spark_consumers.status import Status, TableCounts, lag_from_progress


def _typmod(precision: int, scale: int) -> int:
    return ((precision << 16) | scale) + 4


@pytest.mark.parametrize(
    ("pg_type", "typmod", "expected"),
    [
        ("smallint", -1, ShortType()),
        ("integer", -1, IntegerType()),
        ("bigint", -1, LongType()),
        ("real", -1, FloatType()),
        ("double precision", -1, DoubleType()),
        ("boolean", -1, BooleanType()),
        ("numeric(10,2)", _typmod(10, 2), DecimalType(10, 2)),
        ("numeric(38,0)", _typmod(38, 0), DecimalType(38, 0)),
        ("numeric(50,2)", _typmod(50, 2), StringType()),
        ("numeric", -1, StringType()),
        ("date", -1, DateType()),
        ("timestamp without time zone", -1, TimestampNTZType()),
        ("timestamp(3) without time zone", 3, TimestampNTZType()),
        ("timestamp with time zone", -1, TimestampType()),
        ("time without time zone", -1, StringType()),
        ("interval", -1, StringType()),
        ("text", -1, StringType()),
        ("character varying(20)", 24, StringType()),
        ("uuid", -1, StringType()),
        ("jsonb", -1, StringType()),
        ("bytea", -1, BinaryType()),
        ("integer[]", -1, ArrayType(IntegerType())),
        ("text[]", -1, ArrayType(StringType())),
        ("numeric(6,3)[]", _typmod(6, 3), ArrayType(DecimalType(6, 3))),
        ("mood", -1, StringType()),
    ],
)
def test_spark_type(pg_type: str, typmod: int, expected: object) -> None:
    assert spark_type(pg_type, 0, typmod) == expected


def test_declared_dimensions_nest_arrays() -> None:
    # format_type prints integer[] whatever the dimensions; the schema record says them.
    assert spark_type("integer[]", 1007, -1, 3) == ArrayType(ArrayType(ArrayType(IntegerType())))
    assert spark_type("integer[]", 1007, -1, 0) == ArrayType(IntegerType())


def test_numeric_typmod() -> None:
    assert numeric_precision_scale(-1) is None
    assert numeric_precision_scale(_typmod(12, 4)) == (12, 4)


def _table(version: int, *extra: SynthColumn) -> SynthTable:
    columns = (SynthColumn("id", "integer", key=True), SynthColumn("name", "text"), *extra)
    return SynthTable("p", "public", "t", columns, version)


def test_registry_merges_versions_and_keeps_dropped_columns() -> None:
    registry = SchemaRegistry()
    v1 = _table(1, SynthColumn("gone", "text"))
    v2 = _table(2, SynthColumn("added", "numeric(5,1)", type_modifier=_typmod(5, 1)))
    problems = registry.add_records(
        [v1.schema_record()[2], v2.schema_record()[2], None, b"{not json"]
    )
    assert len(problems) == 1
    merged = registry.merged("public.t")
    assert [c.name for c in merged.columns] == ["id", "name", "added", "gone"]
    assert merged.key_columns == ("id",)
    assert merged.struct()["added"].dataType == DecimalType(5, 1)
    assert registry.has("public.t", 2) and not registry.has("public.t", 3)


def test_registry_keeps_the_gaps_the_schema_topic_holds() -> None:
    # `slotbridge resync` writes its GapRecord on the schema topic beside the table
    # versions; a malformed one is a problem line, never a table version.
    gap = GapRecord(
        slot="s", kind="source", after_lsn=42, reason="slot dropped", tables=["public.t"], ts_ms=1
    )
    broken = {**gap.model_dump(), "kind": "elsewhere"}
    registry = SchemaRegistry()
    problems = registry.add_records(
        [gap.model_dump_json(), _table(1).schema_record()[2], json.dumps(broken)]
    )
    assert len(problems) == 1 and "kind" in problems[0], problems
    assert registry.gaps == {("s", 42): gap}
    assert registry.has("public.t", 1) and list(registry.versions) == ["public.t"]


def test_registry_rejects_reserved_column_names() -> None:
    registry = SchemaRegistry()
    record = _table(1, SynthColumn("valid_to_lsn", "bigint")).schema_record()[2]
    assert "collide" in registry.add_records([record])[0]
    assert not registry.has("public.t", 1)


def test_settings_topics() -> None:
    settings = ConsumerSettings(
        kafka_bootstrap="k:9092",
        warehouse="/w",
        checkpoint_dir="/c",
        topic_prefix="pg-1",
        tables=["public.a"],
    )
    assert settings.change_topics() == ["pg-1.public.a"]
    assert settings.schema_topic == "pg-1.schema"
    assert settings.change_topic_pattern() == r"\Qpg-1.public.a\E"
    every = settings.model_copy(update={"tables": None})
    assert every.change_topic_pattern() == r"\Qpg-1\E\.[^.]+\.[^.]+"
    with pytest.raises(ValueError, match=r"schema\.table"):
        ConsumerSettings(kafka_bootstrap="k", warehouse="/w", checkpoint_dir="/c", tables=["a"])


def test_lag_from_progress() -> None:
    progress = {
        "sources": [
            {
                "endOffset": json.dumps({"p.public.a": {"0": 10, "1": 5}}),
                "latestOffset": {"p.public.a": {"0": 12, "1": 5}, "p.public.b": {"0": 3}},
            }
        ]
    }
    assert lag_from_progress(progress) == {"p.public.a": 2, "p.public.b": 3}


@pytest.mark.parametrize("unknown", ["None", None, "null", ""])
def test_lag_from_progress_without_offsets(unknown: str | None) -> None:
    """A replayed batch and a pattern matching no topic yet report offsets Spark does
    not know as the text "None" (PySpark) or null: no lag, no JSONDecodeError."""
    progress = {
        "sources": [{"startOffset": unknown, "endOffset": unknown, "latestOffset": unknown}]
    }
    assert lag_from_progress(progress) == {}
    progress["sources"][0]["latestOffset"] = json.dumps({"p.public.a": {"0": 4}})
    assert lag_from_progress(progress) == {"p.public.a": 4}


def test_status_written_from_two_threads_at_once(tmp_path: Path) -> None:
    """The batch function and the driver's poll loop write the status file at the same
    time; neither may fail (a failed write fails the job), and the file stays whole."""
    status, path = Status(), tmp_path / "status.json"
    failures: list[OSError] = []

    def write_many() -> None:
        try:
            for _ in range(300):
                status.write(path)
        except OSError as exc:
            failures.append(exc)

    writers = [threading.Thread(target=write_many) for _ in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert failures == []
    assert json.loads(path.read_text())["state"] == "starting"


def test_status_read_while_a_batch_adds_a_table() -> None:
    """The poll loop and the metrics server read the counters while the batch function adds
    tables it has not seen; a read must not fail ("dictionary changed size")."""
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython can, to meet the overlap
    try:
        status, failures, done = Status(), list[RuntimeError](), threading.Event()

        def add_tables() -> None:
            for batch in range(3000):
                status.record_batch(batch, {f"t{batch}": TableCounts(applied=1)}, 0.1)
            done.set()

        adder = threading.Thread(target=add_tables)
        adder.start()
        reads = 0
        while not done.is_set():
            try:
                status.as_dict()
            except RuntimeError as exc:
                failures.append(exc)
            reads += 1
        adder.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert failures == []
    assert reads > 1  # the reads overlapped the additions
    assert status.as_dict()["tables"]["t2999"] == {"applied": 1, "quarantined": 0}


def test_case_collisions() -> None:
    table = SchemaRegistry()
    table.add_records(
        [
            _table(
                1,
                SynthColumn("x", "integer"),
                SynthColumn("X", "text"),
                SynthColumn("Mixed Case", "text"),
            ).schema_record()[2]
        ]
    )
    assert table.merged("public.t").case_collisions() == [("x", "X")]


def test_key_ranges_widen_to_a_grid_that_batches_of_the_same_keys_share() -> None:
    """A batch's key range filters the stored tables on a grid (``changes.in_key_range``),
    so that the code Spark generates for the filter is the same from batch to batch: ranges
    in one cell of the grid give the same bounds, each range lies within its bounds, at
    most three times as wide, and the bounds are values of the key's type."""
    # Random keys of pgbench_accounts (1..100,000), batch after batch.
    batches = [(1, 99_990), (7, 100_000), (3, 99_871), (12, 99_999)]
    assert {grid_bounds(low, high, 32) for low, high in batches} == {(0, 131_071)}
    # A serial key's recent rows, updated a few thousand keys at a time.
    assert grid_bounds(1_000_000, 1_005_000, 64) == grid_bounds(1_000_100, 1_005_900, 64)
    assert grid_bounds(5, 5, 16) == (5, 5)
    assert grid_bounds(2**31 - 3, 2**31 - 1, 32) == (2**31 - 4, 2**31 - 1)
    assert grid_bounds(-(2**63), -(2**63) + 5, 64) == (-(2**63), -(2**63) + 7)
    draw = random.Random(34)
    for _ in range(10_000):
        bits = draw.choice((16, 32, 64))
        top = 2 ** (bits - 1)
        low = draw.randrange(-top, top)
        high = min(top - 1, low + draw.choice((0, 1, 7, 1_000, 2**20, 2**40)))
        wide_low, wide_high = grid_bounds(low, high, bits)
        assert -top <= wide_low <= low <= high <= wide_high <= top - 1
        assert wide_high - wide_low + 1 <= 3 * (high - low + 1)
