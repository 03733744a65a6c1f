"""Parsing and merging of micro-batches in Spark local mode, without Kafka.

Batches are built as the Kafka source delivers them (topic, partition, offset, key, value)
and handed to the foreachBatch function directly, so ordering, replay, TOAST, truncate,
dead-letter and schema-evolution rules are checked in seconds.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import time
from collections.abc import Iterator
from dataclasses import replace
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pyarrow as pa
import pytest
from delta.tables import DeltaTable
from deltalake import DeltaTable as DeltaLakeTable
from deltalake import QueryBuilder
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DecimalType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from services.contract.records import TOAST_PLACEHOLDER
from slotbridge_dev.synthetic import Record, SynthColumn, SynthTable
from spark_consumers.batch import BatchProcessor
from spark_consumers.changes import BatchFacts
from spark_consumers.current import BROADCAST_SOURCE_BYTES, fits_a_broadcast
from spark_consumers.housekeeping import Housekeeper, fold_history_ends
from spark_consumers.job import session_conf
from spark_consumers.parse import RowTyping, envelopes
from spark_consumers.schema import SchemaRegistry
from spark_consumers.settings import ConsumerSettings
from spark_consumers.status import Status
from spark_consumers.tables import (
    current_struct,
    dead_letter_path,
    ensure_table,
    resolved_history,
    table_paths,
)
from spark_consumers.timings import BatchTimings

pytestmark = pytest.mark.spark

_RAW = StructType(
    [
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
    ]
)
NUM = ((10 << 16) | 2) + 4  # numeric(10,2)

COLUMNS = (
    SynthColumn("id", "integer", 23, key=True),
    SynthColumn("amount", "numeric(10,2)", 1700, NUM),
    SynthColumn("big", "bigint", 20),
    SynthColumn("name", "text", 25),
    SynthColumn("doc", "jsonb", 3802),
    SynthColumn("at", "timestamp with time zone", 1184),
    SynthColumn("local", "timestamp without time zone", 1114),
    SynthColumn("day", "date", 1082),
    SynthColumn("ok", "boolean", 16),
    SynthColumn("tags", "text[]", 1009),
    SynthColumn("nums", "integer[]", 1007),
    SynthColumn("blob", "bytea", 17),
    SynthColumn("score", "double precision", 701),
)


def row(id_: int, name: str = "n", **over: Any) -> dict[str, Any]:
    base = {
        "id": id_,
        "amount": "12.50",
        "big": 9007199254740993,
        "name": name,
        "doc": {"a": [1, "x"], "b": None},
        "at": "2024-03-01T10:11:12.123456Z",
        "local": "2024-03-01T10:11:12",
        "day": "2024-03-01",
        "ok": True,
        "tags": ["a", None, "c"],
        "nums": [1, 2],
        "blob": base64.b64encode(b"\x00\xff").decode(),
        "score": "NaN",
    }
    base.update(over)
    return base


def test_a_truncate_ends_the_rows_of_a_keyless_table_the_same_job_created(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The job that created a keyless table's history ends its rows at a later truncate as
    a job that found the table stored does (the test above): a table created by this job
    holds nothing to look at only until the job first writes it."""
    t = SynthTable("p", "public", "log", (SynthColumn("a", "integer", 23), COLUMNS[3]))
    h = Harness(spark, tmp_path, t)
    h.run(t.change("c", {"a": 1, "name": "x"}, 100, 1, 1))
    h.run(t.change("c", {"a": 2, "name": "y"}, 200, 1, 2))
    h.run(t.change("t", None, 300, 1, 3))
    rows = [
        (r["a"], r["_cdc_op"], r["valid_from_lsn"], r["valid_to_lsn"])
        for r in h.history("public.log")
    ]
    assert rows == [(1, "c", 100, 300), (2, "c", 200, 300), (None, "t", 300, 300)]


def _comparable(values: dict[str, Any]) -> dict[str, Any]:
    """NaN != NaN would make equal rows differ."""
    return {k: "NaN" if isinstance(v, float) and v != v else v for k, v in values.items()}


class Harness:
    """A warehouse, a processor with a known registry, and a Kafka-offset counter."""

    def __init__(self, spark: SparkSession, root: Path, *tables: SynthTable, **extra: Any) -> None:
        self.spark = spark
        self.settings = ConsumerSettings(
            kafka_bootstrap="unused:9",
            topic_prefix="p",
            warehouse=str(root / "wh"),
            checkpoint_dir=str(root / "ck"),
            **extra,
        )
        self.registry = SchemaRegistry()
        self.announce(*tables)
        self.processor = BatchProcessor(spark, self.settings, Status(), self.registry)
        self.offset = 0
        self.batch_id = 0

    def announce(self, *tables: SynthTable) -> None:
        self.registry.add_records(t.schema_record()[2] for t in tables)

    def frame(self, records: list[Record]) -> DataFrame:
        rows = []
        for topic, key, value in records:
            rows.append((topic, 0, self.offset, key, value))
            self.offset += 1
        return self.spark.createDataFrame(rows, _RAW)

    def run(self, records: list[Record], batch_id: int | None = None) -> DataFrame:
        frame = self.frame(records)
        self.processor(frame, self.batch_id if batch_id is None else batch_id)
        self.batch_id += 1
        return frame

    def current(self, table: str = "public.t") -> dict[int, dict[str, Any]]:
        path = table_paths(self.settings.warehouse, table).current
        rows = self.spark.read.format("delta").load(path).collect()
        return {r["id"]: _comparable(r.asDict()) for r in rows}

    def history(self, table: str = "public.t") -> list[dict[str, Any]]:
        """The resolved history: the ends not folded in yet taken from their table."""
        rows = resolved_history(self.spark, table_paths(self.settings.warehouse, table)).collect()
        return sorted(
            (_comparable(r.asDict()) for r in rows),
            key=lambda r: (r["_cdc_commit_lsn"], r["_cdc_total_order"]),
        )

    def dead_letters(self) -> list[dict[str, Any]]:
        path = dead_letter_path(self.settings.warehouse)
        return [r.asDict() for r in self.spark.read.format("delta").load(path).collect()]


