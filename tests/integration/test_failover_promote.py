"""The promote runbook on real servers: drills under writes, dry run, interrupted runs.

Every test promotes, so each gets a dedicated stack (``fresh_stack``), never the shared
one. Timings are printed (run with ``-s``) for the report.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from slotbridge_dev.drill import (
    DrillResult,
    Workload,
    drill,
    fence_by_stopping,
    follow_primary,
    run_promote,
    settings_for,
    subscribe,
)
from slotbridge_dev.stack.cluster import wait_until
from slotbridge_dev.stack.stack import Stack

TABLE = "drill"


def _rows(stack: Stack, node: str) -> list[tuple[Any, ...]]:
    return stack.node(node).query(f"SELECT id, payload FROM {TABLE} ORDER BY id")


def _assert_after_failover(stack: Stack, result: DrillResult, sub: str) -> None:
    """Subscriber equals the new primary; the old primary, started again, feeds nobody."""
    assert result.promote_exit == 0, result.output
    assert result.summary["ok"], result.output
    assert result.committed_after_promote > 0, "the workload did not resume on the new primary"
    # The workload stopped: the subscriber must end with exactly the new primary's rows.
    assert wait_until(lambda: _rows(stack, "subscriber") == _rows(stack, "standby"), 60), (
        "subscriber differs from the new primary"
    )
    assert len(_rows(stack, "standby")) >= result.workload.committed
    old = stack.node("primary")
    old.start()
    time.sleep(3)  # time for a subscriber that still pointed at it to connect
    senders = old.query(
        "SELECT count(*) FROM pg_stat_replication r JOIN pg_replication_slots s"
        " ON s.active_pid = r.pid WHERE s.slot_type = 'logical'"
    )
    assert senders == [(0,)], "a subscriber went back to the old primary"
    conninfo = stack.node("subscriber").query(
        "SELECT subconninfo FROM pg_subscription WHERE subname = %s", (sub,)
    )[0][0]
    assert f"port={stack.node('standby').port}" in conninfo
    print(
        f"\nDRILL promote_seconds={result.promote_seconds:.2f} "
        f"seconds_to_streaming={result.summary['seconds_to_streaming']} "
        f"workload_commits={result.workload.committed} "
        f"longest_write_gap_s={result.workload.longest_gap_s:.2f} "
        f"steps={[(s['step'], s['result'], round(s['seconds'], 2)) for s in result.steps]}"
    )


def _setup(stack: Stack, **extra: Any) -> tuple[Path, str]:
    sub = subscribe(stack, TABLE)
    return settings_for(stack, stack.state_dir / "failover.yaml", **extra), sub


def test_drill_old_primary_shut_down(fresh_stack: Callable[[], Stack]) -> None:
    """Planned failover under writes: the runbook fences and stops the old primary."""
    stack = fresh_stack()
    config, sub = _setup(stack, fence_command=fence_by_stopping(stack))
    workload = Workload(follow_primary(stack.primary_dsn, stack.standby_dsn), TABLE)
    result = drill(config, "standby", workload)
    assert not stack.node("primary").is_running(), "fence_command did not stop the primary"
    _assert_after_failover(stack, result, sub)
    # The soft fence survives the restart: the old primary refuses writes by default.
    assert stack.node("primary").query("SHOW default_transaction_read_only") == [("on",)]


def test_drill_old_primary_crashed(fresh_stack: Callable[[], Stack]) -> None:
    """Unplanned failover: the primary dies (immediate stop); promote needs --force."""
    stack = fresh_stack()
    config, sub = _setup(stack)
    workload = Workload(follow_primary(stack.primary_dsn, stack.standby_dsn), TABLE)
    result = drill(
        config,
        "standby",
        workload,
        extra=("--force",),
        before=lambda: stack.node("primary").stop("immediate"),
    )
    fence = next(s for s in result.steps if s["step"] == "fence")
    assert fence["result"] == "skipped"
    # It is down, not read-only: say so, and that it would come back writable.
    stop = next(s for s in result.steps if s["step"] == "stop_old_primary")
    assert stop["result"] == "warn", stop
    assert stop["detail"].startswith(
        "old primary is down or unreachable, so it was not "
        "fenced: if restarted it comes back WRITABLE; keep it "
        "down, or run `slotbridge failover watch`"
    ), stop
    assert "configure fence_command" in stop["detail"], stop
    assert "read-only" not in stop["detail"], stop
    _assert_after_failover(stack, result, sub)


def _catalog(stack: Stack) -> dict[str, Any]:
    """Everything promote could change, read from every node."""
    q = {n: stack.node(n).query for n in ("primary", "standby", "subscriber")}
    return {
        "subscriptions": q["subscriber"](
            "SELECT subname, subenabled, subconninfo, subfailover FROM pg_subscription ORDER BY 1"
        ),
        "recovery": [q[n]("SELECT pg_is_in_recovery()") for n in ("primary", "standby")],
        "auto_conf": [
            q[n](
                "SELECT name, setting FROM pg_file_settings WHERE "
                "right(sourcefile, 9) = 'auto.conf' ORDER BY 1"
            )
            for n in ("primary", "standby")
        ],
        "read_only": q["primary"]("SHOW default_transaction_read_only"),
        "slots": q["standby"](
            "SELECT slot_name, synced, temporary FROM pg_replication_slots ORDER BY 1"
        ),
    }


def test_dry_run_changes_nothing(fresh_stack: Callable[[], Stack]) -> None:
    stack = fresh_stack()
    config, _ = _setup(stack)
    before = _catalog(stack)
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "slotbridge"),
            "failover",
            "promote",
            "-c",
            str(config),
            "--standby",
            "standby",
            "--dry-run",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "would disable subscriber/drill_sub" in proc.stdout
    assert "would run pg_promote()" in proc.stdout
    # The old primary answers and no fence_command is set: it stays up, only soft-fenced.
    assert "no fence_command configured: the old primary keeps running, soft-fenced" in proc.stdout
    assert _catalog(stack) == before


@pytest.mark.parametrize("action", ["error", "kill"])
def test_interrupted_after_disable_then_rerun(
    fresh_stack: Callable[[], Stack], action: str
) -> None:
    stack = fresh_stack()
    config, sub = _setup(stack)
    env = {**os.environ, "SLOTBRIDGE_FAILPOINTS": f"promote_after_disable={action}"}
    first = run_promote(config, "standby", env=env)
    assert first.returncode != 0
    state = stack.node("subscriber").query(
        "SELECT subenabled FROM pg_subscription WHERE subname = %s", (sub,)
    )
    assert state == [(False,)], "the failpoint fired before the subscription was disabled"
    assert stack.node("standby").in_recovery()

    began = time.monotonic()
    second = run_promote(config, "standby")
    assert second.returncode == 0, second.stdout + second.stderr
    print(f"\nRERUN after {action}: {time.monotonic() - began:.2f}s")
    assert not stack.node("standby").in_recovery()
    # A third run finds nothing to do and does no harm.
    third = run_promote(config, "standby")
    assert third.returncode == 0, third.stdout + third.stderr
    assert '"result": "done"' in third.stdout  # check and verify still run
    for step in ("disable", "promote", "repoint", "enable"):
        assert f'"step": "{step}"' in third.stdout
    assert third.stdout.count('"result": "skipped"') >= 5
