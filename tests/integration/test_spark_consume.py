"""The Spark consumer against real Kafka (and, end to end, the real bridge and PostgreSQL).

One SparkSession serves the module: it runs the consumer in-process (``availableNow``
trigger) and reads the Delta tables back. The crash test runs the consumer as its own
process (``slotbridge consume``) so it can be SIGKILLed mid-run, driver and JVM together.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import random
import shlex
import signal
import struct
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import duckdb
import pyarrow as pa
import pytest
from deltalake import DeltaTable as DeltaLakeTable
from deltalake import QueryBuilder
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import FloatType, StringType, TimestampType

from slotbridge_dev.stack.cluster import free_ports, wait_until
from slotbridge_dev.stack.stack import Stack
from slotbridge_dev.synthetic import Record, SynthColumn, SynthTable, TransactionalWriter
from spark_consumers.job import start_query
from spark_consumers.schema import spark_type
from spark_consumers.settings import ConsumerSettings
from spark_consumers.status import Status
from spark_consumers.tables import (
    TablePaths,
    dead_letter_path,
    gaps_path,
    resolved_history,
    resolved_history_sql,
    table_paths,
)
from tests.integration.bridge_harness import Pipeline, one_line_error, run_cli, sql

pytestmark = pytest.mark.spark

REPO = Path(__file__).resolve().parents[2]
NUM = ((10 << 16) | 2) + 4  # numeric(10,2)
TS_FORMAT = "yyyy-MM-dd HH:mm:ss.SSSSSS"


def consumer_settings(stack: Stack, prefix: str, root: Path, **extra: Any) -> ConsumerSettings:
    extra.setdefault("http_port", 0)
    return ConsumerSettings(
        kafka_bootstrap=stack.kafka_bootstrap,
        topic_prefix=prefix,
        warehouse=str(root / "warehouse"),
        checkpoint_dir=str(root / "checkpoint"),
        status_path=root / "status.json",
        shuffle_partitions=2,
        **extra,
    )


def consume_once(spark: SparkSession, settings: ConsumerSettings) -> Status:
    """Run the consumer until it has applied everything Kafka holds now."""
    status = Status()
    query = start_query(spark, settings, status, once=True)
    query.awaitTermination()
    assert query.exception() is None, query.exception()
    return status


def _table(spark: SparkSession, path: str) -> DataFrame:
    """A Delta table's rows; a history table's resolved (``resolved_history``): the ends
    housekeeping has not folded in yet are taken from its ``_history_ends`` table."""
    where = Path(path)
    if where.parent.name == "history":
        return resolved_history(spark, table_paths(str(where.parents[1]), where.name))
    return spark.read.format("delta").load(path)


def delta_rows(spark: SparkSession, path: str) -> list[dict[str, Any]]:
    frame = _table(spark, path)
    # Timestamps as UTC text: Python's datetime conversion would use the local zone.
    frame = frame.select(
        *[
            F.date_format(f.name, TS_FORMAT).alias(f.name)
            if isinstance(f.dataType, TimestampType)
            else F.col(f"`{f.name}`")
            for f in frame.schema.fields
        ]
    )
    return [r.asDict(recursive=True) for r in frame.collect()]


# -- every Delta reader, not only Spark ----------------------------------------------------


def _delta_log_state(path: Path) -> tuple[list[str], dict[str, str]]:
    """A Delta table's data files at its latest version and its column names (physical
    name -> name; the same unless the table maps names), from its log alone.

    DuckDB's delta extension is downloaded at run time (not possible offline), so DuckDB
    reads the Parquet files the log lists: the last checkpoint, then the commits after it.
    """
    log_dir = path / "_delta_log"
    live: set[str] = set()
    schema = ""
    after = -1
    last = log_dir / "_last_checkpoint"
    if last.exists():
        after = int(json.loads(last.read_text())["version"])
        parts = sorted(str(p) for p in log_dir.glob(f"{after:020d}.checkpoint*.parquet"))
        rows = duckdb.execute(
            f"SELECT add.path, add.deletionVector, metaData.schemaString "
            f"FROM read_parquet({parts!r})"
        ).fetchall()
        assert all(dv is None for _, dv, _ in rows), f"{path}: deletion vectors"
        live.update(p for p, _, _ in rows if p is not None)
        schema = next((s for _, _, s in rows if s is not None), schema)
    for commit in sorted(p for p in log_dir.glob("*.json") if int(p.stem) > after):
        for line in commit.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                assert action["add"].get("deletionVector") is None, f"{path}: deletion vectors"
                live.add(action["add"]["path"])
            elif "remove" in action:
                live.discard(action["remove"]["path"])
            elif "metaData" in action:
                schema = action["metaData"]["schemaString"]
    names = {
        f["metadata"].get("delta.columnMapping.physicalName", f["name"]): f["name"]
        for f in json.loads(schema)["fields"]
    }
    return sorted(str(path / unquote(p)) for p in live), names


def _canonical(value: Any) -> Any:
    """One form per value across Arrow readers (time zones, NaN, bytes, nesting)."""
    if isinstance(value, float) and value != value:
        return "NaN"
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            value = value.astimezone(dt.UTC).replace(tzinfo=None)
        return value.isoformat()
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).hex()
    if isinstance(value, list):
        return tuple(_canonical(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _canonical(v)) for k, v in value.items()))
    return value


def _rows(table: pa.Table) -> list[tuple[tuple[str, Any], ...]]:
    return sorted(
        (tuple(sorted((k, _canonical(v)) for k, v in row.items())) for row in table.to_pylist()),
        key=repr,
    )


def _duckdb_view(duck: duckdb.DuckDBPyConnection, name: str, path: Path) -> None:
    """A DuckDB view ``name`` of a Delta table's rows, from the Parquet files its log lists
    (a table without files: no rows, the columns of the history view of the same name)."""
    files, names = _delta_log_state(path)
    if files:
        columns = ", ".join(f'"{physical}" AS "{name}"' for physical, name in names.items())
        duck.execute(
            f"CREATE VIEW {name} AS SELECT {columns} FROM read_parquet({files!r}, "
            "union_by_name=true)"
        )
    else:
        columns = ", ".join(f'"{name}"' for name in names.values())
        duck.execute(f"CREATE VIEW {name} AS SELECT {columns} FROM history WHERE false")


def _assert_resolved_history_agrees(spark: SparkSession, warehouse: str, table: str) -> None:
    """``resolved_history_sql`` gives the same rows in Spark, delta-rs and DuckDB."""
    paths = table_paths(warehouse, table)
    by_spark = resolved_history(spark, paths)
    ends_columns = spark.read.format("delta").load(paths.history_ends).columns
    sql_text = resolved_history_sql(by_spark.columns, ends_columns, quote_char='"')
    expected = _rows(by_spark.toArrow())
    by_delta_rs = (
        QueryBuilder()
        .register("history", DeltaLakeTable(paths.history))
        .register("history_ends", DeltaLakeTable(paths.history_ends))
        .execute(sql_text)
        .read_all()
    )
    assert _rows(pa.table(by_delta_rs)) == expected, f"delta-rs resolves {table} differently"
    duck = duckdb.connect()
    duck.execute("SET TimeZone = 'UTC'")
    _duckdb_view(duck, "history", Path(paths.history))
    _duckdb_view(duck, "history_ends", Path(paths.history_ends))
    by_duckdb = _rows(duck.sql(sql_text).to_arrow_table())
    assert by_duckdb == expected, f"DuckDB resolves {table} differently"


def assert_every_reader_agrees(spark: SparkSession, warehouse: str) -> set[str]:
    """Each Delta table under ``warehouse`` reads the same with Spark, delta-rs and DuckDB
    (over the files its log lists), and so does each resolved history; returns the tables
    checked, relative to the warehouse. A history's ``_history_ends`` table is part of the
    history: it is checked, and named as the history.
    """
    tables = sorted(p.parent for p in Path(warehouse).rglob("_delta_log"))
    assert tables, f"no Delta table under {warehouse}"
    duck = duckdb.connect()
    duck.execute("SET TimeZone = 'UTC'")
    ends = Path(warehouse) / "_history_ends"
    for path in tables:
        if path.parent == ends:
            _assert_resolved_history_agrees(spark, warehouse, path.name)
        by_spark = _rows(spark.read.format("delta").load(str(path)).toArrow())
        files, names = _delta_log_state(path)
        by_delta_rs = DeltaLakeTable(str(path))
        query = QueryBuilder().register("t", by_delta_rs).execute("SELECT * FROM t")
        assert _rows(pa.table(query.read_all())) == by_spark, f"delta-rs reads {path} differently"
        if all(physical == name for physical, name in names.items()):
            # delta-rs's pyarrow path ignores column mapping (all nulls, no error).
            assert _rows(by_delta_rs.to_pyarrow_table()) == by_spark, path
        columns = ", ".join(f'"{physical}" AS "{name}"' for physical, name in names.items())
        by_duckdb = (
            _rows(
                duck.sql(
                    f"SELECT {columns} FROM read_parquet({files!r}, union_by_name=true)"
                ).to_arrow_table()
            )
            if files
            else []
        )
        assert by_duckdb == by_spark, f"DuckDB reads {path} differently"
    return {str(p.relative_to(warehouse)) for p in tables if p.parent != ends}


# -- synthetic records through real Kafka: crash, restart, aborted transactions -------------


# The columns of the crash tests' table.
ITEM_COLUMNS = (
    SynthColumn("id", "integer", 23, key=True),
    SynthColumn("name", "text", 25),
    SynthColumn("amount", "numeric(10,2)", 1700, NUM),
    SynthColumn("at", "timestamp with time zone", 1184),
)


def _workload(
    table: SynthTable, seed: int, transactions: int, lsn0: int
) -> tuple[list[list[Record]], dict[int, dict[str, Any]], int]:
    """Random committed transactions, the state they leave, and their change count."""
    rng = random.Random(seed)
    state: dict[int, dict[str, Any]] = {}
    txs: list[list[Record]] = []
    changes = 0
    for n in range(transactions):
        lsn = lsn0 + 100 * n
        records: list[Record] = []
        for order in range(1, rng.randint(1, 5) + 1):
            key = rng.randint(1, 30)
            if key in state and rng.random() < 0.3:
                records += table.change("d", {"id": key}, lsn, order, n)
                del state[key]
            else:
                op = "u" if key in state else "c"
                row = {
                    "id": key,
                    "name": f"n{n}-{order}",
                    "amount": f"{rng.randint(0, 99999)}.25",
                    "at": f"2024-01-{1 + n % 28:02d}T00:00:0{order}.5Z",
                }
                records += table.change(op, row, lsn, order, n)
                state[key] = row
            changes += 1
        txs.append(records)
    return txs, state, changes


def _expected(state: dict[int, dict[str, Any]]) -> dict[int, tuple[Any, ...]]:
    return {
        k: (r["name"], Decimal(r["amount"]), r["at"].replace("T", " ").replace("Z", "") + "00000")
        for k, r in state.items()
    }


def _current(spark: SparkSession, path: str) -> dict[int, tuple[Any, ...]]:
    return {r["id"]: (r["name"], r["amount"], r["at"]) for r in delta_rows(spark, path)}


def test_kill_restart_aborted_transactions_and_dead_letters(
    stack: Stack, spark: SparkSession, tmp_path: Path
) -> None:
    prefix = f"sp{uuid.uuid4().hex[:8]}"
    table = SynthTable(prefix, "public", "items", ITEM_COLUMNS)
    writer = TransactionalWriter(stack.kafka_bootstrap, f"{prefix}-writer")
    writer.create_topics([table.topic], compacted=[f"{prefix}.schema"])
    txs, state, changes = _workload(table, 1, 120, 1_000)
    writer.send([table.schema_record()])
    for records in txs[:60]:
        writer.send(records)
    # Never committed: must never reach a table.
    writer.send(
        table.change(
            "c",
            {"id": 999, "name": "aborted", "amount": "1.00", "at": "2024-01-01T00:00:00Z"},
            999_999,
            1,
            1,
        ),
        abort=True,
    )
    writer.send([(table.topic, b'{"id": 5}', b'{"op": "c", "after": "oops"}')])

    settings = consumer_settings(stack, prefix, tmp_path, tables=["public.items"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTBRIDGE_")}
    env.update(
        {
            "SLOTBRIDGE_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
            "SLOTBRIDGE_TOPIC_PREFIX": prefix,
            "SLOTBRIDGE_TABLES": '["public.items"]',
            "SLOTBRIDGE_WAREHOUSE": settings.warehouse,
            "SLOTBRIDGE_CHECKPOINT_DIR": settings.checkpoint_dir,
            "SLOTBRIDGE_STATUS_PATH": str(settings.status_path),
            "SLOTBRIDGE_TRIGGER_INTERVAL_S": "0",
            "SLOTBRIDGE_MAX_OFFSETS_PER_TRIGGER": "40",
            "SLOTBRIDGE_SPARK_MASTER": "local[1]",
            "SLOTBRIDGE_JARS_DIR": str(settings.jars_dir),
            "SLOTBRIDGE_SHUFFLE_PARTITIONS": "1",
            "SLOTBRIDGE_LOG_FORMAT": "text",
            "SLOTBRIDGE_HTTP_PORT": "0",
        }
    )
    # The driver SIGKILLs itself in the third batch, after the history MERGE committed
    # and before the current-state MERGE: the restart must replay that batch.
    log = (tmp_path / "consume.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "consume"],
        cwd=REPO,
        env={**env, "SLOTBRIDGE_FAILPOINTS": "consume_after_history=3*kill"},
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        code = proc.wait(300)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # its JVM too, as a real crash leaves nothing
        proc.wait()
        log.close()
    assert code == -signal.SIGKILL, (tmp_path / "consume.log").read_text()[-3000:]
    assert settings.status_path is not None
    assert json.loads(settings.status_path.read_text())["batches"] == 2
    for records in txs[60:]:
        writer.send(records)
    # Instants at both ends of PostgreSQL's timestamptz range that INT96 readers lose.
    for key, at in ((41, "0001-01-01T00:00:00.5Z"), (42, "9999-12-31T23:59:59.5Z")):
        state[key] = {"id": key, "name": f"edge {key}", "amount": "1.00", "at": at}
        writer.send(table.change("c", state[key], 50_000 + key, 1, key))
        changes += 1

    # The restart (--once) replays the killed batch (its offsets are logged), takes the
    # rest in one batch and says so; the bad record (offset ~190, after the killed batch)
    # is quarantined in this run. The status loop is slowed so that the query ends while it
    # waits: the lag the stopped state shows must be read after the end, not left from an
    # earlier batch.
    code, output = run_cli(
        "consume",
        "--once",
        "--fail-on-quarantine",
        env={**_uncapped(env), "SLOTBRIDGE_FAILPOINTS": "consume_after_status=sleep10"},
        timeout=600,
    )
    assert code == 3, output[-3000:]
    final = json.loads(settings.status_path.read_text())
    assert (final["state"], final["error"], final["total_lag"], final["quarantined"]) == (
        "stopped",
        None,
        0,
        1,
    ), final
    assert "records quarantined in this run" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    paths = table_paths(settings.warehouse, "public.items")
    assert _current(spark, paths.current) == _expected(state)
    history = delta_rows(spark, paths.history)
    assert len(history) == changes
    assert (
        len({(r["_cdc_commit_lsn"], r["_cdc_total_order"], r["_cdc_op"]) for r in history})
        == changes
    )
    assert all(r["name"] != "aborted" for r in history)
    dead = delta_rows(spark, dead_letter_path(settings.warehouse))
    assert [d["table"] for d in dead] == ["public.items"]
    assert dead[0]["reason"].startswith("source.commit_lsn missing")
    # A replay of everything from scratch into the same tables changes nothing.
    replay = settings.model_copy(update={"checkpoint_dir": str(tmp_path / "checkpoint2")})
    consume_once(spark, replay)
    assert _current(spark, paths.current) == _expected(state)
    assert len(delta_rows(spark, paths.history)) == changes
    assert assert_every_reader_agrees(spark, settings.warehouse) == {
        "current/public.items",
        "history/public.items",
        "_tombstones/public.items",
        "_dead_letter",
    }


def _published(
    stack: Stack, name: str, seed: int, transactions: int
) -> tuple[str, list[list[Record]], dict[int, dict[str, Any]], int]:
    """A fresh topic prefix whose table ``public.<name>`` holds ``_workload``'s committed
    transactions in Kafka; the prefix, the transactions, their state and change count."""
    prefix = f"sp{uuid.uuid4().hex[:8]}"
    table = SynthTable(prefix, "public", name, ITEM_COLUMNS)
    writer = TransactionalWriter(stack.kafka_bootstrap, f"{prefix}-writer")
    writer.create_topics([table.topic], compacted=[f"{prefix}.schema"])
    txs, state, changes = _workload(table, seed, transactions, 1_000)
    writer.send([table.schema_record()])
    for records in txs:
        writer.send(records)
    return prefix, txs, state, changes


def _uncapped(env: dict[str, str]) -> dict[str, str]:
    """``env`` without a cap on records per trigger: a restart replays its killed batch with
    the batch's logged offsets whatever the cap, then takes the rest in one batch."""
    return {k: v for k, v in env.items() if k != "SLOTBRIDGE_MAX_OFFSETS_PER_TRIGGER"}


