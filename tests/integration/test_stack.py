"""The embedded stack does what the other tests take for granted, on real servers."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, Producer

from slotbridge_dev.stack.cluster import free_ports, pid_alive
from slotbridge_dev.stack.kafka import dump_log_segments
from slotbridge_dev.stack.stack import NODE_NAMES, Stack

SLOTBRIDGE = str(Path(sys.executable).parent / "slotbridge")


def _name(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def _eventually(check: Callable[[], object], timeout: float = 30) -> object:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.2)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SLOTBRIDGE, "stack", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
        check=False,
    )


def _assert_one_line_failure(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def empty_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="slotbridge-stack-"))
    yield path
    subprocess.run(
        [SLOTBRIDGE, "stack", "down", "--purge", "--dir", str(path)],
        capture_output=True,
        check=False,
    )
    for child in sorted(path.rglob("*"), reverse=True):
        child.unlink() if not child.is_dir() or child.is_symlink() else child.rmdir()
    path.rmdir()


def test_standby_streams_and_replays_rows(stack: Stack) -> None:
    table = _name("t_standby")
    with psycopg.connect(stack.primary_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v text)")
        conn.execute(f"INSERT INTO {table} VALUES (1, 'on the primary')")
    standby = stack.node("standby")
    assert standby.query("SELECT status FROM pg_stat_wal_receiver") == [("streaming",)]

    def replayed() -> bool:
        try:
            return standby.query(f"SELECT v FROM {table}") == [("on the primary",)]
        except psycopg.errors.UndefinedTable:
            return False

    assert _eventually(replayed), "row never reached the standby"
    status = stack.status()["parts"]["standby"]
    assert status["streaming"] and status["replay_lag_bytes"] is not None


def test_failover_slot_becomes_sync_ready(stack: Stack) -> None:
    slot = _name("failover_slot")
    with psycopg.connect(stack.primary_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, false, true)", (slot,)
        )
    try:
        # A fresh slot can stay temporary until it moves on the primary (the catalog-xmin
        # trap, seen on 17 and 18); nobody consumes this one, so advancing loses nothing.
        waited = stack.wait_slot_synced(slot, timeout=60, advance=True)
        print(
            f"failover slot sync-ready on the standby after {waited:.1f}s "
            f"(PostgreSQL {stack.pg_major})"
        )
        rows = stack.node("standby").query(
            "SELECT synced, temporary, invalidation_reason FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot,),
        )
        assert rows == [(True, False, None)]
        synced = {s["name"] for s in stack.status()["parts"]["standby"]["synced_slots"]}
        assert slot in synced
    finally:
        with psycopg.connect(stack.primary_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))


def test_failover_subscription_replicates(stack: Stack) -> None:
    table, pub, sub = _name("t_sub"), _name("pub"), _name("sub")
    ddl = f"CREATE TABLE {table} (id int PRIMARY KEY, v text)"
    with (
        psycopg.connect(stack.primary_dsn, autocommit=True) as primary,
        psycopg.connect(stack.subscriber_dsn, autocommit=True) as subscriber,
    ):
        primary.execute(ddl)
        primary.execute(f"CREATE PUBLICATION {pub} FOR TABLE {table}")
        subscriber.execute(ddl)
        subscriber.execute(
            f"CREATE SUBSCRIPTION {sub} CONNECTION '{stack.primary_dsn}' "
            f"PUBLICATION {pub} WITH (failover = true)"
        )
        try:
            primary.execute(f"INSERT INTO {table} VALUES (1, 'replicated')")
            assert _eventually(
                lambda: subscriber.execute(f"SELECT v FROM {table}").fetchall() == [("replicated",)]
            ), "row never arrived"
            failover = primary.execute(
                "SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (sub,)
            ).fetchall()
            assert failover == [(True,)]
        finally:
            subscriber.execute(f"DROP SUBSCRIPTION {sub}")
            primary.execute(f"DROP PUBLICATION {pub}")


def test_transactional_producer_read_committed(stack: Stack) -> None:
    topic = _name("stack_txn")
    producer = Producer(
        {"bootstrap.servers": stack.kafka_bootstrap, "transactional.id": _name("txn")}
    )
    producer.init_transactions(60)
    producer.begin_transaction()
    producer.produce(topic, b"aborted")
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, b"committed")
    producer.commit_transaction(30)

    consumer = Consumer(
        {
            "bootstrap.servers": stack.kafka_bootstrap,
            "group.id": _name("g"),
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
        }
    )
    consumer.subscribe([topic])
    seen: list[bytes] = []
    try:
        deadline = time.monotonic() + 60
        while not seen and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                seen.append(msg.value() or b"")
        # anything else already in the partition arrives in the same fetches
        while (msg := consumer.poll(2.0)) is not None:
            if msg.error() is None:
                seen.append(msg.value() or b"")
    finally:
        consumer.close()
    assert seen == [b"committed"]


def test_broker_log_dump_shows_producer_sequences(stack: Stack) -> None:
    """DumpLogSegments, the ground truth of exactly-once audits, reads the broker's files."""
    topic = _name("stack_dump")
    producer = Producer(
        {"bootstrap.servers": stack.kafka_bootstrap, "transactional.id": _name("txn")}
    )
    producer.init_transactions(60)
    for value in (b"first", b"second"):
        producer.begin_transaction()
        producer.produce(topic, value)
        producer.commit_transaction(30)
    segment = stack.kafka.data_dir / f"{topic}-0" / "00000000000000000000.log"

    def both_committed() -> str | None:
        # The commit returns before the broker has written the partition's marker.
        dump = dump_log_segments(segment)
        return dump if dump.count("endTxnMarker: COMMIT") == 2 else None

    dump = _eventually(both_committed)
    assert isinstance(dump, str), "commit markers never reached the segment"
    batches = re.findall(r"baseSequence: (-?\d+) .* isTransactional: (\w+) isControl: false", dump)
    assert batches == [("0", "true"), ("1", "true")], dump
    assert "payload: first" in dump and "payload: second" in dump