def test_types_upserts_deletes_history_and_replay(spark: SparkSession, tmp_path: Path) -> None:
    t = SynthTable("p", "public", "t", COLUMNS)
    h = Harness(spark, tmp_path, t)
    first = [
        *t.change("c", row(1), 100, 1, 7),
        *t.change("c", row(2), 100, 2, 7),
        *t.change("c", row(3), 100, 3, 7),
        *t.change("u", row(1, "one"), 200, 1, 8),
        *t.change("d", {"id": 2}, 200, 2, 8),
    ]
    frame = h.run(first)
    current = h.current()
    assert sorted(current) == [1, 3]
    one = current[1]
    assert one["name"] == "one"
    assert one["amount"] == Decimal("12.50")
    assert one["big"] == 9007199254740993
    assert json.loads(one["doc"]) == {"a": [1, "x"], "b": None}
    assert one["at"] == dt.datetime(2024, 3, 1, 10, 11, 12, 123456)  # UTC session zone
    assert one["local"] == dt.datetime(2024, 3, 1, 10, 11, 12)
    assert one["day"] == dt.date(2024, 3, 1)
    assert one["ok"] is True
    assert one["tags"] == ["a", None, "c"]
    assert one["nums"] == [1, 2]
    assert bytes(one["blob"]) == b"\x00\xff"
    assert one["score"] == "NaN"
    schema = (
        spark.read.format("delta")
        .load(table_paths(h.settings.warehouse, "public.t").current)
        .schema
    )
    assert schema["amount"].dataType == DecimalType(10, 2)
    assert schema["at"].dataType == TimestampType()
    assert schema["local"].dataType == TimestampNTZType()
    assert schema["tags"].dataType == ArrayType(StringType())

    history = h.history()
    assert [(r["id"], r["_cdc_op"]) for r in history] == [
        (1, "c"),
        (2, "c"),
        (3, "c"),
        (1, "u"),
        (2, "d"),
    ]
    validity = {(r["id"], r["_cdc_op"]): (r["valid_from_lsn"], r["valid_to_lsn"]) for r in history}
    assert validity == {
        (1, "c"): (100, 200),
        (2, "c"): (100, 200),
        (3, "c"): (100, None),
        (1, "u"): (200, None),
        (2, "d"): (200, 200),
    }
    assert history[3]["_cdc_tx_id"] == 8

    # The same batch again (a job killed before its checkpoint): nothing changes.
    h.processor(frame, 0)
    assert h.current() == current
    assert h.history() == history

    # The next batch closes the open version of key 1 in the stored history.
    h.run(t.change("u", row(1, "uno"), 300, 1, 9))
    history = h.history()
    assert len(history) == 6
    assert [(r["valid_from_lsn"], r["valid_to_lsn"]) for r in history if r["id"] == 1] == [
        (100, 200),
        (200, 300),
        (300, None),
    ]
    # Where the batch's time went, with the Spark jobs and the rows of each MERGE.
    status = h.processor.status.as_dict()
    assert set(status["last_batch_phases"]) == {
        "read, parse, survey",
        "public.t type",
        "public.t history",
        "public.t stored versions",
        "public.t history ends",
        "public.t current",
    }
    assert set(status["last_batch_jobs"]) == set(status["last_batch_phases"])
    assert all(n > 0 for n in status["last_batch_jobs"].values())
    merges = status["last_batch_merges"]
    assert set(merges) == {"public.t current"}
    assert merges["public.t current"]["num_updated_rows"] == 1
    # The history took appends, no MERGE: the stored version's end is in the ends table.
    paths = table_paths(h.settings.warehouse, "public.t")
    last = spark.sql(f"DESCRIBE HISTORY delta.`{paths.history}` LIMIT 1").first()
    assert last is not None and last["operation"] == "WRITE"
    ends = spark.read.format("delta").load(paths.history_ends)
    assert [tuple(r) for r in ends.collect()] == [(1, 200, 1, 300)]