def _restart_to_the_end(
    spark: SparkSession,
    env: dict[str, str],
    paths: TablePaths,
    state: dict[int, dict[str, Any]],
    changes: int,
) -> list[dict[str, Any]]:
    """Run the job again to the end of the topics; the current state must be ``state``
    and the (resolved) history every change once. Returns the history's rows."""
    code, output = run_cli("consume", "--once", env=env, timeout=300)
    assert code == 0, output[-3000:]
    assert _current(spark, paths.current) == _expected(state)
    history = delta_rows(spark, paths.history)
    changed = {(r["_cdc_commit_lsn"], r["_cdc_total_order"], r["_cdc_op"]) for r in history}
    assert len(changed) == len(history) == changes
    return history


def test_kill_inside_housekeeping_then_restart(
    stack: Stack, spark: SparkSession, tmp_path: Path
) -> None:
    """Killed between two tables' compaction: the restart replays the batch, and every
    reader still reads the same rows as Spark."""
    prefix, _, state, changes = _published(stack, "kept", 7, 20)
    settings = consumer_settings(stack, prefix, tmp_path, tables=["public.kept"])
    env = {
        **_consumer_env(settings),
        "SLOTBRIDGE_TABLES": '["public.kept"]',
        # Two files per write (Spark would coalesce them), so that the first compaction
        # has files to merge and commits.
        "SLOTBRIDGE_SHUFFLE_PARTITIONS": "2",
        "SLOTBRIDGE_SPARK_CONF": '{"spark.sql.adaptive.coalescePartitions.enabled": "false"}',
    }
    # Housekeeping is due from the second batch on; the job dies after compacting the
    # current-state table, before the history. The restart takes the rest in one batch.
    code, output = run_cli(
        "consume",
        "--once",
        env={
            **env,
            "SLOTBRIDGE_MAX_OFFSETS_PER_TRIGGER": "20",
            "SLOTBRIDGE_HOUSEKEEPING_INTERVAL_S": "0.001",
            "SLOTBRIDGE_FAILPOINTS": "consume_in_housekeeping=kill",
        },
        timeout=300,
    )
    assert code == -signal.SIGKILL, output[-3000:]
    paths = table_paths(settings.warehouse, "public.kept")

    def optimized(path: str) -> int:
        operations = spark.sql(f"DESCRIBE HISTORY delta.`{path}`").select("operation")
        return operations.where("operation = 'OPTIMIZE'").count()

    assert (optimized(paths.current), optimized(paths.history)) == (1, 0)
    history = _restart_to_the_end(spark, env, paths, state, changes)
    assert sum(r["valid_to_lsn"] is None for r in history) == len(state)
    assert assert_every_reader_agrees(spark, settings.warehouse) == {
        "current/public.kept",
        "history/public.kept",
        "_tombstones/public.kept",
    }


