"""The source upgraded from PostgreSQL 17 to 18 with ``pg_upgrade`` under a bridge.

The procedure of docs/operations.md ("Upgrading PostgreSQL"), on real servers: writes
stopped, the bridge caught up and stopped cleanly, the primary upgraded with PostgreSQL's
own pg_upgrade (which moves the caught-up failover slot), the standby rebuilt from it. The
bridge then refuses the new cluster (a new system identifier) in one line naming the
command to run; after ``slotbridge adopt-upgrade`` it resumes. Kafka must hold every
change once (broker-log audit), and the failover slot must be synced to the rebuilt 18
standby.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, one_line_error, run_cli, sql

TABLE = "upgraded"


@pytest.fixture
def source_17() -> Iterator[Stack]:
    """A primary and standby of PostgreSQL 17 of their own (the upgrade replaces them);
    the bridge writes to the shared stack's broker."""
    # Under /tmp: the unprivileged PostgreSQL user cannot enter pytest's tmp_path.
    source = Stack(Path(tempfile.mkdtemp(prefix="slotbridge-upgrade-")), "17")
    try:
        source.up_source()
        yield source
    finally:
        source.down(purge=True)
        shutil.rmtree(source.state_dir, ignore_errors=True)


def _write(dsn: str, first: int, count: int) -> None:
    """``count`` rows from id ``first`` on: inserted, half of them updated, a tenth deleted,
    in transactions of a few changes each."""
    for start in range(first, first + count, 10):
        ids = range(start, min(start + 10, first + count))
        sql(dsn, f"INSERT INTO {TABLE} SELECT g, 'v' || g FROM unnest(%s::int[]) g", (list(ids),))
        sql(
            dsn, f"UPDATE {TABLE} SET v = v || '+' WHERE id = ANY(%s) AND id %% 2 = 0", (list(ids),)
        )
        sql(dsn, f"DELETE FROM {TABLE} WHERE id = ANY(%s) AND id %% 10 = 3", (list(ids),))


def test_bridge_resumes_exactly_once_after_pg_upgrade_to_18(
    stack: Stack, source_17: Stack, tmp_path: Path
) -> None:
    primary = source_17.primary_dsn
    sql(primary, f"CREATE TABLE {TABLE} (id int PRIMARY KEY, v text)")
    pipe = Pipeline(source_17, [f"public.{TABLE}"], tmp_path, broker=stack.kafka)
    sql(primary, f"CREATE PUBLICATION {pipe.name} FOR TABLE {TABLE}")
    try:
        pipe.start()
        pipe.wait_caught_up()  # slot made and the (empty) table's snapshot done: all streams
        _write(primary, 0, 300)
        pipe.wait_caught_up()
        source_17.wait_slot_synced(pipe.name, timeout=120)
        assert pipe.stop() == 0
        old_system = sql(primary, "SELECT system_identifier::text FROM pg_control_system()")[0][0]

        source_17.upgrade("18")

        assert int(sql(primary, "SHOW server_version_num")[0][0]) >= 180000
        new_system = sql(primary, "SELECT system_identifier::text FROM pg_control_system()")[0][0]
        assert new_system != old_system
        # pg_upgrade carried the slot, still a failover slot.
        assert sql(
            primary, "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (pipe.name,)
        ) == [(True,)]

        code, output = pipe.run_to_exit(120)
        assert code != 0
        refusal = one_line_error(output)
        assert f"adopt-upgrade --from-system {old_system}" in refusal, refusal

        code, output = run_cli("adopt-upgrade", "--from-system", "1", env=pipe.env())
        assert code == 1 and f"published from system {old_system}, not 1" in output, output

        code, output = run_cli("adopt-upgrade", "--from-system", old_system, env=pipe.env())
        assert code == 0, output
        assert f"now belongs to system {new_system}" in output, output
        code, output = run_cli("adopt-upgrade", "--from-system", old_system, env=pipe.env())
        assert code == 0 and "nothing to do" in output, output

        pipe.start()
        _write(primary, 300, 300)
        pipe.wait_caught_up()
        source_17.wait_slot_synced(pipe.name, timeout=120)
        assert pipe.stop() == 0
    finally:
        pipe.kill()

    # Every change once, in order: replaying the topic gives the table.
    changes = pipe.changes(f"public.{TABLE}")
    state: dict[int, str] = {}
    for record in changes:
        value = record.value
        if value["op"] == "d":
            del state[value["before"]["id"]]
        else:
            state[value["after"]["id"]] = value["after"]["v"]
    assert state == dict(sql(primary, f"SELECT id, v FROM {TABLE}"))
    # 600 inserts, 300 updates, 60 deletes: none lost, none twice.
    assert [r.value["op"] for r in changes].count("c") == 600
    assert len(changes) == 600 + 300 + 60
    pipe.audit()
