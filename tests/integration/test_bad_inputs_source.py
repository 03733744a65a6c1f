"""Bad inputs on the source side (issue #12, "Never destroy, never expose, never stall").

Items covered, by their number in issue #12:

1. a slot with the configured name that slotbridge did not create (another plugin, or a
   pgoutput slot of another consumer) is refused, never dropped;
6. a publication dropped while the slot streams it stops the bridge with one line, and
   nothing past what Kafka holds is confirmed;
10. two bridges started at once on one slot: exactly one streams, the other exits with
    one line (under CPU load, several rounds); a newer bridge takes over from a streaming
    one; a slot held by a live non-slotbridge consumer is waited for, then refused; a
    bridge of another database under the same slot name, with its own transactional id,
    is refused without disturbing the first (issue #16 item 8);
13. ``tables: []`` is refused, and so is an existing publication that does not publish
    a configured table;
14. a least-privilege REPLICATION role: a missing GRANT on a replication origin function
    or a publication it may not create is one line naming the GRANT or who creates it;
    with the GRANTs of docs/bridge.md the bridge streams.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.bridge.publish.publisher import HEARTBEAT_S
from services.bridge.receive.stream import ReplicationConnection
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, _lsn, one_line_error, sql, wait_for

SCHEMA = "badsrc"


@pytest.fixture
def table(stack: Stack) -> str:
    """The configured table, and ``other``, one a stray publication may hold instead."""
    ddl = [
        f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE",
        f"CREATE SCHEMA {SCHEMA}",
        f"CREATE TABLE {SCHEMA}.t (id int PRIMARY KEY, v text)",
        f"CREATE TABLE {SCHEMA}.other (id int PRIMARY KEY)",
    ]
    sql(stack.primary_dsn, "; ".join(ddl))
    return f"{SCHEMA}.t"


@pytest.fixture
def pipe(stack: Stack, table: str, tmp_path: Path) -> Iterator[Pipeline]:
    pipeline = Pipeline(stack, [table], tmp_path)
    try:
        yield pipeline
    finally:
        pipeline.cleanup()


def _slot(stack: Stack, name: str) -> tuple[str, str] | None:
    rows = sql(
        stack.primary_dsn,
        "SELECT plugin, restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
        (name,),
    )
    return (rows[0][0], rows[0][1]) if rows else None


# -- 1: someone else's slot -----------------------------------------------------------------


@pytest.mark.parametrize("plugin", ["test_decoding", "pgoutput"])
def test_foreign_slot_is_refused_never_dropped(stack: Stack, pipe: Pipeline, plugin: str) -> None:
    sql(stack.primary_dsn, "SELECT pg_create_logical_replication_slot(%s, %s)", (pipe.name, plugin))
    before = _slot(stack, pipe.name)
    code, output = pipe.run_to_exit(60)
    line = one_line_error(output)
    assert code == 2
    assert pipe.name in line and plugin in line and "choose another slot_name" in line
    assert "recreating" not in output
    assert _slot(stack, pipe.name) == before  # the very same slot: not dropped, not moved


def test_own_slot_killed_before_anything_published_is_kept_and_snapshotted(
    stack: Stack, pipe: Pipeline
) -> None:
    """Our origin and slot exist, nothing is published: chunked snapshots need no exported
    snapshot, so the slot is kept (never dropped) and the snapshot starts again."""
    sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES (1, 'a')")
    code, output = pipe.run_to_exit(60, SLOTBRIDGE_FAILPOINTS="before_kafka_commit=kill")
    assert code == -9 and _slot(stack, pipe.name) is not None, output
    sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES (2, 'b')")
    pipe.start()
    pipe.wait_caught_up(60)
    run2 = pipe.output()[pipe.output().rindex("--- run 2") :]
    assert "created failover slot" not in run2 and "initial snapshot starting" in run2, run2
    ids = sorted((r.value["op"], r.value["after"]["id"]) for r in pipe.changes(f"{SCHEMA}.t"))
    # Row 2 may come as a snapshot row, a streamed insert or both (its insert precedes
    # the chunk's watermark): a consumer ends with both rows either way.
    assert ("r", 1) in ids and {i for _, i in ids} == {1, 2}, ids
    assert pipe.stop() == 0


# -- 6: publication dropped while streaming --------------------------------------------------


def test_publication_dropped_while_streaming_stops(stack: Stack, pipe: Pipeline) -> None:
    pipe.start()
    pipe.wait_caught_up(60)
    sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES (1, 'before')")
    pipe.wait_caught_up(60)
    sql(stack.primary_dsn, f"DROP PUBLICATION {pipe.name}")
    before_row = _lsn(sql(stack.primary_dsn, "SELECT pg_current_wal_insert_lsn()::text")[0][0])
    sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES (2, 'after')")
    assert pipe.proc is not None
    code = pipe.proc.wait(60)
    line = one_line_error(pipe.output())
    assert code == 2
    assert f"publication {pipe.name} was dropped" in line and f"slot {pipe.name}" in line
    assert (
        sql(stack.primary_dsn, "SELECT 1 FROM pg_publication WHERE pubname = %s", (pipe.name,))
        == []
    )  # not recreated behind the operator's back
    assert [r.value["after"]["id"] for r in pipe.changes(f"{SCHEMA}.t")] == [1]
    confirmed = _lsn(
        sql(
            stack.primary_dsn,
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (pipe.name,),
        )[0][0]
    )
    # Only what Kafka holds, or WAL with nothing for us (the DROP): never the row after it.
    assert pipe.published_end_lsn() <= confirmed <= before_row
    # A restart says the same and recreates nothing.
    code, output = pipe.run_to_exit(60)
    assert code == 2 and f"publication {pipe.name} was dropped" in one_line_error(output)


# -- 13: tables --------------------------------------------------------------------------------


def test_empty_tables_is_refused(pipe: Pipeline) -> None:
    pipe.tables = []
    code, output = pipe.run_to_exit(60)
    assert code == 2
    assert "Traceback" not in output and "omit tables" in output, output


def test_publication_missing_a_configured_table_is_refused(stack: Stack, pipe: Pipeline) -> None:
    sql(stack.primary_dsn, f"CREATE PUBLICATION {pipe.name} FOR TABLE {SCHEMA}.other")
    code, output = pipe.run_to_exit(60)
    line = one_line_error(output)
    assert code == 2
    assert f"{SCHEMA}.t" in line and f"ALTER PUBLICATION {pipe.name} ADD TABLE" in line
    assert _slot(stack, pipe.name) is None


# -- 14: least privilege -----------------------------------------------------------------------

ROLE = "sb_least"
ORIGIN_FUNCTIONS = (
    "pg_replication_origin_create(text)",
    "pg_replication_origin_advance(text, pg_lsn)",
    "pg_replication_origin_progress(text, boolean)",
)


@pytest.fixture
def least_role(stack: Stack, pipe: Pipeline, table: str) -> Iterator[str]:
    if sql(stack.primary_dsn, "SELECT 1 FROM pg_roles WHERE rolname = %s", (ROLE,)):
        sql(stack.primary_dsn, f"DROP OWNED BY {ROLE}; DROP ROLE {ROLE}")
    sql(
        stack.primary_dsn,
        f"CREATE ROLE {ROLE} LOGIN REPLICATION; "
        f"GRANT USAGE ON SCHEMA {SCHEMA} TO {ROLE}; "
        f"GRANT SELECT ON {table} TO {ROLE}",
    )
    pipe.extra["SLOTBRIDGE_SOURCE_DSN"] = stack.primary_dsn.replace("user=postgres", f"user={ROLE}")
    try:
        yield ROLE
    finally:
        pipe.kill()
        sql(stack.primary_dsn, f"DROP OWNED BY {ROLE}; DROP ROLE {ROLE}")


def test_least_privilege_role_cannot_create_publication(pipe: Pipeline, least_role: str) -> None:
    code, output = pipe.run_to_exit(60)
    line = one_line_error(output)
    assert code == 2
    assert f'CREATE PUBLICATION "{pipe.name}" FOR TABLE "{SCHEMA}"."t"' in line
    assert "owner" in line


def test_least_privilege_role_needs_origin_grants(
    stack: Stack, pipe: Pipeline, least_role: str
) -> None:
    sql(stack.primary_dsn, f"CREATE PUBLICATION {pipe.name} FOR TABLE {SCHEMA}.t")
    code, output = pipe.run_to_exit(60)
    line = one_line_error(output)
    assert code == 2
    assert f"GRANT EXECUTE ON FUNCTION pg_replication_origin_create(text) TO {least_role}" in line
    assert _slot(stack, pipe.name) is None
    # With the GRANTs of docs/bridge.md it streams.
    for function in ORIGIN_FUNCTIONS:
        sql(stack.primary_dsn, f"GRANT EXECUTE ON FUNCTION {function} TO {least_role}")
    sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES (1, 'a')")
    pipe.start()
    pipe.wait_caught_up(60)
    sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES (2, 'b')")
    pipe.wait_caught_up(60)
    assert pipe.stop() == 0
    assert sorted(r.value["after"]["id"] for r in pipe.changes(f"{SCHEMA}.t")) == [1, 2]


# -- 10: two bridges on one slot ---------------------------------------------------------------


def _fenced_verdict(output: str) -> str:
    """The bridge's one ERROR line; librdkafka logs the fencing on lines of its own
    ("[rdkafka#producer-1] ... fenced by a newer instance")."""
    return one_line_error(
        "\n".join(text for text in output.splitlines() if "[rdkafka#" not in text)
    )


def _burn(stop: float) -> None:
    while time.monotonic() < stop:
        pass


def test_two_bridges_on_one_slot_exactly_one_wins(stack: Stack, table: str, tmp_path: Path) -> None:
    rounds = 4
    burners = [
        multiprocessing.Process(target=_burn, args=(time.monotonic() + 600,)) for _ in range(2)
    ]
    for burner in burners:
        burner.start()
    try:
        for n in range(rounds):
            first = Pipeline(stack, [table], tmp_path / f"r{n}a")
            first.workdir.mkdir()
            second = Pipeline(stack, [table], tmp_path / f"r{n}b", name=first.name)
            second.workdir.mkdir()
            try:
                _race(stack, first, second, n)
            finally:
                second.kill()
                first.cleanup()
    finally:
        for burner in burners:
            burner.kill()
            burner.join()


def _race(stack: Stack, first: Pipeline, second: Pipeline, n: int) -> None:
    first.start()
    second.start()
    assert first.proc is not None and second.proc is not None
    procs = {"first": first, "second": second}
    wait_for(
        lambda: any(p.proc is not None and p.proc.poll() is not None for p in procs.values()),
        90,
        f"round {n}: one bridge to exit",
    )
    ((loser_name, loser),) = [
        (k, p) for k, p in procs.items() if p.proc is not None and p.proc.poll() is not None
    ]
    winner = second if loser is first else first
    assert loser.proc is not None and loser.proc.returncode not in (0, None)
    line = _fenced_verdict(loser.output())
    assert f"another bridge took over slot {first.name}" in line, line
    # The winner keeps streaming through its idle heartbeats: rows written after them arrive.
    time.sleep(HEARTBEAT_S + 1)
    sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES ({n + 1}, 'round')")
    winner.wait_caught_up(90)
    assert winner.proc is not None and winner.proc.poll() is None
    assert n + 1 in [r.value["after"]["id"] for r in winner.changes(f"{SCHEMA}.t")]
    assert winner.stop() == 0
    winner.audit()
    print(f"round {n}: {loser_name} lost: {line}")


def test_newer_bridge_takes_over_from_a_streaming_one(
    stack: Stack, pipe: Pipeline, tmp_path: Path
) -> None:
    """The rule, stated: the bridge that registered with Kafka last wins. The older one,
    though idle, learns at its next heartbeat that it was fenced, stops with one line and
    frees the slot; the newer one, which found the slot busy, waits for that and streams."""
    pipe.start()
    pipe.wait_caught_up(60)
    sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES (1, 'old')")
    pipe.wait_caught_up(60)
    newer = Pipeline(stack, pipe.tables, tmp_path / "newer", name=pipe.name)
    newer.workdir.mkdir()
    try:
        newer.start()
        assert pipe.proc is not None
        assert pipe.proc.wait(HEARTBEAT_S + 30) == 1
        assert "another bridge took over slot" in _fenced_verdict(pipe.output())
        sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES (2, 'new')")
        newer.wait_caught_up(60)
        assert [r.value["after"]["id"] for r in newer.changes(f"{SCHEMA}.t")] == [1, 2]
        assert newer.stop() == 0
        newer.audit()
    finally:
        newer.kill()


def test_bridges_of_two_databases_with_one_slot_name_do_not_fence_each_other(
    stack: Stack, pipe: Pipeline, tmp_path: Path
) -> None:
    """Two releases of the chart, other databases, same slot name, same Kafka and progress
    topic: each has its own transactional id (the chart scopes it), so the misconfigured
    one is refused with one line and the other never notices (with one shared id the
    newcomer's producer would fence it, test_newer_bridge_takes_over_from_a_streaming_one)."""
    pipe.extra["SLOTBRIDGE_KAFKA_TRANSACTIONAL_ID"] = f"slotbridge.a.{pipe.name}"
    pipe.start()
    pipe.wait_caught_up(60)
    sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES (1, 'before')")
    pipe.wait_caught_up(60)
    other = Pipeline(
        stack,
        pipe.tables,
        tmp_path / "other",
        name=pipe.name,
        extra={
            "SLOTBRIDGE_SOURCE_DSN": stack.subscriber_dsn,
            "SLOTBRIDGE_KAFKA_TRANSACTIONAL_ID": f"slotbridge.b.{pipe.name}",
        },
    )
    other.workdir.mkdir()
    try:
        code, output = other.run_to_exit(60)
        assert code != 0
        line = _fenced_verdict(output)
        assert "published progress came from PostgreSQL system" in line, line
        # Past an idle heartbeat, when a fenced bridge would have learnt it and stopped.
        time.sleep(HEARTBEAT_S + 1)
        sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.t VALUES (2, 'after')")
        pipe.wait_caught_up(60)
        assert pipe.proc is not None and pipe.proc.poll() is None, pipe.output()[-2000:]
        assert [r.value["after"]["id"] for r in pipe.changes(f"{SCHEMA}.t")] == [1, 2]
        assert pipe.stop() == 0
        pipe.audit()
    finally:
        other.kill()
        sql(
            stack.subscriber_dsn,
            "SELECT pg_drop_replication_slot(slot_name) FROM "
            "pg_replication_slots WHERE slot_name = %s",
            (pipe.name,),
        )


def test_slot_held_by_another_consumer_is_waited_for_then_refused(
    stack: Stack, pipe: Pipeline
) -> None:
    """A live consumer that is no slotbridge holds our slot: the bridge waits what a fenced
    bridge or a dead client's walsender could take (wal_sender_timeout + two heartbeats +
    10 s), then stops with one line instead of retrying for ever."""
    pipe.start()
    pipe.wait_caught_up(60)
    assert pipe.stop() == 0
    sql(stack.primary_dsn, "ALTER SYSTEM SET wal_sender_timeout = '2s'")
    sql(stack.primary_dsn, "SELECT pg_reload_conf()")
    # Named as another program: a bridge would end a walsender named as its own.
    other = ReplicationConnection(f"{stack.primary_dsn} application_name=pg_recvlogical")
    stop = threading.Event()

    def consume() -> None:  # a live client: it reads and replies, so it is never timed out
        while not stop.is_set():
            while other.next_message() is not None:
                pass
            other.wait(0.2)
            other.send_status(0, 0)

    other.start(pipe.name, 0, {"proto_version": "4", "publication_names": f'"{pipe.name}"'})
    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    try:
        code, output = pipe.run_to_exit(2 + 2 * HEARTBEAT_S + 10 + 40)
        line = one_line_error(output)
        assert code == 2
        assert f"slot {pipe.name} is still in use by process" in line
        assert "stop that consumer or choose another slot_name" in line
    finally:
        stop.set()
        consumer.join(10)
        other.close()
        sql(stack.primary_dsn, "ALTER SYSTEM RESET wal_sender_timeout")
        sql(stack.primary_dsn, "SELECT pg_reload_conf()")