def test_kill_inside_the_history_fold_then_restart(
    stack: Stack, spark: SparkSession, tmp_path: Path
) -> None:
    """Killed inside housekeeping's fold of the history ends, after the ends are in the
    history and before they are deleted: the restart folds them again, and the resolved
    history is exact and the same for every reader."""
    prefix, txs, state, changes = _published(stack, "folded", 11, 30)
    settings = consumer_settings(stack, prefix, tmp_path, tables=["public.folded"])
    env = {
        **_consumer_env(settings),
        "SLOTBRIDGE_TABLES": '["public.folded"]',
        "SLOTBRIDGE_MAX_OFFSETS_PER_TRIGGER": "25",
        "SLOTBRIDGE_HOUSEKEEPING_INTERVAL_S": "0.001",
    }
    # Housekeeping is due from the second batch on, whose updates of stored keys left
    # ends to fold.
    code, output = run_cli(
        "consume",
        "--once",
        env={**env, "SLOTBRIDGE_FAILPOINTS": "consume_in_history_fold=kill"},
        timeout=300,
    )
    assert code == -signal.SIGKILL, output[-3000:]
    paths = table_paths(settings.warehouse, "public.folded")
    position = ["id", "_cdc_commit_lsn", "_cdc_total_order"]
    waiting = spark.read.format("delta").load(paths.history_ends)
    assert waiting.count() > 0
    stored = spark.read.format("delta").load(paths.history).select(*position, "valid_to_lsn")
    # The fold's MERGE committed: every end still waiting is in the history too.
    folded = waiting.withColumnRenamed("valid_to_lsn", "waiting_end").join(stored, position)
    assert folded.where("waiting_end = valid_to_lsn").count() == waiting.count()
    # The restart replays the killed batch (its offsets are logged), then takes the rest in
    # one batch, after which housekeeping folds every end, the killed fold's among them.
    history = _restart_to_the_end(spark, _uncapped(env), paths, state, changes)
    ends = {(r["_cdc_commit_lsn"], r["_cdc_total_order"]): r["valid_to_lsn"] for r in history}
    assert ends == _expected_item_ends(txs)
    # The restart's last housekeeping folded every end: the history alone is exact.
    assert spark.read.format("delta").load(paths.history_ends).count() == 0
    unresolved = spark.read.format("delta").load(paths.history).collect()
    assert {
        (r["_cdc_commit_lsn"], r["_cdc_total_order"]): r["valid_to_lsn"] for r in unresolved
    } == ends
    assert assert_every_reader_agrees(spark, settings.warehouse) == {
        "current/public.folded",
        "history/public.folded",
        "_tombstones/public.folded",
    }