def test_up_twice_then_down_leaves_no_process(fresh_stack: Callable[[], Stack]) -> None:
    dedicated = fresh_stack()
    state_dir = str(dedicated.state_dir)
    started = time.monotonic()
    again = _cli("up", "--dir", state_dir)
    print(f"second `stack up` took {time.monotonic() - started:.1f}s")
    assert again.returncode == 0, again.stderr
    assert dedicated.status()["healthy"]
    pids = set().union(*(dedicated.node(n).pids() for n in NODE_NAMES))
    kafka_pid = dedicated.kafka.pid()
    assert kafka_pid is not None and len(pids) >= 3

    down = _cli("down", "--dir", state_dir)
    assert down.returncode == 0, down.stderr
    assert not [p for p in pids | {kafka_pid} if pid_alive(p)]
    mentions = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and pid_alive(int(entry.name)):
            try:
                if state_dir.encode() in (entry / "cmdline").read_bytes():
                    mentions.append(int(entry.name))
            except OSError:
                continue
    assert mentions == []
    assert not dedicated.status()["healthy"]


def test_up_refuses_a_taken_port(empty_dir: Path) -> None:
    ports = free_ports(5)
    state = {
        "pg_major": "17",
        "kafka_cluster_id": "AAAAAAAAAAAAAAAAAAAAAA",
        "ports": dict(zip([*NODE_NAMES, "kafka", "kafka_controller"], ports, strict=True)),
    }
    (empty_dir / "stack.json").write_text(json.dumps(state))
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", ports[0]))
        squatter.listen()
        proc = _cli("up", "--dir", str(empty_dir))
    _assert_one_line_failure(proc, "primary", f"port {ports[0]}", "already taken")


def test_up_without_binary_cache(empty_dir: Path, tmp_path: Path) -> None:
    proc = _cli("up", "--dir", str(empty_dir), env={"SLOTBRIDGE_CACHE": str(tmp_path)})
    _assert_one_line_failure(proc, "slotbridge_dev.bootstrap")
