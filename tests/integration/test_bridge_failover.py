"""The bridge follows a promotion: the drill with the bridge streaming to Kafka.

The primary is shut down by the runbook's fence (or crashes) under writes, the standby is
promoted, and the bridge - on a
multi-host DSN - resumes from the synced slot on the new primary. Afterwards Kafka must
hold exactly the new primary's rows, each once; and a bridge pointed at the old primary,
started again, must refuse it (older timeline). A crashed old primary comes back writable,
so ``target_session_attrs=read-write`` alone would pick it when it is listed first: the
bridge must pass it over for the next server of its DSN.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from slotbridge_dev.drill import (
    Workload,
    drill,
    fence_by_stopping,
    follow_primary,
    run_promote,
    settings_for,
    subscribe,
)
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, wait_for

TABLE = "drill"


@pytest.mark.parametrize("old_primary", ["shut_down", "crashed"])
def test_bridge_follows_promotion_exactly_once(
    fresh_stack: Callable[[], Stack], tmp_path: Path, old_primary: str
) -> None:
    stack = fresh_stack()
    planned = old_primary == "shut_down"
    subscribe(stack, TABLE)
    pipe = Pipeline(stack, [f"public.{TABLE}"], tmp_path)
    pipe.extra["SLOTBRIDGE_SOURCE_DSN"] = follow_primary(stack.primary_dsn, stack.standby_dsn)
    fence = {"fence_command": fence_by_stopping(stack)} if planned else {}
    config = settings_for(stack, tmp_path / "failover.yaml", bridge_slots=[pipe.name], **fence)
    pipe.start()
    try:
        pipe.wait_caught_up(60)
        stack.wait_slot_synced(pipe.name, timeout=90)
        started = time.monotonic()
        result = drill(
            config,
            "standby",
            Workload(follow_primary(stack.primary_dsn, stack.standby_dsn), TABLE),
            extra=() if planned else ("--force",),
            before=None if planned else lambda: stack.node("primary").stop("immediate"),
        )
        assert result.promote_exit == 0, result.output
        assert result.committed_after_promote > 0

        new_primary = stack.node("standby")
        source = sorted(r[0] for r in new_primary.query(f"SELECT id FROM {TABLE}"))

        def published() -> list[int]:
            return sorted(r.value["after"]["id"] for r in pipe.changes(f"public.{TABLE}"))

        wait_for(
            lambda: published() == source or len(published()) > len(source),
            120,
            f"Kafka to hold the new primary's rows\n{pipe.output()[-3000:]}",
        )
        caught_up_s = time.monotonic() - started - 2.0  # the drill's warm-up before promote
        ids = published()
        assert len(ids) == len(set(ids)), "duplicates in Kafka"
        assert ids == source, "Kafka and the new primary differ"
        assert pipe.proc is not None and pipe.proc.poll() is None
        assert "session ended, reconnecting" in pipe.output()
        print(
            f"\nBRIDGE DRILL ({old_primary}) rows={len(ids)} "
            f"promote_s={result.promote_seconds:.2f} "
            f"promote_start_to_kafka_caught_up_s={caught_up_s:.2f}"
        )
        assert pipe.stop() == 0
        pipe.audit()

        # The old primary comes back (fenced read-only, or writable after a crash): a bridge
        # pointed at it refuses it.
        old = stack.node("primary")
        old.start()
        pipe.extra["SLOTBRIDGE_SOURCE_DSN"] = stack.primary_dsn
        code, output = pipe.run_to_exit(120)
        assert code != 0
        assert "old primary after a failover" in output, output[-2000:]
    finally:
        pipe.kill()


def test_bridge_passes_over_a_writable_old_primary_listed_first(
    fresh_stack: Callable[[], Stack], tmp_path: Path
) -> None:
    """Crashed old primary restarted, first in the DSN: skipped, named, and not read."""
    stack = fresh_stack()
    old, new = stack.node("primary"), stack.node("standby")
    with old.connect() as conn:
        conn.execute(f"CREATE TABLE {TABLE} (id bigserial PRIMARY KEY, payload text)")
    pipe = Pipeline(stack, [f"public.{TABLE}"], tmp_path)
    pipe.extra["SLOTBRIDGE_SOURCE_DSN"] = follow_primary(stack.primary_dsn, stack.standby_dsn)
    config = settings_for(stack, tmp_path / "failover.yaml", bridge_slots=[pipe.name])

    def insert(node_dsn: str, payload: str) -> None:
        with psycopg.connect(node_dsn, autocommit=True) as conn:
            conn.execute(f"INSERT INTO {TABLE} (payload) VALUES (%s)", (payload,))

    def published() -> list[str]:
        return [r.value["after"]["payload"] for r in pipe.changes(f"public.{TABLE}")]

    pipe.start()
    try:
        insert(stack.primary_dsn, "before")
        pipe.wait_caught_up(60)
        stack.wait_slot_synced(pipe.name, timeout=90)
        old.stop("immediate")
        promoted = run_promote(config, "standby", "--force")
        assert promoted.returncode == 0, promoted.stdout + promoted.stderr
        # The running bridge follows, so its progress record now names timeline 2.
        insert(stack.standby_dsn, "on the new primary")
        wait_for(
            lambda: "on the new primary" in published(),
            120,
            f"the bridge to follow the promotion\n{pipe.output()[-3000:]}",
        )
        assert pipe.stop() == 0

        old.start()  # crashed, so never fenced: it comes back writable on timeline 1
        assert old.query("SHOW transaction_read_only") == [("off",)]
        insert(stack.primary_dsn, "split brain")
        before = len(pipe.output())
        pipe.start()
        insert(stack.standby_dsn, "after the restart")
        wait_for(
            lambda: "after the restart" in published(),
            60,
            f"the bridge to stream from the new primary\n{pipe.output()[-3000:]}",
        )
        run = pipe.output()[before:]
        skipped = [line for line in run.splitlines() if "skipping" in line]
        assert len(skipped) == 1 and " WARNING " in skipped[0], run
        assert f"server=127.0.0.1:{old.port} " in skipped[0], skipped[0]
        assert "timeline=1 " in skipped[0] and "published_timeline=2" in skipped[0], skipped[0]
        assert "old primary after a failover" in skipped[0], skipped[0]
        assert f"session starting slot={pipe.name} server=127.0.0.1:{new.port} " in run, run
        assert sorted(published()) == ["after the restart", "before", "on the new primary"]
    finally:
        pipe.kill()