def _expected_item_ends(txs: list[list[Record]]) -> dict[tuple[int, int], int | None]:
    """The ends of ``_workload``'s changes by definition (``_expected_ends``)."""
    changes: list[Change] = []
    for records in txs:
        for _, _, value in records:
            if value is None:
                continue  # a delete's Kafka tombstone
            change = json.loads(value)
            row = change["after"] or change["before"]
            changes.append(
                (
                    change["op"],
                    row["id"],
                    change["source"]["commit_lsn"],
                    change["transaction"]["total_order"],
                )
            )
    return _expected_ends(changes)


def test_once_on_a_prefix_without_topics(stack: Stack, tmp_path: Path) -> None:
    """Nothing to read yet (a consumer deployed before its bridge): --once ends cleanly."""
    settings = consumer_settings(stack, f"sp{uuid.uuid4().hex[:8]}", tmp_path)
    code, output = run_cli("consume", "--once", env=_consumer_env(settings), timeout=300)
    assert code == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    assert settings.status_path is not None
    final = json.loads(settings.status_path.read_text())
    assert (final["state"], final["error"], final["batches"]) == ("stopped", None, 0), final


def test_health_and_metrics_of_a_running_job(stack: Stack, tmp_path: Path) -> None:
    """The daemon's /readyz, /healthz and /metrics (what the chart's probes and the
    ServiceMonitor read): applied and quarantined records per table, then a SIGTERM ends
    the job cleanly."""
    prefix = f"sp{uuid.uuid4().hex[:8]}"
    table = SynthTable(
        prefix,
        "public",
        "items",
        (SynthColumn("id", "integer", 23, key=True), SynthColumn("name", "text", 25)),
    )
    writer = TransactionalWriter(stack.kafka_bootstrap, f"{prefix}-writer")
    writer.create_topics([table.topic], compacted=[f"{prefix}.schema"])
    writer.send([table.schema_record()])
    writer.send(
        [
            r
            for k in range(1, 6)
            for r in table.change("c", {"id": k, "name": f"n{k}"}, 100 + k, 1, k)
        ]
    )
    writer.send([(table.topic, b'{"id": 9}', b'{"op": "c", "after": "oops"}')])
    port = free_ports(1)[0]
    settings = consumer_settings(stack, prefix, tmp_path, http_port=port)
    env = {**_consumer_env(settings), "SLOTBRIDGE_TRIGGER_INTERVAL_S": "1"}
    log = (tmp_path / "consume.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "consume"],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    applied = 'slotbridge_consumer_records_applied_total{table="public.items"} 5.0'
    quarantined = 'slotbridge_consumer_records_quarantined_total{table="public.items"} 1.0'
    try:
        assert wait_until(lambda: _get(f"{base}/readyz")[0] == 200, 180), (
            tmp_path / "consume.log"
        ).read_text()[-3000:]
        assert wait_until(lambda: applied in _get(f"{base}/metrics")[1], 180), _get(
            f"{base}/metrics"
        )[1]
        code, metrics = _get(f"{base}/metrics")
        assert quarantined in metrics, metrics
        assert "slotbridge_consumer_last_batch_seconds" in metrics, metrics
        code, body = _get(f"{base}/healthz")
        assert code == 200 and json.loads(body)["reason"] == "running", body
        # To the driver alone, as Kubernetes signals a container's first process.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, (tmp_path / "consume.log").read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    assert settings.status_path is not None
    assert json.loads(settings.status_path.read_text())["state"] == "stopped"


def _get(url: str) -> tuple[int, str]:
    """Status and body of a GET; (0, reason) while nothing listens yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _consumer_env(settings: ConsumerSettings) -> dict[str, str]:
    """The environment of a ``slotbridge consume`` child with ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTBRIDGE_")}
    env.update(
        {
            "SLOTBRIDGE_KAFKA_BOOTSTRAP": settings.kafka_bootstrap,
            "SLOTBRIDGE_TOPIC_PREFIX": settings.topic_prefix,
            "SLOTBRIDGE_WAREHOUSE": settings.warehouse,
            "SLOTBRIDGE_CHECKPOINT_DIR": settings.checkpoint_dir,
            "SLOTBRIDGE_STATUS_PATH": str(settings.status_path),
            "SLOTBRIDGE_SPARK_MASTER": "local[1]",
            "SLOTBRIDGE_JARS_DIR": str(settings.jars_dir),
            "SLOTBRIDGE_LOG_FORMAT": "text",
            "SLOTBRIDGE_HTTP_PORT": str(settings.http_port),
        }
    )
    return env


def test_partitions_are_the_cores_unless_the_launch_sets_them() -> None:
    """Without ``shuffle_partitions`` the session's partition settings follow Spark's cores
    (local[3]: 3) once it runs, but for one the launch set (``spark_conf``). A session of
    its own: the tests' shared one sets them."""
    script = """
import json
from spark_consumers.job import build_session, partition_conf
from spark_consumers.settings import ConsumerSettings
settings = ConsumerSettings(
    kafka_bootstrap="unused:9", warehouse="/unused", checkpoint_dir="/unused",
    spark_master="local[3]", http_port=0,
    spark_conf={"spark.databricks.delta.snapshotPartitions": "7"},
)
spark = build_session(settings)
print(json.dumps({key: spark.conf.get(key) for key in partition_conf(1)}))
spark.stop()
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "spark.sql.shuffle.partitions": "3",
        "spark.databricks.delta.snapshotPartitions": "7",
        "spark.sql.sources.parallelPartitionDiscovery.parallelism": "3",
    }


def test_printed_spark_submit_line_runs_the_job(stack: Stack, tmp_path: Path) -> None:
    """The README's spark-submit path: the line the CLI prints consumes (--once) and ends
    cleanly, here on a prefix whose bridge has not written yet."""
    settings = consumer_settings(stack, f"sp{uuid.uuid4().hex[:8]}", tmp_path)
    config = tmp_path / "consumer.yaml"
    config.write_text(
        json.dumps(
            {
                "kafka_bootstrap": settings.kafka_bootstrap,
                "topic_prefix": settings.topic_prefix,
                "warehouse": settings.warehouse,
                "checkpoint_dir": settings.checkpoint_dir,
                "status_path": str(settings.status_path),
                "spark_master": "local[1]",
                "log_format": "text",
                "http_port": 0,
            }
        )
    )
    code, line = run_cli(
        "consume",
        "--config",
        str(config),
        "--print-spark-submit",
        "--once",
        env=_consumer_env(settings),
    )
    assert code == 0 and "spark-submit" in line, line
    proc = subprocess.run(
        shlex.split(line),
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert settings.status_path is not None
    final = json.loads(settings.status_path.read_text())
    assert (final["state"], final["error"]) == ("stopped", None), final


def test_unwritable_warehouse_is_one_line(stack: Stack, tmp_path: Path) -> None:
    """A runtime failure (here: the warehouse is below a regular file, which even root
    cannot write into) ends the job with one ERROR line and state failed."""
    prefix = f"sp{uuid.uuid4().hex[:8]}"
    table = SynthTable(prefix, "public", "t", (SynthColumn("id", "integer", 23, key=True),))
    writer = TransactionalWriter(stack.kafka_bootstrap, f"{prefix}-writer")
    writer.create_topics([table.topic], compacted=[f"{prefix}.schema"])
    writer.send([table.schema_record(), *table.change("c", {"id": 1}, 100, 1, 1)])
    (tmp_path / "file").write_text("not a folder")
    settings = consumer_settings(stack, prefix, tmp_path).model_copy(
        update={"warehouse": str(tmp_path / "file" / "warehouse")}
    )
    code, output = run_cli("consume", "--once", env=_consumer_env(settings), timeout=300)
    assert code == 1, output[-3000:]
    line = one_line_error(output)
    assert "file/warehouse" in line and len(line) < 600, line
    assert settings.status_path is not None
    final = json.loads(settings.status_path.read_text())
    assert final["state"] == "failed" and final["error"] in line, final


# -- history independent of the batch split --------------------------------------------

Change = tuple[str, int | None, int, int]  # op, key (None: truncate), commit LSN, total order


def _truncating_workload(
    table: SynthTable, seed: int, transactions: int
) -> tuple[list[list[Record]], list[Change], dict[int, str]]:
    """Transactions of inserts, updates, deletes and truncates (some in the middle of a
    transaction, changes after them); the changes in order and the live keys' names."""
    rng = random.Random(seed)
    live: dict[int, str] = {}
    txs: list[list[Record]] = []
    changes: list[Change] = []
    for n in range(transactions):
        lsn = 10_000 + 1_000 * n
        records: list[Record] = []
        for order in range(1, rng.randint(1, 6) + 1):
            if rng.random() < 0.06:
                records += table.change("t", None, lsn, order, n)
                changes.append(("t", None, lsn, order))
                live.clear()
                continue
            key = rng.randint(1, 25)
            if key in live and rng.random() < 0.25:
                records += table.change("d", {"id": key}, lsn, order, n)
                changes.append(("d", key, lsn, order))
                del live[key]
                continue
            op = "u" if key in live else "c"
            live[key] = f"k{key}-{n}-{order}"
            records += table.change(op, {"id": key, "name": live[key]}, lsn, order, n)
            changes.append((op, key, lsn, order))
        txs.append(records)
    return txs, changes, live


def _expected_ends(changes: list[Change]) -> dict[tuple[int, int], int | None]:
    """SCD type 2 by definition: a version ends at its key's next change or the next
    truncate, whichever comes first; deletes and truncates end where they are."""
    ends: dict[tuple[int, int], int | None] = {}
    for i, (op, key, lsn, order) in enumerate(changes):
        if op in ("d", "t"):
            ends[(lsn, order)] = lsn
            continue
        ends[(lsn, order)] = next(
            (
                later_lsn
                for later_op, later_key, later_lsn, _ in changes[i + 1 :]
                if later_op == "t" or later_key == key
            ),
            None,
        )
    return ends


def test_history_is_the_same_whatever_the_batch_split(
    stack: Stack, spark: SparkSession, tmp_path: Path
) -> None:
    """Three partitions: a truncate (no key) lands on any partition, each key on its own,
    so small batches see truncates before or after the changes around them."""
    prefix = f"sp{uuid.uuid4().hex[:8]}"
    table = SynthTable(
        prefix,
        "public",
        "trunc",
        (SynthColumn("id", "integer", 23, key=True), SynthColumn("name", "text", 25)),
    )
    writer = TransactionalWriter(stack.kafka_bootstrap, f"{prefix}-writer")
    writer.create_topics([table.topic], compacted=[f"{prefix}.schema"], partitions=3)
    txs, changes, live = _truncating_workload(table, 15, 60)
    assert sum(op == "t" for op, *_ in changes) >= 5
    writer.send([table.schema_record()])
    for records in txs:
        writer.send(records)

    histories = []
    for name, cap in (("whole", None), ("split", 20)):
        settings = consumer_settings(
            stack, prefix, tmp_path / name, tables=["public.trunc"], max_offsets_per_trigger=cap
        )
        status = consume_once(spark, settings)
        assert status.batches >= (1 if cap is None else 10), status.batches
        paths = table_paths(settings.warehouse, "public.trunc")
        assert {r["id"]: r["name"] for r in delta_rows(spark, paths.current)} == live, name
        history = delta_rows(spark, paths.history)
        ends = {(r["_cdc_commit_lsn"], r["_cdc_total_order"]): r["valid_to_lsn"] for r in history}
        assert len(ends) == len(history) == len(changes), name
        wrong = {
            position: (end, ends[position])
            for position, end in _expected_ends(changes).items()
            if ends[position] != end
        }
        assert not wrong, f"{name}: (commit LSN, order): (expected end, stored end) {wrong}"
        histories.append(
            sorted(history, key=lambda r: (r["_cdc_commit_lsn"], r["_cdc_total_order"]))
        )
    assert histories[0] == histories[1]
    for name in ("whole", "split"):
        assert assert_every_reader_agrees(spark, str(tmp_path / name / "warehouse")) == {
            "current/public.trunc",
            "history/public.trunc",
            "_tombstones/public.trunc",
        }


# -- one bad table stops alone ---------------------------------------------------------


def test_one_bad_table_stops_alone(
    stack: Stack, spark: SparkSession, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Names Delta refuses unmapped are mapped; names it cannot hold at all (x and X) stop
    that table alone, loudly and across restarts; a configured table without a topic
    stops nothing."""
    prefix = f"sp{uuid.uuid4().hex[:8]}"
    key = SynthColumn("id", "integer", 23, key=True)
    good = SynthTable(prefix, "public", "good", (key, SynthColumn("name", "text", 25)))
    mixed = SynthTable(
        prefix,
        "public",
        "mixed",
        (key, SynthColumn("Mixed Case", "text", 25), SynthColumn("a=b (c)", "integer", 23)),
    )
    clash = SynthTable(
        prefix,
        "public",
        "clash",
        (SynthColumn("x", "integer", 23, key=True), SynthColumn("X", "text", 25)),
    )
    writer = TransactionalWriter(stack.kafka_bootstrap, f"{prefix}-writer")
    writer.create_topics([t.topic for t in (good, mixed, clash)], compacted=[f"{prefix}.schema"])
    writer.send([t.schema_record() for t in (good, mixed, clash)])

    def send(lsn: int) -> None:
        writer.send(
            [
                *good.change("c", {"id": lsn, "name": f"g{lsn}"}, lsn, 1, lsn),
                *mixed.change(
                    "c", {"id": lsn, "Mixed Case": f"m{lsn}", "a=b (c)": lsn}, lsn, 2, lsn
                ),
                *clash.change("c", {"x": lsn, "X": f"c{lsn}"}, lsn, 3, lsn),
            ]
        )

    send(100)
    send(200)
    settings = consumer_settings(
        stack,
        prefix,
        tmp_path,
        tables=["public.good", "public.mixed", "public.clash", "public.absent"],
    )
    with caplog.at_level(logging.WARNING, logger="slotbridge.consume"):
        first = consume_once(spark, settings)
    stopped = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in stopped] == [
        "table stopped; its records go to the dead-letter table from now on"
    ], stopped
    why = (
        "columns x and X differ only in case; a Delta table cannot hold both "
        "(rename one at the source)"
    )
    assert first.tables["public.clash"].stopped == why
    assert first.as_dict()["stopped_tables"] == ["public.clash"]

    send(300)  # a restart reads the stop from the dead-letter table
    second = consume_once(spark, settings)
    assert second.tables["public.clash"].stopped == why
    assert (second.tables["public.good"].applied, second.tables["public.mixed"].applied) == (1, 1)
    paths = {t: table_paths(settings.warehouse, f"public.{t}") for t in ("good", "mixed")}
    assert sorted(r["name"] for r in delta_rows(spark, paths["good"].current)) == [
        "g100",
        "g200",
        "g300",
    ]
    assert sorted(
        (r["Mixed Case"], r["a=b (c)"]) for r in delta_rows(spark, paths["mixed"].current)
    ) == [("m100", 100), ("m200", 200), ("m300", 300)]
    dead = delta_rows(spark, dead_letter_path(settings.warehouse))
    assert (
        sorted((d["table"], d["reason"]) for d in dead)
        == [("public.clash", f"table stopped: {why}")] * 3
    )
    assert not os.path.exists(table_paths(settings.warehouse, "public.clash").current)
    assert assert_every_reader_agrees(spark, settings.warehouse) == {
        "current/public.good",
        "history/public.good",
        "current/public.mixed",
        "history/public.mixed",
        "_dead_letter",
    }


# -- end to end: PostgreSQL -> bridge -> Kafka -> Spark -> Delta ---------------------------

TYPED_TABLE = """
CREATE TABLE {name} (
    id integer PRIMARY KEY,
    small smallint, big bigint, amount numeric(10,2), ratio real, score double precision,
    flag boolean, label text, code varchar(12), uid uuid, doc jsonb, raw bytea,
    day date, local timestamp, at timestamptz, clock time, span interval,
    tags text[], nums integer[], big_text text
)"""


def _pg_rows(dsn: str, table: str, columns: list[tuple[str, str]]) -> dict[int, dict[str, Any]]:
    select = []
    for name, pg_type in columns:
        target = spark_type(pg_type)
        if isinstance(target, StringType):
            select.append(f"{name}::text")
        elif isinstance(target, TimestampType):
            select.append(f"to_char({name} AT TIME ZONE 'UTC', 'YYYY-MM-DD HH24:MI:SS.US')")
        elif pg_type.startswith("timestamp"):
            select.append(f"to_char({name}, 'YYYY-MM-DD HH24:MI:SS.US')")
        else:
            select.append(name)
    # One statement per call: with two, psycopg returns the first (the SET's empty) result.
    rows = sql(
        f"{dsn} options='-c intervalstyle=iso_8601'", f"SELECT {', '.join(select)} FROM {table}"
    )
    out = {}
    for values in rows:
        row = dict(zip([c for c, _ in columns], values, strict=True))
        out[row["id"]] = {name: _norm(row[name], pg_type) for name, pg_type in columns}
    return out


def _norm(value: Any, pg_type: str) -> Any:
    if value is None:
        return None
    if pg_type in ("json", "jsonb"):
        # Both sides hold JSON text here; downstream keeps it canonical (sorted keys).
        return json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"))
    if pg_type == "real":
        return struct.unpack("f", struct.pack("f", value))[0]
    if isinstance(value, float) and value != value:
        return "NaN"
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    return value


def _delta_rows(
    spark: SparkSession, path: str, columns: list[tuple[str, str]]
) -> dict[int, dict[str, Any]]:
    frame = spark.read.format("delta").load(path)
    select = []
    for f in frame.schema.fields:
        if f.name.startswith("_cdc_"):
            continue
        if isinstance(f.dataType, TimestampType) or f.dataType.typeName() == "timestamp_ntz":
            select.append(F.date_format(f.name, TS_FORMAT).alias(f.name))
        elif isinstance(f.dataType, FloatType):
            select.append(F.col(f.name))
        else:
            select.append(F.col(f.name))
    types = dict(columns)
    out = {}
    for r in frame.select(*select).collect():
        row = r.asDict(recursive=True)
        out[row["id"]] = {k: _norm(v, types[k]) for k, v in row.items()}
    return out


def _columns(dsn: str, table: str) -> list[tuple[str, str]]:
    return [
        (n, t)
        for n, t in sql(
            dsn,
            "SELECT attname, format_type(atttypid, atttypmod) FROM pg_attribute WHERE "
            "attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (table,),
        )
    ]


def _typed_workload(dsn: str, table: str, seed: int) -> None:
    rng = random.Random(seed)
    big = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(6000))
    for i in range(1, 41):
        sql(
            dsn,
            f"""INSERT INTO {table} VALUES (
            %s, %s, %s, %s, %s, %s, %s, %s, %s, gen_random_uuid(), %s, %s, %s, %s, %s, %s,
            %s, %s, %s, %s)""",
            (
                i,
                i % 100,
                2**40 + i,
                Decimal(f"{i}.{i % 100:02d}"),
                i / 3,
                float("nan") if i == 7 else i / 7,
                i % 2 == 0,
                f"label {i} 'q' \u00e9",
                f"c{i}",
                json.dumps({"i": i, "nested": [1, "two", None], "s": 'x"y'}),
                bytes([i, 0, 255]),
                dt.date(2024, 1, 1) + dt.timedelta(days=i),
                dt.datetime(2024, 1, 1, 12, 0, 0, 123456) + dt.timedelta(hours=i),
                dt.datetime(2024, 1, 1, 12, 0, 0, 654321, tzinfo=dt.UTC) + dt.timedelta(minutes=i),
                dt.time(1, 2, 3),
                dt.timedelta(days=i, hours=2),
                ["a", None, f"t{i}"],
                [i, None],
                big if i % 5 == 0 else None,
            ),
        )
    for i in range(1, 41, 3):
        # big_text untouched: the bridge sends it as an unchanged-TOAST marker.
        sql(
            dsn,
            f"UPDATE {table} SET label = label || ' upd', amount = amount + 1 WHERE id = %s",
            (i,),
        )
    sql(dsn, f"DELETE FROM {table} WHERE id % 9 = 0")
    sql(dsn, f"UPDATE {table} SET doc = '\"just a string\"', nums = '{{}}' WHERE id = 2")
    sql(
        dsn,
        f"BEGIN; UPDATE {table} SET small = -1 WHERE id = 4; "
        f"UPDATE {table} SET small = -2 WHERE id = 4; COMMIT",
    )


def _assert_equal(
    spark: SparkSession, dsn: str, settings: ConsumerSettings, tables: list[str]
) -> None:
    for table in tables:
        columns = _columns(dsn, table)
        path = table_paths(settings.warehouse, table).current
        schema = spark.read.format("delta").load(path).schema
        for name, pg_type in columns:
            assert schema[name].dataType == spark_type(pg_type), (table, name, pg_type)
        expected = _pg_rows(dsn, table, columns)
        actual = _delta_rows(spark, path, columns)
        assert sorted(actual) == sorted(expected), table
        for key, row in expected.items():
            assert actual[key] == row, (table, key)


def _history_matches_kafka(
    spark: SparkSession, pipeline: Pipeline, settings: ConsumerSettings, table: str
) -> None:
    records = pipeline.changes(table)
    history = delta_rows(spark, table_paths(settings.warehouse, table).history)
    assert len(history) == len(records)
    assert {(r["_cdc_commit_lsn"], r["_cdc_total_order"], r["_cdc_op"]) for r in history} == {
        (r.value["source"]["commit_lsn"], r.value["transaction"]["total_order"], r.value["op"])
        for r in records
    }
    assert sum(1 for r in history if r["valid_to_lsn"] is None) == len(
        sql(pipeline.stack.primary_dsn, f"SELECT 1 FROM {table}")
    )


def test_end_to_end_with_bridge(stack: Stack, spark: SparkSession, tmp_path: Path) -> None:
    dsn = stack.primary_dsn
    suffix = uuid.uuid4().hex[:6]
    tables = [f"public.spark_a_{suffix}", f"public.spark_b_{suffix}"]
    for table in tables:
        sql(dsn, TYPED_TABLE.format(name=table))
    sql(dsn, f"INSERT INTO {tables[1]} (id, label) VALUES (1000, 'before the slot')")
    pipeline = Pipeline(stack, tables, tmp_path)
    try:
        pipeline.start()
        for seed, table in enumerate(tables):
            _typed_workload(dsn, table, seed)
        pipeline.wait_caught_up()
        settings = consumer_settings(stack, pipeline.prefix, tmp_path, tables=[t for t in tables])
        consume_once(spark, settings)
        _assert_equal(spark, dsn, settings, tables)
        for table in tables:
            _history_matches_kafka(spark, pipeline, settings, table)

        sql(dsn, f"ALTER TABLE {tables[0]} ADD COLUMN note text, ADD COLUMN cents numeric(12,3)")
        sql(dsn, f"UPDATE {tables[0]} SET note = 'n' || id, cents = id / 8.0 WHERE id < 10")
        sql(dsn, f"INSERT INTO {tables[0]} (id, note) VALUES (500, 'new')")
        pipeline.wait_caught_up()
        consume_once(spark, settings)
        _assert_equal(spark, dsn, settings, tables)
        _history_matches_kafka(spark, pipeline, settings, tables[0])
        # The workload may all land before the snapshot (then no deletes, no tombstones).
        assert assert_every_reader_agrees(spark, settings.warehouse) >= {
            f"{kind}/{table}" for kind in ("current", "history") for table in tables
        }
    finally:
        pipeline.cleanup()
        for table in tables:
            sql(dsn, f"DROP TABLE IF EXISTS {table}")


def test_masked_columns_reach_delta_masked(
    stack: Stack, spark: SparkSession, tmp_path: Path
) -> None:
    # The consumer types a transformed column by what the bridge outputs (text), and no
    # file it writes (Parquet, Delta log statistics, checkpoints) holds a raw value.
    dsn = stack.primary_dsn
    secret = uuid.uuid4().hex[:10]
    table = f"public.spark_masked_{uuid.uuid4().hex[:6]}"
    sql(
        dsn,
        f"CREATE TABLE {table} (id bigint PRIMARY KEY, email text, salary numeric(10,2),"
        " notes text, label text)",
    )
    transforms = [
        {"tables": [table], "columns": ["email", "phone*"], "transform": "hash"},
        {"tables": [table], "columns": ["salary"], "transform": "mask", "keep_last": 2},
        {"tables": [table], "columns": ["notes"], "transform": "drop"},
    ]
    insert = f"INSERT INTO {table} VALUES (%s, %s, %s, %s, %s)"
    for n in range(1, 4):  # snapshot rows
        sql(dsn, insert, (n, f"{secret}-{n}@example.com", 1000 + n, f"{secret} note", "a"))
    pipeline = Pipeline(
        stack,
        [table],
        tmp_path,
        extra={
            "SLOTBRIDGE_TRANSFORMS": json.dumps(transforms),
            "SLOTBRIDGE_MASKING_KEY": "spark masking test key 0123456789",
        },
    )
    try:
        pipeline.start()
        for n in range(4, 8):
            sql(dsn, insert, (n, f"{secret}-{n}@example.com", 2000 + n, f"{secret} n", "b"))
        sql(dsn, f"UPDATE {table} SET email = %s, label = 'c' WHERE id = 4", (f"{secret}-x",))
        sql(dsn, f"DELETE FROM {table} WHERE id = 5")
        sql(dsn, f"ALTER TABLE {table} ADD COLUMN phone text")
        sql(dsn, f"INSERT INTO {table} VALUES (9, 'e9', 9, 'n9', 'd', %s)", (f"{secret}-tel",))
        pipeline.wait_caught_up()
        settings = consumer_settings(stack, pipeline.prefix, tmp_path, tables=[table])
        consume_once(spark, settings)
        paths = table_paths(settings.warehouse, table)
        current = spark.read.format("delta").load(paths.current)
        types = {f.name: f.dataType for f in current.schema.fields}
        assert types["salary"] == StringType() and types["email"] == StringType()
        assert "notes" not in types
        rows = {r["id"]: r.asDict() for r in current.collect()}
        assert sorted(rows) == [1, 2, 3, 4, 6, 7, 9]
        assert rows[1]["salary"] == "*****00" and rows[9]["salary"] == "**00"
        assert rows[4]["label"] == "c" and len(rows[4]["email"]) == 64
        history = delta_rows(spark, paths.history)
        cells = repr([rows, history])
        assert secret not in cells
        assert rows[9]["phone"] != f"{secret}-tel" and len(rows[9]["phone"]) == 64
        for root in (Path(settings.warehouse), Path(settings.checkpoint_dir)):
            for path in root.rglob("*"):
                if path.is_file():
                    assert secret.encode() not in path.read_bytes(), path
        assert_every_reader_agrees(spark, settings.warehouse)
    finally:
        pipeline.cleanup()
        sql(dsn, f"DROP TABLE IF EXISTS {table}")


def test_a_resync_gap_is_marked_and_the_tables_converge(
    stack: Stack, spark: SparkSession, tmp_path: Path
) -> None:
    # A running consumer meets a resync: the slot was dropped while the bridge was down
    # (the changes meanwhile are lost to the stream) and `slotbridge resync` published the
    # table again. The consumer keeps the gap in `_gaps` when it meets the snapshot rows,
    # every row the resync published again equals the source, and the rows the gap left
    # behind are exactly the ones deleted during it: at or below the gap's position.
    dsn = stack.primary_dsn
    table = f"public.spark_gap_{uuid.uuid4().hex[:6]}"
    sql(dsn, f"CREATE TABLE {table} (id bigint PRIMARY KEY, label text)")
    sql(dsn, f"INSERT INTO {table} SELECT g, 'v0' FROM generate_series(1, 20) g")
    pipeline = Pipeline(stack, [table], tmp_path)
    settings = consumer_settings(
        stack, pipeline.prefix, tmp_path, tables=[table], trigger_interval_s=1
    )
    status = Status()
    query = start_query(spark, settings, status)
    try:
        pipeline.start()
        sql(dsn, f"UPDATE {table} SET label = 'v1' WHERE id <= 5")
        pipeline.wait_caught_up()
        assert pipeline.stop() == 0
        query.processAllAvailable()

        sql(dsn, "SELECT pg_drop_replication_slot(%s)", (pipeline.name,))
        sql(dsn, f"UPDATE {table} SET label = 'gap' WHERE id BETWEEN 6 AND 8")
        sql(dsn, f"DELETE FROM {table} WHERE id IN (19, 20)")
        sql(dsn, f"INSERT INTO {table} VALUES (21, 'gap')")
        code, out = run_cli("resync", env=pipeline.env())
        assert code == 0 and "start the bridge" in out, out
        pipeline.start()
        pipeline.wait_caught_up()
        sql(dsn, f"UPDATE {table} SET label = 'after' WHERE id = 1")
        pipeline.wait_caught_up()
        assert pipeline.stop() == 0
        query.processAllAvailable()
        assert query.exception() is None, query.exception()
    finally:
        query.stop()
        pipeline.cleanup()

    gaps = delta_rows(spark, gaps_path(settings.warehouse))
    assert [(g["kind"], g["reason"], g["tables"]) for g in gaps] == [
        ("source", "slot dropped", [table])
    ], gaps
    assert [(g["kind"], g["after_lsn"]) for g in status.gaps] == [
        ("source", gaps[0]["after_lsn"])
    ], status.gaps
    after = gaps[0]["after_lsn"]
    current = {
        r["id"]: (r["label"], r["_cdc_commit_lsn"])
        for r in delta_rows(spark, table_paths(settings.warehouse, table).current)
    }
    source = dict(sql(dsn, f"SELECT id, label FROM {table}"))
    assert {k: label for k, (label, lsn) in current.items() if lsn > after} == source
    assert sorted(k for k, (_, lsn) in current.items() if lsn <= after) == [19, 20]
    assert f"current/{table}" in assert_every_reader_agrees(spark, settings.warehouse)
    sql(dsn, f"DROP TABLE IF EXISTS {table}")
