"""``slotbridge demo``: the whole pipeline on the embedded stack, in one command.

Starts the stack, runs the bridge as a child process, writes a small shop workload on
the primary, waits until the slot has confirmed it, and prints what Kafka holds next to
what PostgreSQL holds. The stack stays up afterwards for poking around.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import click
import psycopg
from confluent_kafka import Consumer, KafkaError, TopicPartition

from slotbridge_dev.bootstrap import ROOT
from slotbridge_dev.stack.stack import Stack, StackError

_DDL = """
CREATE SCHEMA IF NOT EXISTS shop;
CREATE TABLE IF NOT EXISTS shop.customers (id serial PRIMARY KEY, name text NOT NULL,
    email text, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS shop.orders (id serial PRIMARY KEY,
    customer_id int NOT NULL REFERENCES shop.customers, amount numeric(10,2) NOT NULL,
    status text NOT NULL DEFAULT 'new', items jsonb);
"""

_WORKLOAD = [
    "INSERT INTO shop.customers (name, email) SELECT 'customer ' || g, 'c' || g || '@example.com'"
    " FROM generate_series(1, 200) g",
    "INSERT INTO shop.orders (customer_id, amount, items) SELECT 1 + (g % 200), (g % 97) + 0.99,"
    " jsonb_build_object('sku', g) FROM generate_series(1, 1000) g",
    "UPDATE shop.orders SET status = 'paid' WHERE id % 3 = 0",
    "DELETE FROM shop.orders WHERE id % 10 = 0",
]


def _say(msg: str) -> None:
    click.echo(f"[demo] {msg}")


def _count(bootstrap: str, topic: str) -> dict[str, int]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"demo-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    ops: dict[str, int] = {}
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        while True:
            msg = consumer.poll(5.0)
            if msg is None:
                break
            error, value = msg.error(), msg.value()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    break
                continue
            op = json.loads(value)["op"] if value is not None else "tombstone"
            ops[op] = ops.get(op, 0) + 1
    finally:
        consumer.close()
    return ops


@click.command()
@click.option(
    "--dir",
    "state_dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="SLOTBRIDGE_STACK_DIR",
    default=ROOT / ".stack",
    show_default=True,
)
def demo(state_dir: Path) -> None:
    """Run the pipeline end to end on the local stack and show the result."""
    stack = Stack(state_dir)
    try:
        stack.up()
    except StackError as exc:
        click.echo(f"slotbridge demo: {exc}", err=True)
        sys.exit(1)
    with psycopg.connect(stack.primary_dsn, autocommit=True) as conn:
        conn.execute(_DDL)
    env = {
        **os.environ,
        "SLOTBRIDGE_SOURCE_DSN": stack.primary_dsn,
        "SLOTBRIDGE_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "SLOTBRIDGE_SLOT_NAME": "demo",
        "SLOTBRIDGE_PUBLICATION_NAME": "demo",
        "SLOTBRIDGE_TOPIC_PREFIX": "demo",
        "SLOTBRIDGE_TABLES": '["shop.customers", "shop.orders"]',
        "SLOTBRIDGE_LOG_FORMAT": "text",
        "SLOTBRIDGE_HTTP_PORT": "0",
    }
    log_path = state_dir / "demo-bridge.log"
    _say(f"starting the bridge (log: {log_path})")
    with open(log_path, "ab") as log:
        bridge = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "run"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_slot(stack, bridge)
        _say("writing the workload on the primary")
        with psycopg.connect(stack.primary_dsn, autocommit=True) as conn:
            for statement in _WORKLOAD:
                conn.execute(statement)
            target = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
        assert target is not None
        _wait_confirmed(stack, bridge, str(target[0]))
        with psycopg.connect(stack.primary_dsn) as conn:
            rows = {
                t: (conn.execute(f"SELECT count(*) FROM shop.{t}").fetchone() or (0,))[0]
                for t in ("customers", "orders")
            }
        for table in ("customers", "orders"):
            ops = _count(stack.kafka_bootstrap, f"demo.shop.{table}")
            _say(
                f"shop.{table}: {rows[table]} rows in PostgreSQL; "
                f"Kafka topic demo.shop.{table}: {ops}"
            )
    finally:
        bridge.terminate()
        bridge.wait(60)
    _consume(stack, state_dir)
    _say(
        f"bridge stopped (exit {bridge.returncode}); the stack is still up - "
        f"'slotbridge stack down --dir {state_dir}' stops it"
    )


def _consume(stack: Stack, state_dir: Path) -> None:
    """One Spark batch: the topics into typed current-state and history Delta tables."""
    warehouse = state_dir / "demo-warehouse"
    _say(f"running the Spark consumer once (Delta tables under {warehouse}/tables)")
    env = {
        **os.environ,
        "SLOTBRIDGE_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "SLOTBRIDGE_TOPIC_PREFIX": "demo",
        "SLOTBRIDGE_WAREHOUSE": str(warehouse / "tables"),
        "SLOTBRIDGE_CHECKPOINT_DIR": str(warehouse / "checkpoint"),
        "SLOTBRIDGE_LOG_FORMAT": "text",
        **{k: v for k, v in stack.env().items() if k == "SLOTBRIDGE_JARS_DIR"},
    }
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "consume", "--once"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    for line in proc.stdout.splitlines() + proc.stderr.splitlines():
        if "batch applied" in line or " ERROR " in line:
            _say(line.strip())
    if proc.returncode != 0:
        raise click.ClickException(f"the Spark consumer failed (exit {proc.returncode})")


def _wait_slot(stack: Stack, bridge: subprocess.Popen[bytes]) -> None:
    for _ in range(120):
        if bridge.poll() is not None:
            raise click.ClickException(f"the bridge exited with {bridge.returncode}")
        with psycopg.connect(stack.primary_dsn) as conn:
            if conn.execute(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = 'demo' AND active"
            ).fetchone():
                return
        time.sleep(0.5)
    raise click.ClickException("the bridge did not start streaming within 60 s")


def _wait_confirmed(stack: Stack, bridge: subprocess.Popen[bytes], target: str) -> None:
    _say(f"waiting until the slot confirms {target} (everything is in Kafka)")
    for _ in range(240):
        if bridge.poll() is not None:
            raise click.ClickException(f"the bridge exited with {bridge.returncode}")
        with psycopg.connect(stack.primary_dsn) as conn:
            done = conn.execute(
                "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM "
                "pg_replication_slots WHERE slot_name = 'demo'",
                (target,),
            ).fetchone()
        if done and done[0]:
            return
        time.sleep(0.5)
    raise click.ClickException("the bridge did not catch up within 120 s")
