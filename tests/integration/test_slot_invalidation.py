"""A slot that the source invalidates (``max_slot_wal_keep_size``) is seen coming, named
when it happens, and started over by ``slotbridge resync``.

On its own stack: the test changes the primary's ``max_slot_wal_keep_size``, which would
invalidate other tests' idle slots too.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from services.bridge.progress.kafka_reader import read_topic
from slotbridge_dev.stack.cluster import free_ports
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import (
    Pipeline,
    metric,
    one_line_error,
    run_cli,
    sql,
    wait_for,
)


def test_slot_reserve_is_exported_and_an_invalidated_slot_is_named(
    fresh_stack: Callable[[], Stack], tmp_path: Path
) -> None:
    stack = fresh_stack()
    dsn = stack.primary_dsn
    # max_slot_wal_keep_size below holds the standby's physical slot too: a standby more
    # than 1 MB behind at the checkpoint (a busy machine) loses it, and the primary then
    # holds every failover slot's changes back for that standby, for good ("physical
    # replication slot ... specified in synchronized_standby_slots has been invalidated"):
    # a resync's snapshot then never sees its watermarks (the likely cause of a CI run's
    # stall; its logs were gone). This test is about the bridge's slot alone.
    sql(dsn, "ALTER SYSTEM RESET synchronized_standby_slots")
    sql(dsn, "SELECT pg_reload_conf()")
    sql(dsn, "CREATE TABLE filler (id bigserial PRIMARY KEY, pad text)")
    (port,) = free_ports(1)
    pipe = Pipeline(stack, ["public.filler"], tmp_path, extra={"SLOTBRIDGE_HTTP_PORT": str(port)})
    pipe.start()
    try:
        pipe.wait_caught_up()
        # Without a limit the slot keeps any amount of WAL.
        wait_for(
            lambda: metric(port, "slotbridge_slot_safe_wal_bytes"),
            60,
            "the slot's reserve in /metrics",
        )
        assert list(metric(port, "slotbridge_slot_safe_wal_bytes").values()) == [float("inf")]
        status = metric(port, "slotbridge_slot_wal_status")
        assert status[f'slot="{pipe.name}",status="reserved"'] == 1.0, status
        sql(dsn, "ALTER SYSTEM SET max_slot_wal_keep_size = '64MB'")
        sql(dsn, "SELECT pg_reload_conf()")
        # What the slot keeps, rounded to WAL segments: 64 MiB, less what was written since.
        wait_for(
            lambda: (
                metric(port, "slotbridge_slot_safe_wal_bytes")
                == {f'slot="{pipe.name}"': pytest.approx(64 * 2**20, rel=0.5)}
            ),
            60,
            "a finite reserve once max_slot_wal_keep_size is set",
        )
        assert pipe.stop() == 0

        # The bridge is down while the source writes far past the limit: the slot goes.
        sql(dsn, "ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        sql(dsn, "SELECT pg_reload_conf()")
        for _ in range(6):
            sql(
                dsn,
                "INSERT INTO filler (pad) SELECT repeat('x', 1000) FROM generate_series(1, 2000)",
            )
            sql(dsn, "SELECT pg_switch_wal()")
        sql(dsn, "CHECKPOINT")
        reason = sql(
            dsn,
            "SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = %s",
            (pipe.name,),
        )
        assert reason == [("wal_removed",)], reason
        code, output = pipe.run_to_exit(120)
        assert code != 0
        line = one_line_error(output)
        assert f"slot {pipe.name} is invalidated (wal_removed)" in line, line
        assert "Kafka misses every change since" in line and "slotbridge resync" in line, line

        _resync_and_converge(pipe, dsn, "wal_removed")
    finally:
        pipe.kill()


def test_an_idle_slot_invalidated_by_postgresql_18_is_named_and_resynced(
    fresh_stack: Callable[..., Stack], tmp_path: Path
) -> None:
    # PostgreSQL 18 also drops what a slot holds once it is idle past
    # idle_replication_slot_timeout (checked at checkpoints): a bridge down that long finds
    # its slot invalidated although the WAL may still be there.
    stack = fresh_stack("18")
    dsn = stack.primary_dsn
    sql(dsn, "CREATE TABLE filler (id bigserial PRIMARY KEY, pad text)")
    sql(dsn, "INSERT INTO filler (pad) SELECT 'before' FROM generate_series(1, 3000)")
    pipe = Pipeline(stack, ["public.filler"], tmp_path)
    pipe.start()
    try:
        pipe.wait_caught_up()
        assert pipe.stop() == 0
        sql(dsn, "ALTER SYSTEM SET idle_replication_slot_timeout = '1s'")
        sql(dsn, "SELECT pg_reload_conf()")

        def invalidated() -> list[tuple[Any, ...]]:
            sql(dsn, "CHECKPOINT")
            return sql(
                dsn,
                "SELECT invalidation_reason FROM pg_replication_slots WHERE slot_name = %s"
                " AND invalidation_reason IS NOT NULL",
                (pipe.name,),
            )

        assert wait_for(invalidated, 60, "the idle slot's invalidation") == [("idle_timeout",)]
        # The other slots of the stack must not go the same way while the test goes on.
        sql(dsn, "ALTER SYSTEM RESET idle_replication_slot_timeout")
        sql(dsn, "SELECT pg_reload_conf()")
        code, output = pipe.run_to_exit(120)
        assert code != 0
        line = one_line_error(output)
        assert f"slot {pipe.name} is invalidated (idle_timeout)" in line, line
        _resync_and_converge(pipe, dsn, "idle_timeout")
    finally:
        pipe.kill()


def _resync_and_converge(pipe: Pipeline, dsn: str, reason: str) -> None:
    """``slotbridge resync`` after the slot was invalidated for ``reason``; the bridge then
    snapshots the table again while writes go on, and a consumer of the topic converges on
    the table, the gap on record and the broker's log clean."""
    # Resync: every published table again, into the same topics, while writes go on.
    code, out = run_cli("resync", env=pipe.env())
    assert code == 0 and "start the bridge" in out, out
    pipe.start(
        SLOTBRIDGE_SNAPSHOT_CHUNK_ROWS="2000", SLOTBRIDGE_FAILPOINTS="before_watermark=sleep0.3"
    )
    # The first run streamed too; the refused one did not.
    wait_for(lambda: pipe.output().count("INFO    streaming") == 2, 60, "the new slot")
    sql(dsn, "UPDATE filler SET pad = 'updated' WHERE id % 7 = 0")
    sql(dsn, "DELETE FROM filler WHERE id % 11 = 0")
    sql(dsn, "INSERT INTO filler (pad) SELECT 'after' FROM generate_series(1, 500)")
    pipe.wait_caught_up()
    assert pipe.stop() == 0
    # A consumer converges on the table: for every key its last record is the row.
    last: dict[int, Any] = {}
    for record in pipe.changes("public.filler"):
        last[record.key["id"]] = record.value
    rows = {k: v["after"]["pad"] for k, v in last.items() if v["op"] != "d"}
    assert rows == dict(sql(dsn, "SELECT id, pad FROM filler"))
    assert {r.value["op"] for r in pipe.changes("public.filler")} >= {"r", "u", "d", "c"}
    gaps = [
        json.loads(value)
        for key, value in read_topic(
            {"bootstrap.servers": pipe.kafka.bootstrap}, pipe.progress_topic
        )
        if key is not None and b"gap_after_lsn" in key and value is not None
    ]
    assert [(g["slot"], g["tables"], g["reason"]) for g in gaps] == [
        (pipe.name, ["public.filler"], f"slot invalidated ({reason})")
    ]
    pipe.audit()