def test_a_typed_row_counts_a_word_a_field_and_its_values_bytes(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The size the current state's MERGE decides by (``BatchFacts.row_bytes``): a word
    for each column, each TOAST flag, the null bits and the seven fields of a change, then
    the bytes of its texts, binaries and arrays (an array as its text)."""
    columns = (
        SynthColumn("id", "bigint", 20, key=True),
        SynthColumn("name", "text", 25),
        SynthColumn("tags", "text[]", 1009),
        SynthColumn("blob", "bytea", 17),
    )
    t = SynthTable("p", "public", "t", columns)
    h = Harness(spark, tmp_path, t)
    full = {"id": 1, "name": "hello", "tags": ["a", "bc"], "blob": "AAEC"}  # 3 bytes
    empty = {"id": 2, "name": None, "tags": None, "blob": None}
    frame = h.frame([*t.change("c", full, 100, 1), *t.change("c", empty, 100, 2)])
    schema = h.registry.merged("public.t")
    typing = RowTyping(schema, tuple(sorted(h.registry.versions["public.t"])))
    typed = typing.apply(envelopes(frame, "p"))
    sizes = sorted(r[0] for r in typed.select(typing.row_bytes).collect())
    words = 8 * (2 * 4 + 8)
    assert sizes == [words, words + len("hello") + len("[a, bc]") + 3]


def test_only_a_batch_without_toast_values_within_the_bound_is_sent_to_every_task() -> None:
    """A placeholder is filled in from the stored row, which can make a row of a few bytes
    one of kilobytes: such a batch's size is not known, and is never broadcast."""
    facts = BatchFacts(
        truncates=(),
        has_deletes=False,
        has_toast_markers=False,
        oldest_lsn=1,
        newest_lsn=2,
        changes=200_000,
        row_bytes=28_000_000,
        repeats=False,
    )
    assert fits_a_broadcast(facts)
    assert not fits_a_broadcast(replace(facts, has_toast_markers=True))
    assert not fits_a_broadcast(replace(facts, row_bytes=BROADCAST_SOURCE_BYTES + 1))


def test_a_change_twice_in_one_batch_is_stored_once_with_its_end(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A batch's ends come from the neighbours its typed rows already hold, unless a
    change comes twice in it (published twice): then its copy must not
    become its own next change, which would end it at itself and store it twice."""
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    once = [
        *t.change("c", row(1), 100, 1, 1),
        *t.change("c", row(2), 100, 2, 1),
        *t.change("c", row(3), 100, 3, 1),
        *t.change("u", row(1, "one"), 200, 1, 2),
        *t.change("d", {"id": 2}, 300, 1, 3),
    ]
    twice = [*once[:4], *once[2:4], *once[3:]]  # key 3's insert, key 1's update again
    single, repeated = Harness(spark, tmp_path / "single", t), Harness(spark, tmp_path / "rep", t)
    single.run(once)
    repeated.run(twice)

    def validity(h: Harness) -> list[tuple[int, str, int, int | None]]:
        return [
            (r["id"], r["_cdc_op"], r["valid_from_lsn"], r["valid_to_lsn"]) for r in h.history()
        ]

    assert validity(single) == [
        (1, "c", 100, 200),
        (2, "c", 100, 300),
        (3, "c", 100, None),
        (1, "u", 200, None),
        (2, "d", 300, 300),
    ]
    assert validity(repeated) == validity(single)
    assert repeated.current() == single.current()
    # A later batch, whose keys the tables hold (its ends of stored versions go to the ends
    # table, its rows are appended), with key 3's update twice in it.
    later = [*t.change("u", row(3, "three"), 400, 1, 4), *t.change("u", row(1, "uno"), 400, 2, 4)]
    single.run(later)
    repeated.run([later[0], *later])
    assert validity(repeated) == validity(single)
    assert validity(single)[2:] == [
        (3, "c", 100, 400),
        (1, "u", 200, 400),
        (2, "d", 300, 300),
        (3, "u", 400, None),
        (1, "u", 400, None),
    ]
    assert repeated.current() == single.current()


def test_older_records_never_overwrite_newer(spark: SparkSession, tmp_path: Path) -> None:
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    h = Harness(spark, tmp_path, t)
    h.run(
        [
            *t.change("c", row(1, "new"), 500, 1, 1),
            *t.change("c", row(2), 500, 2, 1),
            *t.change("d", {"id": 2}, 600, 1, 2),
        ]
    )
    # Late and older: an update of key 1 and the insert of the deleted key 2.
    h.run([*t.change("u", row(1, "old"), 400, 1, 0), *t.change("c", row(2, "zombie"), 450, 1, 0)])
    current = h.current()
    assert sorted(current) == [1]
    assert current[1]["name"] == "new"
    # A newer insert does re-create the deleted key.
    h.run(t.change("c", row(2, "back"), 700, 1, 3))
    assert h.current()[2]["name"] == "back"


def test_tombstones_are_read_only_when_one_may_be_newer_than_the_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A batch after every stored tombstone does not read them; a late change older than
    a delete the job wrote since it last read the tombstones is still turned away."""
    t = SynthTable("p", "public", "t", COLUMNS[:4])

    def stored_versions_jobs(h: Harness) -> int:
        return int(h.processor.status.as_dict()["last_batch_jobs"]["public.t stored versions"])

    plain = Harness(spark, tmp_path / "plain", t)
    deleted = Harness(spark, tmp_path / "deleted", t)
    plain.run([*t.change("c", row(1), 100, 1, 1), *t.change("c", row(2), 100, 2, 1)])
    deleted.run([*t.change("c", row(1), 100, 1, 1), *t.change("d", {"id": 2}, 100, 2, 1)])
    # The first look at the tombstones reads their newest position (once per job).
    for h in (plain, deleted):
        h.run(t.change("u", row(1, "a"), 200, 1, 2))
        h.run(t.change("u", row(1, "b"), 300, 1, 3))
    # Key 2's tombstone is older than the batch: the same jobs as without tombstones.
    assert stored_versions_jobs(deleted) == stored_versions_jobs(plain)

    deleted.run(t.change("d", {"id": 1}, 500, 1, 5))
    # Older than key 1's delete, newer than any tombstone the job read: late all the same.
    deleted.run(t.change("u", row(1, "zombie"), 400, 1, 4))
    assert deleted.current() == {}
    assert stored_versions_jobs(deleted) > stored_versions_jobs(plain)


def test_a_late_batch_reads_the_tombstones_only_when_one_may_be_newer_than_it(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A late change takes the history's MERGE, and the current state's write then
    compares each change with its key's newest stored delete: only where a tombstone may
    be at or after the batch's oldest change (they are a week of deletes)."""
    opened: list[str] = []

    class Opening:
        """``DeltaTable`` as the current-state write sees it, noting the tables it opens."""

        isDeltaTable = staticmethod(DeltaTable.isDeltaTable)

        @staticmethod
        def forPath(session: SparkSession, path: str) -> DeltaTable:
            opened.append(path)
            return DeltaTable.forPath(session, path)

    monkeypatch.setattr("spark_consumers.current.DeltaTable", Opening)
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    h = Harness(spark, tmp_path, t)
    tombstones = table_paths(h.settings.warehouse, "public.t").tombstones
    h.run([r for k in (1, 2, 3) for r in t.change("c", row(k), 100, k, 1)])
    h.run(t.change("d", {"id": 2}, 150, 1, 2))
    h.run(t.change("u", row(1, "b"), 300, 1, 3))
    opened.clear()
    # Older than key 1's stored change, newer than every tombstone: none is read.
    h.run(t.change("u", row(1, "a"), 200, 1, 4))
    assert tombstones not in opened
    assert h.current()[1]["name"] == "b"
    # Older than key 2's delete: read, and the insert turned away.
    h.run(t.change("c", row(2, "zombie"), 120, 1, 5))
    assert tombstones in opened
    assert sorted(h.current()) == [1, 3]


@pytest.mark.parametrize("keys_sent", [True, False], ids=["batch-keys-sent", "batch-too-large"])
def test_unchanged_toast_keeps_stored_value(
    spark: SparkSession, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys_sent: bool
) -> None:
    # The stored rows of the batch's keys (current state for the fill-in and the stored
    # versions, tombstones) are found either way: with the batch's keys sent to the join,
    # or, for a batch above the bound, by joining the whole tables.
    if not keys_sent:
        monkeypatch.setattr("spark_consumers.changes._BROADCAST_KEYS", 0)
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    h = Harness(spark, tmp_path, t)
    h.run(t.change("c", row(1, "long text"), 100, 1, 1))
    h.run(
        [
            *t.change("u", row(1, TOAST_PLACEHOLDER, amount="1.00"), 200, 1, 2),
            *t.change("c", row(2, "two"), 200, 2, 2),
            *t.change("u", row(2, TOAST_PLACEHOLDER, amount="2.00"), 300, 1, 3),
        ]
    )
    current = h.current()
    assert (current[1]["name"], current[1]["amount"]) == ("long text", Decimal("1.00"))
    assert (current[2]["name"], current[2]["amount"]) == ("two", Decimal("2.00"))
    assert [r["name"] for r in h.history()] == ["long text", "long text", "two", "two"]
    # A delete beside a placeholder: its tombstone (taken from the rows before the fill-in,
    # which reads the current state this batch then writes) turns away a late insert.
    h.run(
        [
            *t.change("u", row(1, TOAST_PLACEHOLDER, amount="3.00"), 400, 1, 4),
            *t.change("d", {"id": 2}, 400, 2, 4),
        ]
    )
    h.run(t.change("c", row(2, "zombie"), 350, 1, 5))
    current = h.current()
    assert sorted(current) == [1]
    assert (current[1]["name"], current[1]["amount"]) == ("long text", Decimal("3.00"))


def test_unchanged_toast_in_forty_text_columns_is_filled_in(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Updates leaving 39 of 40 text columns unchanged (TOAST placeholders) get the stored
    values, from the batch and from the current state. With Spark's constraint
    propagation on, planning such a batch ran the driver out of memory from 24 columns on
    (``spark.sql.constraintPropagation.enabled`` in the job's session)."""
    texts = (SynthColumn(f"t{n}", "text", 25) for n in range(40))
    t = SynthTable("p", "public", "wide", (SynthColumn("id", "integer", 23, key=True), *texts))
    h = Harness(spark, tmp_path, t)
    stored = {"id": 1, **{f"t{n}": f"value {n}" for n in range(40)}}
    h.run(t.change("c", stored, 100, 1, 1))
    unchanged = {f"t{n}": TOAST_PLACEHOLDER for n in range(40)}
    h.run(
        [
            *t.change("u", {"id": 1, **unchanged, "t0": "first"}, 200, 1, 2),
            *t.change("u", {"id": 1, **unchanged, "t1": "second"}, 300, 1, 3),
            *t.change("c", {**stored, "id": 2, "t39": "two"}, 300, 2, 3),
            *t.change("u", {"id": 2, **unchanged, "t0": "again"}, 400, 1, 4),
        ]
    )
    current = h.current("public.wide")
    assert current[1] == {
        **stored,
        "t0": "first",
        "t1": "second",
        "_cdc_commit_lsn": 300,
        "_cdc_total_order": 1,
    }
    assert current[2] == {
        **stored,
        "id": 2,
        "t0": "again",
        "t39": "two",
        "_cdc_commit_lsn": 400,
        "_cdc_total_order": 1,
    }
    versions = [r for r in h.history("public.wide") if r["id"] == 1]
    assert [(r["t0"], r["t1"], r["t20"]) for r in versions] == [
        ("value 0", "value 1", "value 20"),
        ("first", "value 1", "value 20"),
        ("first", "second", "value 20"),
    ]


def test_truncate(spark: SparkSession, tmp_path: Path) -> None:
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    h = Harness(spark, tmp_path, t)
    h.run([*t.change("c", row(1), 100, 1, 1), *t.change("c", row(2), 100, 2, 1)])
    h.run(
        [
            *t.change("u", row(1, "x"), 200, 1, 2),
            *t.change("t", None, 300, 1, 3),
            *t.change("c", row(3), 400, 1, 4),
        ]
    )
    assert sorted(h.current()) == [3]
    h.run(t.change("u", row(2, "late"), 250, 1, 5))  # older than the truncate
    assert sorted(h.current()) == [3]
    open_versions = [(r["id"], r["_cdc_op"]) for r in h.history() if r["valid_to_lsn"] is None]
    assert open_versions == [(3, "c")]


def test_bad_records_go_to_dead_letter(spark: SparkSession, tmp_path: Path) -> None:
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    h = Harness(spark, tmp_path, t)
    h.run(
        [
            *t.change("c", row(1), 100, 1, 1),
            (t.topic, b'{"id": 2}', b"{this is not json"),
            *t.change("c", row(3, big="not a number"), 100, 2, 1),
            *t.change("c", row(4), 100, 3, 1),
            ("p.public.unknown", b'{"id": 1}', b'{"op": "c"}'),
            # Row images that are no object of column values (one names a column twice).
            *_with_image(t.change("c", row(5), 100, 4, 1), "after", 7),
            *_with_image(t.change("c", row(6), 100, 5, 1), "after", None),
            *_with_image(t.change("d", {"id": 1}, 200, 1, 2), "before", [1]),
        ]
    )
    [(topic, key, value)] = t.change("c", row(8), 100, 6, 1)
    assert value is not None and b'"after":{"id":8' in value
    h.run([(topic, key, value.replace(b'"after":{"id":8', b'"after":{"id":9,"id":8'))])
    assert sorted(h.current()) == [1, 4]
    reasons = {(d["table"], d["offset"]): d["reason"] for d in h.dead_letters()}
    no_image = "{} missing or not a JSON object".format
    assert reasons == {
        ("public.t", 1): "value is not a change record",
        ("public.t", 2): "column big: cannot convert to bigint",
        ("public.unknown", 4): "no schema record for this table",
        ("public.t", 5): no_image("after"),
        ("public.t", 6): no_image("after"),
        ("public.t", 7): no_image("before"),
        ("public.t", 8): no_image("after"),
    }
    texts = {d["offset"]: (d["key_text"], d["value_text"]) for d in h.dead_letters()}
    assert texts[1] == ('{"id": 2}', "{this is not json")
    assert texts[4] == ('{"id": 1}', '{"op": "c"}')
    assert h.processor.status.tables["public.t"].quarantined == 6


def _with_image(records: list[Record], image: str, value: Any) -> list[Record]:
    """The records with their row image ``image`` replaced by ``value``."""
    return [
        (topic, key, json.dumps({**json.loads(raw), image: value}).encode())
        for topic, key, raw in records
        if raw is not None
    ]


def test_new_column_evolves_tables(spark: SparkSession, tmp_path: Path) -> None:
    v1 = SynthTable("p", "public", "t", COLUMNS[:4])
    v2 = SynthTable("p", "public", "t", (*COLUMNS[:4], SynthColumn("extra", "integer", 23)), 2)
    h = Harness(spark, tmp_path, v1)
    h.run(v1.change("c", row(1), 100, 1, 1))
    h.announce(v2)
    h.run(v2.change("c", {**row(2), "extra": 5}, 200, 1, 2))
    current = h.current()
    assert current[1]["extra"] is None
    assert current[2]["extra"] == 5
    assert "extra" in h.history()[0]


def test_truncate_after_a_change_closes_the_stored_version_at_the_change(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Issue #15 item 1: key 1's open version comes from an earlier batch; one batch holds
    its update and then a truncate. The old version ends at the update, the update at the
    truncate, never both at the truncate."""
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    h = Harness(spark, tmp_path, t)
    h.run([*t.change("c", row(1), 100, 1, 1), *t.change("c", row(2), 100, 2, 1)])
    h.run([*t.change("u", row(1, "x"), 200, 1, 2), *t.change("t", None, 300, 1, 3)])
    ends = {(r["id"], r["valid_from_lsn"]): r["valid_to_lsn"] for r in h.history()}
    assert ends == {(1, 100): 200, (2, 100): 300, (1, 200): 300, (None, 300): 300}


def test_late_truncate_and_late_changes_end_versions_as_in_one_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A truncate and the changes around it on different partitions reach the job in
    either order; the history must be the one a single batch gives."""
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    changes = [
        t.change("c", row(1), 100, 1, 1),
        t.change("c", row(2), 100, 2, 1),
        t.change("u", row(1, "a"), 200, 1, 2),
        t.change("t", None, 300, 1, 3),
        t.change("c", row(1, "b"), 400, 1, 4),
        t.change("u", row(1, "c"), 500, 1, 5),
        t.change("t", None, 500, 2, 5),
        t.change("c", row(3), 600, 1, 6),
    ]
    whole = Harness(spark, tmp_path / "whole", t)
    whole.run([r for c in changes for r in c])
    split = Harness(spark, tmp_path / "split", t)
    # Truncates held back (a slow partition), then the rest in two batches, replayed.
    for part in ([0, 1, 2, 4], [5, 7], [3, 6], [5, 7]):
        split.run([r for i in part for r in changes[i]])

    def ends(h: Harness) -> list[tuple[Any, ...]]:
        return sorted(
            ((r["id"] or 0), r["valid_from_lsn"], r["_cdc_total_order"], r["valid_to_lsn"] or 0)
            for r in h.history()
        )

    assert (
        ends(split)
        == ends(whole)
        == [
            (0, 300, 1, 300),
            (0, 500, 2, 500),
            (1, 100, 1, 200),
            (1, 200, 1, 300),
            (1, 400, 1, 500),
            (1, 500, 1, 500),
            (2, 100, 2, 300),
            (3, 600, 1, 0),
        ]
    )
    assert split.current() == whole.current()


def test_new_serial_keys_are_appended_and_replay_after_a_restart_changes_nothing(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A batch whose keys all lie above every stored key is appended to both tables
    without a MERGE; replayed by a new job (which reads the largest stored key again) and
    followed by other batches, the tables are those one batch of every change gives."""
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    first = [*t.change("c", row(1), 100, 1, 1), *t.change("c", row(2), 100, 2, 1)]
    serial = [
        *t.change("c", row(3), 200, 1, 2),
        *t.change("u", row(3, "x"), 300, 1, 3),
        *t.change("c", row(4), 300, 2, 3),
        *t.change("d", {"id": 4}, 400, 1, 4),
    ]
    last = [*t.change("c", row(5), 500, 1, 5), *t.change("u", row(1, "y"), 500, 2, 5)]
    whole = Harness(spark, tmp_path / "whole", t)
    whole.run([*first, *serial, *last])
    split = Harness(spark, tmp_path / "split", t)
    split.run(first)
    split.run(serial)
    assert split.processor.status.last_batch_timings.merges == {}  # two appends
    # A new job on the same tables (killed before its checkpoint): the batch again.
    split = Harness(spark, tmp_path / "split", t)
    split.run(serial)
    split.run(last)
    # Key 1's stored version ends: the current state MERGEs, the history appends.
    assert set(split.processor.status.last_batch_timings.merges) == {"public.t current"}

    def ends(h: Harness) -> list[tuple[Any, ...]]:
        return sorted((r["id"], r["valid_from_lsn"], r["valid_to_lsn"]) for r in h.history())

    assert (
        ends(split)
        == ends(whole)
        == [
            (1, 100, 500),
            (1, 500, None),
            (2, 100, None),
            (3, 200, 300),
            (3, 300, None),
            (4, 300, 400),
            (4, 400, 400),
            (5, 500, None),
        ]
    )
    assert split.current() == whole.current()
    assert sorted(whole.current()) == [1, 2, 3, 5]


def test_a_table_without_a_key_is_appended_and_only_a_truncate_ends_its_rows(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Nothing identifies a keyless row's next version, so its rows stay open until a
    truncate: a batch is appended without a MERGE over the stored rows (which would read
    the whole history, every row being open), a replay by a new job adds nothing, and a
    truncate still closes every row before it."""
    t = SynthTable("p", "public", "log", (SynthColumn("a", "integer", 23), COLUMNS[3]))
    first = [
        *t.change("c", {"a": 1, "name": "x"}, 100, 1, 1),
        *t.change("c", {"a": 1, "name": "x"}, 100, 2, 1),  # the same row twice
    ]
    second = [
        *t.change("c", {"a": 2, "name": "y"}, 200, 1, 2),
        *t.change("d", {"a": 1, "name": "x"}, 200, 2, 2),
    ]
    h = Harness(spark, tmp_path, t)
    h.run(first)
    h.run(second)
    assert h.processor.status.last_batch_timings.merges == {}  # an append
    # A new job on the same table (killed before its checkpoint): the batch again.
    h = Harness(spark, tmp_path, t)
    h.run(second)
    assert set(h.processor.status.last_batch_timings.merges) == {"public.log history"}
    h.run([*t.change("t", None, 300, 1, 3), *t.change("c", {"a": 3, "name": "z"}, 400, 1, 4)])
    rows = [
        (r["a"], r["_cdc_op"], r["valid_from_lsn"], r["valid_to_lsn"])
        for r in h.history("public.log")
    ]
    assert rows == [
        (1, "c", 100, 300),
        (1, "c", 100, 300),
        (2, "c", 200, 300),
        (1, "d", 200, 200),
        (None, "t", 300, 300),
        (3, "c", 400, None),
    ]
    assert not DeltaTable.isDeltaTable(
        spark, table_paths(h.settings.warehouse, "public.log").current
    )


def test_ends_wait_in_their_table_until_housekeeping_folds_them(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A batch closes stored versions in the ends table, not in the history's files; a late
    change of such a key (the MERGE path) starts from those ends, and its earlier end wins
    over the waiting one; the fold writes the rest into the history. At every step the
    resolved history is the one a single batch of every change gives."""
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    first = [*t.change("c", row(1), 100, 1, 1), *t.change("c", row(2), 100, 2, 1)]
    updates = [*t.change("u", row(1, "a"), 300, 1, 3), *t.change("u", row(2, "a"), 300, 2, 3)]
    late = t.change("u", row(1, "late"), 200, 1, 2)
    last = t.change("u", row(2, "b"), 400, 1, 4)
    whole = Harness(spark, tmp_path / "whole", t)
    whole.run([*first, *late, *updates, *last])
    split = Harness(spark, tmp_path / "split", t)
    paths = table_paths(split.settings.warehouse, "public.t")

    def ends(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        return sorted((r["id"], r["valid_from_lsn"], r["valid_to_lsn"] or 0) for r in rows)

    def stored() -> list[tuple[Any, ...]]:
        rows = spark.read.format("delta").load(paths.history).collect()
        return ends([r.asDict() for r in rows])

    split.run(first)
    split.run(updates)
    assert stored() == [(1, 100, 0), (1, 300, 0), (2, 100, 0), (2, 300, 0)]
    assert ends(split.history()) == [(1, 100, 300), (1, 300, 0), (2, 100, 300), (2, 300, 0)]
    split.run(late)
    split.run(last)
    expected = [
        (1, 100, 200),
        (1, 200, 300),
        (1, 300, 0),
        (2, 100, 300),
        (2, 300, 400),
        (2, 400, 0),
    ]
    assert ends(split.history()) == ends(whole.history()) == expected
    waiting = spark.read.format("delta").load(paths.history_ends).collect()
    assert sorted(tuple(r) for r in waiting) == [
        (1, 100, 1, 300),
        (2, 100, 2, 300),
        (2, 300, 2, 400),
    ]
    assert fold_history_ends(spark, paths) == 3
    assert spark.read.format("delta").load(paths.history_ends).count() == 0
    assert stored() == ends(split.history()) == expected
    assert fold_history_ends(spark, paths) == 0
    assert split.current() == whole.current()


def test_a_change_of_a_stored_key_is_merged_after_a_batch_of_smaller_keys(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The largest stored key only grows: a batch of smaller keys must not lower it, or a
    later change of the largest key would be appended as a second row."""
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    h = Harness(spark, tmp_path, t)
    h.run(t.change("c", row(0), 100, 1, 1))
    h.run(t.change("c", row(-5), 200, 1, 2))
    h.run(t.change("u", row(0, "x"), 300, 1, 3))
    path = table_paths(h.settings.warehouse, "public.t").current
    assert spark.read.format("delta").load(path).count() == 2
    assert h.current()[0]["name"] == "x"
    assert sorted((r["id"], r["valid_from_lsn"], r["valid_to_lsn"]) for r in h.history()) == [
        (-5, 200, None),
        (0, 100, 300),
        (0, 300, None),
    ]


def test_keys_the_current_state_lacks_are_appended_and_a_stored_key_is_merged(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A batch none of whose keys has a current-state row (a serial key committed after a
    larger one, a deleted key inserted again) is appended to both tables; a later change
    of such a key is merged, never appended as a second row. A batch all of whose keys
    have one is merged without an insert clause, a batch with some with one. Split or
    whole, the tables are the same."""
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    first = [*t.change("c", row(1), 100, 1, 1), *t.change("c", row(3), 100, 2, 1)]
    smaller = t.change("c", row(2), 200, 1, 2)
    update = t.change("u", row(2, "x"), 300, 1, 3)
    delete = t.change("d", {"id": 1}, 400, 1, 4)
    again = t.change("c", row(1, "again"), 500, 1, 5)
    mixed = [*t.change("u", row(3, "y"), 600, 1, 6), *t.change("c", row(0, "zero"), 600, 2, 6)]
    whole = Harness(spark, tmp_path / "whole", t)
    whole.run([*first, *smaller, *update, *delete, *again, *mixed])
    split = Harness(spark, tmp_path / "split", t)
    merges = []
    for batch in (first, smaller, update, delete, again, mixed):
        split.run(batch)
        merges.append(set(split.processor.status.last_batch_timings.merges))
    current = {"public.t current"}
    assert merges == [set(), set(), current, current, set(), current]
    path = table_paths(split.settings.warehouse, "public.t").current
    inserts = [
        json.loads(r["operationParameters"]["notMatchedPredicates"])
        for r in spark.sql(f"DESCRIBE HISTORY delta.`{path}`")
        .where("operation = 'MERGE'")
        .orderBy("version")
        .collect()
    ]
    assert [[p["actionType"] for p in clauses] for clauses in inserts] == [[], [], ["insert"]]
    assert spark.read.format("delta").load(path).count() == 4
    assert split.current() == whole.current()
    assert split.current()[2]["name"] == "x" and split.current()[1]["name"] == "again"
    assert (split.current()[3]["name"], split.current()[0]["name"]) == ("y", "zero")
    assert split.history() == whole.history()
    assert sorted((r["id"], r["valid_from_lsn"], r["valid_to_lsn"]) for r in split.history()) == [
        (0, 600, None),
        (1, 100, 400),
        (1, 400, 400),
        (1, 500, None),
        (2, 200, 300),
        (2, 300, None),
        (3, 100, 600),
        (3, 600, None),
    ]


def test_a_phase_counts_the_spark_jobs_its_job_group_ran(spark: SparkSession) -> None:
    """The jobs of a phase are the ones its job group started during it, also when the
    group already holds many (a long-running query's does: they are read from the JVM as
    one text, not one round trip per id)."""
    context = spark.sparkContext
    context.setJobGroup("phase-count-test", "BatchTimings")
    try:
        for _ in range(30):
            context.parallelize(range(3)).count()
        timings = BatchTimings(context=context)
        with timings.phase("two jobs"):
            context.parallelize(range(3)).count()
            context.parallelize(range(3)).collect()
        with timings.phase("none"):
            pass
    finally:
        # None removes the property: the session's later jobs are in no group again.
        context.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
    assert timings.jobs == {"two jobs": 2, "none": 0}


def test_a_steady_batch_reuses_the_code_spark_generated_for_the_last(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Batches of the same shape run the same plans, so from the second such batch on the
    driver JVM loads few classes: Spark's generated code comes from its codegen cache.

    Four tables of different columns run more distinct generated classes a batch than
    Spark's default cache holds (100), so every batch compiled and loaded them all
    again (``spark.sql.codegen.cache.maxEntries`` in the job's session). The filters by
    the batch's key range were new code every batch too while their bounds were the
    batch's own keys; on a grid (``changes.grid_bounds``) these batches share them.
    """
    tables = [SynthTable("p", "public", f"w{n}", COLUMNS[:n]) for n in (4, 7, 10, 13)]
    h = Harness(spark, tmp_path, *tables)
    h.run([r for t in tables for key in (1, 2, 3) for r in t.change("c", row(key), 100, key, 1)])
    loaded = []
    for n in range(1, 5):
        lsn = 100 + 100 * n
        # Updates of stored keys and a new key: the look for stored versions, the history
        # and ends appends and the current-state MERGE, every batch.
        changes = [(key, "u", row(key, f"v{n}")) for key in (1, 2, 3)] + [
            (10 + n, "c", row(10 + n))
        ]
        h.run(
            [
                r
                for t in tables
                for order, (_, op, values) in enumerate(changes, 1)
                for r in t.change(op, values, lsn, order, n + 1)
            ]
        )
        loaded.append(h.processor.status.last_batch_timings.jvm["classes_loaded"])
    assert h.current("public.w13")[2]["name"] == "v4"
    # The first of these batches compiles the MERGE paths' code (~3,000 classes: Spark
    # 4.0, Delta 4.0); the later ones reuse it and load 48-65 (85-92 with the exact key
    # range in the filters). With the default cache they loaded 819-850 each.
    assert max(loaded[2:]) < 250, loaded


def test_the_session_jvm_collects_with_the_parallel_collector(spark: SparkSession) -> None:
    """``job.session_conf``'s collector reaches the JVM that runs the batches (local mode:
    the driver's), whose default on two cores or more is G1."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    beans = jvm.java.lang.management.ManagementFactory.getGarbageCollectorMXBeans()
    names = {beans.get(i).getName() for i in range(beans.size())}
    assert names == {"PS Scavenge", "PS MarkSweep"}


def _stats_columns(path: str) -> set[str]:
    """The columns any data file of the Delta table at ``path`` has min/max statistics of,
    from the add actions of its log (Delta's protocol: ``stats`` is a JSON text)."""
    columns: set[str] = set()
    for commit in sorted(Path(path, "_delta_log").glob("*.json")):
        for line in commit.read_text().splitlines():
            add = json.loads(line).get("add")
            if add and add.get("stats"):
                columns |= set(json.loads(add["stats"]).get("minValues", {}))
    return columns


def test_statistics_are_kept_of_the_key_the_positions_and_the_chosen_columns(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Each table keeps min/max statistics of what reads skip files by (its key, the change
    position, the history's end and commit time) and of the columns the operator names in
    ``stats_columns``, and of nothing else: Delta's default (the first 32 columns) cost
    every write statistics of source columns no read skips by, and left the positions of
    a table of more than 32 columns without any.

    Covered: a table of 40 columns created before the setting (Delta's default), a key
    Delta keeps no statistics of (bytea), a key whose name needs column mapping."""
    wide = SynthTable(
        "p",
        "public",
        "wide",
        (*COLUMNS[:4], *(SynthColumn(f"c{n}", "bigint", 20) for n in range(36))),
    )
    blob_key = SynthTable(
        "p",
        "public",
        "blobkey",
        (SynthColumn("id", "integer", 23, key=True), SynthColumn("blob", "bytea", 17, key=True)),
    )
    odd_columns = (SynthColumn("the,key", "integer", 23, key=True), SynthColumn("v", "text", 25))
    odd = SynthTable("p", "public", "odd", odd_columns)
    chosen = {"public.wide": ["name", "c35", "later"]}
    h = Harness(spark, tmp_path, wide, blob_key, odd, stats_columns=chosen)
    paths = table_paths(h.settings.warehouse, "public.wide")
    registry_schema = h.registry.merged("public.wide")
    ensure_table(spark, paths.current, current_struct(registry_schema))
    wide_row = {f"c{n}": n for n in range(36)}
    h.run(
        [
            *[r for k in (1, 2) for r in wide.change("c", {**row(k), **wide_row}, 100, k, 1)],
            *blob_key.change("c", {"id": 1, "blob": "AP8="}, 100, 3, 1),
            *odd.change("c", {"the,key": 1, "v": "a"}, 100, 4, 1),
        ]
    )
    h.run(
        [
            *wide.change("u", {**row(1, "x"), **wide_row}, 200, 1, 2),
            *wide.change("d", {"id": 2}, 200, 2, 2),
            *blob_key.change("d", {"id": 1, "blob": "AP8="}, 200, 3, 2),
            *odd.change("u", {"the,key": 1, "v": "b"}, 200, 4, 2),
        ]
    )
    position = {"_cdc_commit_lsn", "_cdc_total_order"}
    assert _stats_columns(paths.current) == {"id", "name", "c35", *position}
    # A column named in the setting that the source adds later gets statistics from then on.
    wide_v2 = SynthTable(
        "p", "public", "wide", (*wide.columns, SynthColumn("later", "text", 25)), 2
    )
    h.announce(wide_v2)
    h.run(wide_v2.change("c", {**row(3), **wide_row, "later": "l"}, 300, 1, 3))
    assert _stats_columns(paths.current) == {"id", "name", "c35", "later", *position}
    assert _stats_columns(paths.history) == {
        "id",
        "name",
        "c35",
        "later",
        *position,
        "_cdc_commit_ts",
        "valid_to_lsn",
    }
    assert _stats_columns(paths.history_ends) == {"id", *position, "valid_to_lsn"}
    assert _stats_columns(paths.tombstones) == {"id", *position, "_cdc_commit_ts"}
    blob_paths = table_paths(h.settings.warehouse, "public.blobkey")
    assert _stats_columns(blob_paths.current) == {"id", *position}
    odd_paths = table_paths(h.settings.warehouse, "public.odd")
    detail = spark.sql(f"DESCRIBE DETAIL delta.`{odd_paths.current}`").first()
    assert detail is not None
    assert detail["properties"]["delta.dataSkippingStatsColumns"] == (
        "`the,key`,`_cdc_commit_lsn`,`_cdc_total_order`"
    )
    assert h.current("public.wide")[1]["name"] == "x"
    assert sorted(h.current("public.wide")) == [1, 3]
    odd_rows = spark.read.format("delta").load(odd_paths.current).collect()
    assert [(r["the,key"], r["v"]) for r in odd_rows] == [(1, "b")]


def test_deletion_vectors_give_every_delta_reader_the_same_tables(
    spark: SparkSession, tmp_path: Path
) -> None:
    """With ``deletion_vectors`` the MERGEs mark rows instead of rewriting files; the
    tables are those written without them, and delta-rs applies the vectors as Spark does."""
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    batches = [
        [r for k in range(1, 7) for r in t.change("c", row(k), 100, k, 1)],
        [*t.change("u", row(2, "b"), 200, 1, 2), *t.change("d", {"id": 3}, 200, 2, 2)],
        [*t.change("u", row(2, "c"), 300, 1, 3), *t.change("c", row(3, "again"), 300, 2, 3)],
    ]
    plain = Harness(spark, tmp_path / "plain", t)
    marked = Harness(spark, tmp_path / "marked", t, deletion_vectors=True)
    for h in (plain, marked):
        for batch in batches:
            h.run(batch)
        # Batches end stored versions in the ends table; the fold MERGEs them in.
        assert fold_history_ends(spark, table_paths(h.settings.warehouse, "public.t")) == 3
    assert marked.current() == plain.current()
    assert marked.history() == plain.history()
    for kind in ("current", "history"):
        path = getattr(table_paths(marked.settings.warehouse, "public.t"), kind)
        commits = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").collect()
        assert sum(
            int(c["operationMetrics"].get("numTargetDeletionVectorsAdded", 0)) for c in commits
        ), f"{kind}: no MERGE used a deletion vector"
        by_spark = spark.read.format("delta").load(path).toArrow().sort_by("_cdc_commit_lsn")
        by_delta_rs = (
            QueryBuilder().register("t", DeltaLakeTable(path)).execute("SELECT * FROM t").read_all()
        )
        assert sorted(by_spark.to_pylist(), key=repr) == sorted(
            pa.table(by_delta_rs).to_pylist(), key=repr
        ), kind


def test_a_merge_writes_files_of_at_most_max_rows_per_file(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``max_rows_per_file`` reaches the session, and Delta's MERGE keeps to it: updates of
    every other key of a 1,000-row table (files of at most 100 rows after the insert) are
    written back in files of at most 100 rows, where the join's two partitions would have
    made two files of 500."""
    bound = "spark.sql.files.maxRecordsPerFile"
    conf = session_conf(
        ConsumerSettings(
            kafka_bootstrap="unused:9",
            warehouse="/unused",
            checkpoint_dir="/unused",
            max_rows_per_file=100,
        )
    )
    with _session_settings(spark, {bound: conf[bound]}):
        t = SynthTable("p", "public", "t", COLUMNS[:4])
        h = Harness(spark, tmp_path, t)
        h.run([r for k in range(1000) for r in t.change("c", row(k), 100, k + 1, 1)])
        h.run([r for k in range(0, 1000, 2) for r in t.change("u", row(k, "b"), 200, k + 1, 2)])
        current = table_paths(h.settings.warehouse, "public.t").current
        operations = [
            c["operation"] for c in spark.sql(f"DESCRIBE HISTORY delta.`{current}`").collect()
        ]
        rows_per_file = [
            r["count"]
            for r in spark.read.format("delta")
            .load(current)
            .groupBy(F.input_file_name())
            .count()
            .collect()
        ]
    assert "MERGE" in operations
    assert sum(rows_per_file) == 1000 and max(rows_per_file) <= 100, rows_per_file
    assert {k: r["name"] for k, r in h.current().items()} == {
        k: "b" if k % 2 == 0 else "n" for k in range(1000)
    }


def test_compaction_leaves_full_files_alone(spark: SparkSession, tmp_path: Path) -> None:
    """Housekeeping's OPTIMIZE keeps to ``max_rows_per_file`` and rewrites only files
    under ``optimize.minFileSize``: set below the size of a full file (the job's 8 MB
    stands for a full file of 1M rows; here files of 100 rows), the batches' small files
    are compacted and the full ones left as they are, and a second run rewrites nothing.
    With Delta's default (1 GB) every run rewrites the full files again."""
    bound = "spark.sql.files.maxRecordsPerFile"
    smallest = "spark.databricks.delta.optimize.minFileSize"
    with _session_settings(spark, {bound: "100", smallest: str(1 << 30)}):
        t = SynthTable("p", "public", "t", COLUMNS[:4])
        h = Harness(spark, tmp_path, t)
        h.run([r for k in range(1000) for r in t.change("c", row(k), 100, k + 1, 1)])
        for n in range(3):
            new = range(1000 + 5 * n, 1005 + 5 * n)
            h.run([r for k in new for r in t.change("c", row(k), 200 + n, k + 1, 2 + n)])
        current = table_paths(h.settings.warehouse, "public.t").current

        def files() -> dict[str, tuple[int, int]]:
            """Each data file: its rows and bytes."""
            frame = spark.read.format("delta").load(current).groupBy(F.input_file_name())
            counts = frame.count().collect()
            return {r[0]: (r[1], os.path.getsize(urlparse(r[0]).path)) for r in counts}

        def compact() -> int:
            metrics = DeltaTable.forPath(spark, current).optimize().executeCompaction().first()
            assert metrics is not None
            return int(metrics["metrics"]["numFilesRemoved"])

        before = files()
        full = {f for f, (rows, _) in before.items() if rows == 100}
        threshold = int(0.8 * min(before[f][1] for f in full))
        small = {f for f, (_, size) in before.items() if size < threshold}
        assert len(full) >= 8 and len(small) >= 3 and not small & full, before
        spark.conf.set(smallest, str(threshold))
        assert compact() == len(small)
        after = files()
        assert full <= set(after) and sum(rows for rows, _ in after.values()) == 1015, after
        assert compact() == 0  # nothing left to compact
        spark.conf.set(smallest, str(1 << 30))
        assert compact() >= len(full)  # Delta's default: the full files once more


@contextlib.contextmanager
def _session_settings(spark: SparkSession, settings: dict[str, str]) -> Iterator[None]:
    """Spark settings changed for one test and put back after it: one session serves every
    test."""
    saved = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, old)


def test_infinities_and_bc_values_are_stored(spark: SparkSession, tmp_path: Path) -> None:
    """PostgreSQL's infinities become the extreme values of the Parquet types, BC values
    their astronomical years (1 BC is year 0); nothing is quarantined."""
    t = SynthTable("p", "public", "t", (*COLUMNS[:4], COLUMNS[5], COLUMNS[6], COLUMNS[7]))
    h = Harness(spark, tmp_path, t)
    edge = {"id": 0, "amount": "1.00", "big": 1, "name": "e"}
    h.run(
        [
            *t.change(
                "c",
                {**edge, "id": 1, "at": "infinity", "local": "-infinity", "day": "infinity"},
                100,
                1,
                1,
            ),
            *t.change(
                "c",
                {**edge, "id": 2, "at": "-infinity", "local": "infinity", "day": "-infinity"},
                100,
                2,
                1,
            ),
            *t.change(
                "c",
                {
                    **edge,
                    "id": 3,
                    "at": "0044-03-15T12:00:00.5Z BC",
                    "local": "0001-01-01T00:00:00 BC",
                    "day": "4714-11-24 BC",
                },
                100,
                3,
                1,
            ),
        ]
    )
    assert not _delta_table_exists(spark, dead_letter_path(h.settings.warehouse))
    path = table_paths(h.settings.warehouse, "public.t").current
    rows = {
        r["id"]: (r["at"], r["local"], r["day"])
        for r in spark.read.format("delta")
        .load(path)
        .selectExpr(
            "id",
            "unix_micros(at) AS at",
            "unix_micros(cast(local AS timestamp)) AS local",
            "unix_date(day) AS day",
        )
        .collect()
    }
    biggest, days = 2**63 - 1, 2**31 - 1
    assert rows[1] == (biggest, -biggest, days)
    assert rows[2] == (-biggest, biggest, -days)
    texts = (
        spark.read.format("delta")
        .load(path)
        .where("id = 3")
        .selectExpr("cast(at AS string)", "cast(local AS string)", "cast(day AS string)")
        .first()
    )
    assert texts is not None
    assert tuple(texts) == ("-0043-03-15 12:00:00.5", "0000-01-01 00:00:00", "-4713-11-24")


def test_json_null_is_stored_as_json_text(spark: SparkSession, tmp_path: Path) -> None:
    """A jsonb ``null`` (named in ``json_nulls``) is the JSON text ``null``; SQL NULL stays
    NULL; the marker of a delete's image is its ``before``."""
    t = SynthTable("p", "public", "t", (COLUMNS[0], COLUMNS[4]))
    h = Harness(spark, tmp_path, t)

    def marked(records: list[Record], nulls: dict[str, list[str]]) -> list[Record]:
        topic, key, value = records[0]
        assert value is not None
        return [
            (topic, key, json.dumps({**json.loads(value), "json_nulls": nulls}).encode()),
            *records[1:],
        ]

    h.run(
        [
            *marked(t.change("c", {"id": 1, "doc": None}, 100, 1, 1), {"after": ["doc"]}),
            *t.change("c", {"id": 2, "doc": None}, 100, 2, 1),
            *t.change("c", {"id": 3, "doc": {"a": None}}, 100, 3, 1),
        ]
    )
    assert {k: r["doc"] for k, r in h.current().items()} == {1: "null", 2: None, 3: '{"a":null}'}
    h.run(marked(t.change("d", {"id": 1, "doc": None}, 200, 1, 2), {"before": ["doc"]}))
    deleted = [r for r in h.history() if r["_cdc_op"] == "d"]
    assert [(r["id"], r["doc"]) for r in deleted] == [(1, "null")]


def test_multi_dimensional_arrays_follow_the_declared_dimensions(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``int[][]``/``text[][]`` columns become arrays of arrays; a value with other
    dimensions than its column declares is set aside with the column named, never stored
    as text that only looks right."""
    t = SynthTable(
        "p",
        "public",
        "t",
        (
            COLUMNS[0],
            SynthColumn("grid", "integer[]", 1007, dimensions=2),
            SynthColumn("words", "text[]", 1009, dimensions=2),
            SynthColumn("flat", "text[]", 1009),
        ),
    )
    h = Harness(spark, tmp_path, t)
    good = {"grid": [[1, 2], [3, None]], "words": [["a", "b"], ["c", None]], "flat": ["x", None]}
    h.run(
        [
            *t.change("c", {"id": 1, **good}, 100, 1, 1),
            *t.change("c", {"id": 2, "grid": [], "words": [], "flat": []}, 100, 2, 1),
            *t.change("c", {**good, "id": 3, "flat": [["a"], ["b"]]}, 100, 3, 1),
            *t.change("c", {**good, "id": 4, "grid": [1, 2]}, 100, 4, 1),
            *t.change("c", {**good, "id": 5, "words": [[["a"]]]}, 100, 5, 1),
        ]
    )
    current = h.current()
    assert sorted(current) == [1, 2]
    assert {k: v for k, v in current[1].items() if k in good} == good
    assert (current[2]["grid"], current[2]["words"], current[2]["flat"]) == ([], [], [])
    reasons = sorted(d["reason"] for d in h.dead_letters())
    assert reasons == [
        "column flat: cannot convert to array<string>",
        "column grid: cannot convert to array<array<int>>",
        "column words: cannot convert to array<array<string>>",
    ], reasons


def _delta_table_exists(spark: SparkSession, path: str) -> bool:
    from delta.tables import DeltaTable

    return DeltaTable.isDeltaTable(spark, path)


def _data_files(path: str) -> set[str]:
    """The Parquet files in the table's folder, referenced by its log or not."""
    return {p.name for p in Path(path).glob("*.parquet")}


def _live_files(spark: SparkSession, path: str) -> int:
    """The files the table's latest version is made of."""
    detail = DeltaTable.forPath(spark, path).detail().first()
    assert detail is not None
    return int(detail["numFiles"])


def test_housekeeping_compacts_vacuums_and_trims_tombstones(
    spark: SparkSession, tmp_path: Path
) -> None:
    t = SynthTable("p", "public", "t", COLUMNS[:4])
    h = Harness(spark, tmp_path, t)
    hour = 3_600_000
    h.run([r for k in range(1, 7) for r in t.change("c", row(k), 100, k, 1)])
    h.run(t.change("d", {"id": 1}, 200, 1, 2))
    h.run(t.change("d", {"id": 2}, 300, 1, 3, ts_ms=1_700_000_000_000 + 10 * hour))
    for lsn in range(400, 700, 100):
        # New keys only add files to both tables (a MERGE rewrites only files it matched).
        h.run(t.change("c", row(lsn), lsn, 1, lsn, ts_ms=1_700_000_000_000 + 11 * hour))
    paths = table_paths(h.settings.warehouse, "public.t")
    current, history = h.current(), h.history()
    files_before = {p: _data_files(p) for p in (paths.current, paths.history)}
    assert all(len(files) > 1 for files in files_before.values())
    live_before = {p: _live_files(spark, p) for p in files_before}
    assert all(n > 1 for n in live_before.values()), live_before

    # Due after one interval; retention 0 h for files and 1 h for tombstones: the delete
    # of key 1 is 11 hours older than the newest change, the one of key 2 just 1 hour.
    keeper = Housekeeper(interval_s=0.001, vacuum_retention_hours=0, tombstone_retention_hours=5)
    assert not keeper.due(time.monotonic())
    time.sleep(0.01)
    assert keeper.due(time.monotonic())
    upkeep = keeper.run(spark, h.settings.warehouse, {"public.t": paths})

    assert upkeep.tombstones_trimmed == 1
    stones = spark.read.format("delta").load(paths.tombstones).collect()
    assert [(r["id"], r["_cdc_commit_lsn"]) for r in stones] == [(2, 300)]
    assert upkeep.files_compacted >= sum(live_before.values())
    assert upkeep.files_vacuumed >= sum(len(f) for f in files_before.values())
    for path, before in files_before.items():
        # One compacted file is left on disk, and none of the files before it.
        assert _live_files(spark, path) == 1, path
        assert len(_data_files(path)) == 1 and not _data_files(path) & before, path
    # The tables hold the same rows, and later batches apply as before.
    assert h.current() == current and h.history() == history
    h.run(t.change("c", row(2, "zombie"), 250, 1, 2))  # late, older than key 2's delete
    h.run(t.change("u", row(3, "last"), 900, 1, 9))
    assert sorted(h.current()) == [3, 4, 5, 6, 400, 500, 600]
    assert h.current()[3]["name"] == "last"
