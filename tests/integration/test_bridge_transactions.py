"""Large streamed transactions, aborts, subtransaction rollbacks and two-phase commit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import (
    Pipeline,
    own_table_pipeline,
    read_topics,
    sql,
    wait_for,
)

SCHEMA = "txn"
BIG_ROWS = 500_000
# Peak RSS of the bridge while it publishes the 500k-row transaction: 227 MB measured;
# the bound leaves room for noise but fails if the transaction were held in memory
# (500k decoded rows are well over 1 GB in Python objects).
RSS_BOUND = 400 * 1024 * 1024


@pytest.fixture(scope="module")
def pipe(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pipeline]:
    sql(
        stack.primary_dsn,
        f"""
        DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA};
        CREATE TABLE {SCHEMA}.big (id int PRIMARY KEY, payload text);
        CREATE TABLE {SCHEMA}.small (id int PRIMARY KEY, tag text);""",
    )
    pipeline = Pipeline(
        stack, [f"{SCHEMA}.big", f"{SCHEMA}.small"], Path(tmp_path_factory.mktemp("txn"))
    )
    # Tiny decoding memory: the server streams every transaction past 64 kB in chunks.
    pipeline.extra["SLOTBRIDGE_SOURCE_DSN"] = (
        f"{stack.primary_dsn} options='-c logical_decoding_work_mem=64kB'"
    )
    pipeline.extra["SLOTBRIDGE_SPOOL_MEMORY_BYTES"] = str(1024 * 1024)
    pipeline.start()
    try:
        pipeline.wait_caught_up(60)
        yield pipeline
        assert pipeline.stop() == 0
        pipeline.audit()
    finally:
        pipeline.cleanup()


def _stats(stack: Stack, slot: str) -> tuple[int, int]:
    row = sql(
        stack.primary_dsn,
        "SELECT stream_txns, stream_count FROM pg_stat_replication_slots WHERE slot_name = %s",
        (slot,),
    )
    return (int(row[0][0]), int(row[0][1])) if row else (0, 0)


def test_large_transaction_streams_once_in_order_with_bounded_memory(pipe: Pipeline) -> None:
    dsn = pipe.stack.primary_dsn
    streamed_before = _stats(pipe.stack, pipe.name)
    sql(
        dsn,
        f"INSERT INTO {SCHEMA}.big SELECT g, md5(g::text) FROM generate_series(1, %s) g",
        (BIG_ROWS,),
    )
    pipe.wait_caught_up(600)
    rss = pipe.peak_rss_bytes()
    stream_txns, stream_chunks = _stats(pipe.stack, pipe.name)
    assert stream_txns > streamed_before[0], "the server did not stream the transaction"
    assert stream_chunks - streamed_before[1] > 10
    records = pipe.changes(f"{SCHEMA}.big")
    ids = [r.value["after"]["id"] for r in records]
    assert len(ids) == BIG_ROWS
    assert ids == list(range(1, BIG_ROWS + 1)), "out of order or duplicated"
    assert len({r.value["transaction"]["id"] for r in records}) == 1
    print(f"peak RSS {rss / 1e6:.0f} MB for {BIG_ROWS} rows in one streamed transaction")
    assert rss < RSS_BOUND, f"peak RSS {rss / 1e6:.0f} MB"


def test_aborted_large_transaction_and_rolled_back_subtransaction_leave_no_trace(
    pipe: Pipeline,
) -> None:
    dsn = pipe.stack.primary_dsn
    with psycopg.connect(dsn) as conn:
        conn.execute(
            f"INSERT INTO {SCHEMA}.small SELECT g, 'aborted' FROM generate_series(100000, 120000) g"
        )
        conn.rollback()
        conn.execute(f"INSERT INTO {SCHEMA}.small VALUES (1, 'kept-before')")
        conn.execute("SAVEPOINT s1")
        # Big enough to be streamed before the rollback of the subtransaction.
        conn.execute(
            f"INSERT INTO {SCHEMA}.small SELECT g, 'sub-aborted' "
            "FROM generate_series(200000, 210000) g"
        )
        conn.execute("ROLLBACK TO SAVEPOINT s1")
        conn.execute(f"INSERT INTO {SCHEMA}.small VALUES (2, 'kept-after')")
        conn.commit()
    pipe.wait_caught_up(120)
    tags = [
        (r.value["after"]["id"], r.value["after"]["tag"]) for r in pipe.changes(f"{SCHEMA}.small")
    ]
    assert tags == [(1, "kept-before"), (2, "kept-after")]


def test_prepared_transaction_appears_only_after_commit_prepared(pipe: Pipeline) -> None:
    dsn = pipe.stack.primary_dsn
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute(f"INSERT INTO {SCHEMA}.small VALUES (10, 'prepared-then-committed')")
        conn.execute("PREPARE TRANSACTION 'sb-commit'")
        conn.execute("BEGIN")
        conn.execute(
            f"INSERT INTO {SCHEMA}.small SELECT g, 'prepared-then-rolled-back' "
            "FROM generate_series(300000, 305000) g"
        )
        conn.execute("PREPARE TRANSACTION 'sb-rollback'")
        conn.execute(f"INSERT INTO {SCHEMA}.small VALUES (11, 'after-prepares')")
    # Give the bridge time to publish what it may: the prepared rows must not show yet.
    sql(dsn, f"INSERT INTO {SCHEMA}.small VALUES (12, 'marker')")
    _wait_for_tag(pipe, "marker")
    tags = {r.value["after"]["tag"] for r in pipe.changes(f"{SCHEMA}.small")}
    assert "prepared-then-committed" not in tags
    assert "prepared-then-rolled-back" not in tags
    sql(dsn, "COMMIT PREPARED 'sb-commit'")
    sql(dsn, "ROLLBACK PREPARED 'sb-rollback'")
    pipe.wait_caught_up(120)
    tags_after = [r.value["after"]["tag"] for r in pipe.changes(f"{SCHEMA}.small")]
    assert tags_after.count("prepared-then-committed") == 1
    assert "prepared-then-rolled-back" not in tags_after
    # Commit order: the prepared transaction committed after the marker.
    assert tags_after.index("prepared-then-committed") > tags_after.index("marker")


def _wait_for_tag(pipe: Pipeline, tag: str) -> None:
    wait_for(
        lambda: tag in {r.value["after"]["tag"] for r in pipe.changes(f"{SCHEMA}.small")},
        60,
        f"record tagged {tag}",
    )


@pytest.fixture(scope="module", params=["slotbridge", "debezium"])
def endless(
    request: pytest.FixtureRequest, stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pipeline]:
    """A bridge writing no BEGIN records (``transaction_begin_records: false``), in each
    record format, over a table of its own; its broker-log audit checks every END alone."""
    pipeline = own_table_pipeline(
        stack,
        Path(tmp_path_factory.mktemp("nobegin")),
        f"{SCHEMA}.no_begin_{request.param[:3]}",
        {
            "SLOTBRIDGE_SOURCE_DSN": (
                f"{stack.primary_dsn} options='-c logical_decoding_work_mem=64kB'"
            ),
            "SLOTBRIDGE_VALUE_FORMAT": request.param,
            "SLOTBRIDGE_TRANSACTION_BEGIN_RECORDS": "false",
        },
    )
    pipeline.start()
    try:
        pipeline.wait_caught_up(60)
        yield pipeline
        assert pipeline.stop() == 0
        report = pipeline.audit()  # begin_records=False: a BEGIN would be a problem
        assert report.source_transactions >= 5
    finally:
        pipeline.cleanup()


def _payload(value: dict[str, Any]) -> dict[str, Any]:
    """A record's value less the Debezium format's Connect envelope."""
    inner: dict[str, Any] = value.get("payload", value)
    return inner


def _every_kind_of_transaction(dsn: str, table: str) -> None:
    """Into ``table``: three small transactions of two changes each, a streamed one of
    4,000 inserts (a bridge whose session has 64 kB of decoding memory), one with a
    rolled-back subtransaction (one change kept) and a prepared one (one change)."""
    with psycopg.connect(dsn) as conn:
        for n in range(3):  # three small transactions of two changes each
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'small')", (n,))
            conn.execute(f"UPDATE {table} SET tag = 'small-updated' WHERE id = %s", (n,))
            conn.commit()
        # Past 64 kB of decoding memory: the server streams it.
        conn.execute(
            f"INSERT INTO {table} SELECT g, md5(g::text) FROM generate_series(1000, 4999) g"
        )
        conn.commit()
        conn.execute(f"INSERT INTO {table} VALUES (10, 'kept')")
        conn.execute("SAVEPOINT s1")
        conn.execute(f"INSERT INTO {table} VALUES (11, 'rolled back')")
        conn.execute("ROLLBACK TO SAVEPOINT s1")
        conn.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute(f"INSERT INTO {table} VALUES (20, 'prepared')")
        conn.execute(f"PREPARE TRANSACTION 'sb-{table}'")
        conn.execute(f"COMMIT PREPARED 'sb-{table}'")


def test_without_begin_records_each_end_counts_its_transaction(endless: Pipeline) -> None:
    """Small transactions, a streamed one, one with a rolled-back subtransaction and a
    prepared one: the transaction topic holds one END per source transaction and nothing
    else, and each END counts exactly the change records of its transaction."""
    (table,) = endless.tables or []
    _every_kind_of_transaction(endless.stack.primary_dsn, table)
    endless.wait_caught_up(120)
    changes = [_payload(r.value) for r in endless.changes(table)]
    per_txn: dict[str, int] = {}
    for change in changes:
        txid = change["transaction"]["id"]
        per_txn[txid] = per_txn.get(txid, 0) + 1
    ends = [
        _payload(r.value) for r in read_topics(endless.kafka, [f"{endless.prefix}.transaction"])
    ]
    assert [e["status"] for e in ends] == ["END"] * len(ends)
    counted = {e["id"]: e["event_count"] for e in ends}
    assert len(counted) == len(ends), "an END written twice"
    assert counted == per_txn
    assert sorted(per_txn.values()) == [1, 1, 2, 2, 2, 4000]
    assert len(changes) == 6 + 4000 + 1 + 1  # small, streamed, kept, prepared


def test_without_transaction_metadata_there_is_no_transaction_topic(
    stack: Stack, tmp_path: Path
) -> None:
    """``transaction_metadata: false``: the same transactions as above, and the bridge
    neither creates nor writes the transaction topic; every change is in Kafka once, each
    source transaction's changes numbered 1..n by their transaction block, and the
    broker-log audit finds no hole, duplicate or transaction record."""
    table = f"{SCHEMA}.no_metadata"
    pipeline = own_table_pipeline(
        stack,
        tmp_path,
        table,
        {
            "SLOTBRIDGE_SOURCE_DSN": (
                f"{stack.primary_dsn} options='-c logical_decoding_work_mem=64kB'"
            ),
            "SLOTBRIDGE_TRANSACTION_METADATA": "false",
        },
    )
    pipeline.start()
    try:
        pipeline.wait_caught_up(60)
        _every_kind_of_transaction(stack.primary_dsn, table)
        pipeline.wait_caught_up(120)
        changes = pipeline.changes(table)
        assert pipeline.stop() == 0
        report = pipeline.audit()
        assert report.source_transactions == 6 and report.change_records == len(changes)
        topics = (
            AdminClient({"bootstrap.servers": stack.kafka.bootstrap}).list_topics(timeout=30).topics
        )
        assert f"{pipeline.prefix}.transaction" not in topics
        assert pipeline.topic(table) in topics
        per_txn: dict[str, list[int]] = {}
        for change in changes:
            block = change.value["transaction"]
            per_txn.setdefault(block["id"], []).append(block["total_order"])
        assert sorted(len(orders) for orders in per_txn.values()) == [1, 1, 2, 2, 2, 4000]
        assert all(orders == list(range(1, len(orders) + 1)) for orders in per_txn.values())
    finally:
        pipeline.cleanup()
