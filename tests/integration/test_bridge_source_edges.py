"""A quiet database keeps its slot moving; bad input gets one line, a non-zero exit, and no
position confirmed that Kafka does not hold."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from slotbridge_dev.bootstrap import cache_dir, pg_bin
from slotbridge_dev.stack.cluster import Node, free_ports, pg_os_user
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import (
    Pipeline,
    _lsn,
    one_line_error,
    read_topics,
    sql,
    wait_for,
)

SCHEMA = "edge"


@pytest.fixture
def schema(stack: Stack) -> None:
    sql(
        stack.primary_dsn,
        f"""
        DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA};
        CREATE TABLE {SCHEMA}.published (id int PRIMARY KEY, v text);
        CREATE TABLE {SCHEMA}.unpublished (id serial PRIMARY KEY, v text);""",
    )


def test_quiet_database_slot_keeps_up(stack: Stack, schema: None, tmp_path: Path) -> None:
    pipe = Pipeline(stack, [f"{SCHEMA}.published"], tmp_path)
    pipe.start()
    try:
        pipe.wait_caught_up(60)
        restart_before = sql(
            stack.primary_dsn,
            "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (pipe.name,),
        )[0][0]
        for _ in range(5):
            sql(
                stack.primary_dsn,
                f"INSERT INTO {SCHEMA}.unpublished (v) "
                "SELECT md5(g::text) FROM generate_series(1, 2000) g",
            )
            target = _lsn(sql(stack.primary_dsn, "SELECT pg_current_wal_lsn()::text")[0][0])

            def passed(target: int = target) -> bool:
                return pipe._confirmed() >= target

            wait_for(
                passed,
                10,
                "confirmed_flush_lsn to pass writes to an unpublished table",
            )
        # restart_lsn moves when decoding passes a running-transactions record (written
        # every 15 s by the server; one now, so the test need not wait for it).
        sql(stack.primary_dsn, "SELECT pg_log_standby_snapshot()")
        wait_for(
            lambda: (
                _lsn(
                    sql(
                        stack.primary_dsn,
                        "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                        (pipe.name,),
                    )[0][0]
                )
                > _lsn(restart_before)
            ),
            30,
            "restart_lsn to move",
        )
        assert pipe.changes(f"{SCHEMA}.published") == []
    finally:
        pipe.cleanup()


def test_wrong_password_is_one_line_and_never_logged(stack: Stack, tmp_path: Path) -> None:
    primary = stack.node("primary")
    hba = primary.data_dir / "pg_hba.conf"
    original = hba.read_text()
    sql(
        stack.primary_dsn,
        "DROP ROLE IF EXISTS sb_pw; CREATE ROLE sb_pw LOGIN REPLICATION PASSWORD 'the-right-one'",
    )
    hba.write_text(
        "host all sb_pw 127.0.0.1/32 scram-sha-256\n"
        "host replication sb_pw 127.0.0.1/32 scram-sha-256\n" + original
    )
    sql(stack.primary_dsn, "SELECT pg_reload_conf()")
    try:
        pipe = Pipeline(stack, None, tmp_path)
        pipe.extra["SLOTBRIDGE_SOURCE_DSN"] = stack.primary_dsn.replace(
            "user=postgres", "user=sb_pw"
        )
        pipe.extra["SLOTBRIDGE_SOURCE_PASSWORD"] = "s3cret-wrong-pw"
        code, output = pipe.run_to_exit(60)
        line = one_line_error(output)
        assert code != 0
        assert "password authentication failed" in line
        assert "s3cret-wrong-pw" not in output
    finally:
        hba.write_text(original)
        sql(stack.primary_dsn, "SELECT pg_reload_conf()")


def test_unreachable_host(stack: Stack, tmp_path: Path) -> None:
    pipe = Pipeline(stack, None, tmp_path)
    pipe.extra["SLOTBRIDGE_SOURCE_DSN"] = f"host=127.0.0.1 port={free_ports(1)[0]} user=postgres"
    code, output = pipe.run_to_exit(60)
    assert code != 0
    assert "Connection refused" in one_line_error(output)


def test_missing_table(stack: Stack, tmp_path: Path) -> None:
    pipe = Pipeline(stack, ["nope.missing"], tmp_path)
    code, output = pipe.run_to_exit(60)
    assert code == 2
    assert "nope.missing" in one_line_error(output)


@pytest.fixture
def replica_level_server() -> Iterator[str]:
    root = Path(tempfile.mkdtemp(prefix="slotbridge-walrep-"))
    root.chmod(0o755)
    node = Node("walrep", root, free_ports(1)[0], pg_bin(cache_dir(), "17"), pg_os_user())
    node.make_dir()
    node.initdb()
    node.write_config({"wal_level": "replica", "listen_addresses": "127.0.0.1", "port": node.port})
    node.start()
    try:
        yield node.dsn
    finally:
        node.stop(mode="immediate")
        shutil.rmtree(root, ignore_errors=True)


def test_wal_level_replica_is_refused(
    stack: Stack, replica_level_server: str, tmp_path: Path
) -> None:
    pipe = Pipeline(stack, None, tmp_path)
    pipe.extra["SLOTBRIDGE_SOURCE_DSN"] = replica_level_server
    code, output = pipe.run_to_exit(60)
    assert code == 2
    assert "wal_level is 'replica'" in one_line_error(output)


def test_huge_row_stops_the_bridge_and_confirms_nothing_of_it(
    stack: Stack, schema: None, tmp_path: Path
) -> None:
    pipe = Pipeline(stack, [f"{SCHEMA}.published"], tmp_path)
    pipe.start()
    try:
        pipe.wait_caught_up(60)
        sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.published VALUES (1, 'small')")
        pipe.wait_caught_up(60)
        before = pipe._confirmed()
        sql(
            stack.primary_dsn,
            f"INSERT INTO {SCHEMA}.published VALUES (2, repeat('x', 50 * 1024 * 1024))",
        )
        assert pipe.proc is not None
        code = pipe.proc.wait(120)
        assert code != 0
        line = one_line_error(pipe.output())
        assert "edge.published" in line and "over the limit" in line
        ids = [r.value["after"]["id"] for r in pipe.changes(f"{SCHEMA}.published")]
        assert ids == [1]
        after = _lsn(
            sql(
                stack.primary_dsn,
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (pipe.name,),
            )[0][0]
        )
        commit = _lsn(sql(stack.primary_dsn, "SELECT pg_current_wal_lsn()::text")[0][0])
        assert before <= after < commit
        assert read_topics(stack.kafka, [pipe.progress_topic])
    finally:
        pipe.cleanup()
