"""A slot that the source invalidates (``max_slot_wal_keep_size``) is seen coming and named
when it happens.

On its own stack: the test changes the primary's ``max_slot_wal_keep_size``, which would
invalidate other tests' idle slots too.
"""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from slotbridge_dev.stack.cluster import free_ports
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, one_line_error, sql, wait_for


def _metric(port: int, name: str) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        labels: float(value)
        for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE)
    }


def test_slot_reserve_is_exported_and_an_invalidated_slot_is_named(
    fresh_stack: Callable[[], Stack], tmp_path: Path
) -> None:
    stack = fresh_stack()
    dsn = stack.primary_dsn
    sql(dsn, "CREATE TABLE filler (id bigserial PRIMARY KEY, pad text)")
    (port,) = free_ports(1)
    pipe = Pipeline(stack, ["public.filler"], tmp_path, extra={"SLOTBRIDGE_HTTP_PORT": str(port)})
    pipe.start()
    try:
        pipe.wait_caught_up()
        # Without a limit the slot keeps any amount of WAL.
        wait_for(
            lambda: _metric(port, "slotbridge_slot_safe_wal_bytes"),
            60,
            "the slot's reserve in /metrics",
        )
        assert list(_metric(port, "slotbridge_slot_safe_wal_bytes").values()) == [float("inf")]
        status = _metric(port, "slotbridge_slot_wal_status")
        assert status[f'slot="{pipe.name}",status="reserved"'] == 1.0, status
        sql(dsn, "ALTER SYSTEM SET max_slot_wal_keep_size = '64MB'")
        sql(dsn, "SELECT pg_reload_conf()")
        # What the slot keeps, rounded to WAL segments: 64 MiB, less what was written since.
        wait_for(
            lambda: (
                _metric(port, "slotbridge_slot_safe_wal_bytes")
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
        assert "Kafka misses every change since" in line and "new slot_name" in line, line
    finally:
        pipe.kill()
