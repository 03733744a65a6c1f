"""``slotbridge demo``: the whole pipeline on the embedded stack, in one command.

Starts the stack, runs the bridge as a child process, writes a small shop workload on the
primary, crashes it and promotes the standby with ``slotbridge failover promote`` (the
bridge and a subscriber follow), writes the rest there, fails back (planned), builds the
Delta tables with one Spark batch, and ends with a table of rows per table in PostgreSQL,
in Kafka and in Delta, and what the broker-log audit found lost or duplicated. The stack
stays up afterwards for poking around.
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
from deltalake import DeltaTable

from services.common.kafka import END_READER_CONFIG
from slotbridge_dev.bootstrap import ROOT
from slotbridge_dev.drill import follow_primary, run_promote
from slotbridge_dev.stack.cluster import wait_until
from slotbridge_dev.stack.kafka_audit import audit
from slotbridge_dev.stack.stack import Stack, StackError

_DDL = """
CREATE SCHEMA IF NOT EXISTS shop;
CREATE TABLE IF NOT EXISTS shop.customers (id serial PRIMARY KEY, name text NOT NULL,
    email text, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE IF NOT EXISTS shop.orders (id serial PRIMARY KEY,
    customer_id int NOT NULL REFERENCES shop.customers, amount numeric(10,2) NOT NULL,
    status text NOT NULL DEFAULT 'new', items jsonb);
"""

_TABLES = ("shop.customers", "shop.orders")
_PROGRESS_TOPIC = "__slotbridge_progress"  # the bridge's default progress_topic

# Before the failover, and after it on the promoted standby.
_WORKLOAD = [
    "INSERT INTO shop.customers (name, email) SELECT 'customer ' || g, 'c' || g || '@example.com'"
    " FROM generate_series(1, 200) g",
    "INSERT INTO shop.orders (customer_id, amount, items) SELECT 1 + (g % 200), (g % 97) + 0.99,"
    " jsonb_build_object('sku', g) FROM generate_series(1, 1000) g",
]
_AFTER_FAILOVER = [
    "UPDATE shop.orders SET status = 'paid' WHERE id % 3 = 0",
    "DELETE FROM shop.orders WHERE id % 10 = 0",
    "INSERT INTO shop.customers (name, email) SELECT 'late ' || g, 'l' || g || '@example.com'"
    " FROM generate_series(1, 50) g",
]
# The subscriber cluster follows shop.customers through a failover subscription.
_SUBSCRIPTION = "demo_sub"
_SUBSCRIBER_DDL = """
CREATE SCHEMA IF NOT EXISTS shop;
CREATE TABLE IF NOT EXISTS shop.customers (id int PRIMARY KEY, name text NOT NULL,
    email text, created_at timestamptz NOT NULL);
"""


def _say(msg: str) -> None:
    click.echo(f"[demo] {msg}")


def _live_keys(bootstrap: str, topic: str) -> int:
    """Rows a read_committed consumer rebuilds from the topic: keys whose last record is
    neither a delete nor a tombstone."""
    consumer = Consumer(
        {
            **END_READER_CONFIG,
            "bootstrap.servers": bootstrap,
            "group.id": f"demo-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
        }
    )
    live: dict[bytes, bool] = {}
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        while True:
            msg = consumer.poll(5.0)
            if msg is None:
                break
            error, key, value = msg.error(), msg.key(), msg.value()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    break
                continue
            if key is not None:
                live[key] = value is not None and json.loads(value)["op"] != "d"
    finally:
        consumer.close()
    return sum(live.values())


def _report(stack: Stack, rows: dict[str, int], warehouse: Path) -> None:
    """The demo's last word: rows per table in PostgreSQL, in Kafka and in Delta, and what
    the broker-log audit found lost or duplicated."""
    report = audit(stack.kafka, "demo", [_PROGRESS_TOPIC])
    click.echo(f"\n{'table':<16}{'PostgreSQL':>12}{'Kafka':>10}{'Delta':>10}")
    for table in _TABLES:
        current = warehouse / "current" / table
        delta = DeltaTable(str(current)).to_pyarrow_dataset().count_rows()
        kafka = _live_keys(stack.kafka_bootstrap, f"demo.{table}")
        click.echo(f"{table:<16}{rows[table]:>12,}{kafka:>10,}{delta:>10,}")
    click.echo(
        f"lost {report.kinds['lost']}, duplicated {report.kinds['duplicated']} (broker-log "
        f"audit of {report.committed:,} committed records, {report.source_transactions:,} "
        "source transactions)"
    )
    if len(report.problems) > report.kinds["lost"] + report.kinds["duplicated"]:
        click.echo(f"other audit problems: {report.summary()}")
    click.echo(f"Delta tables: {warehouse}/current/<table> and {warehouse}/history/<table>")


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
    _subscribe(stack)
    # Every node: the bridge, like any client, follows whichever accepts writes.
    source = follow_primary(stack.primary_dsn, stack.standby_dsn)
    env = {
        **os.environ,
        "SLOTBRIDGE_SOURCE_DSN": source,
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
        _write(source, _WORKLOAD, bridge)
        _failover(stack, state_dir, "primary", "standby", crash=True)
        _say("writing the rest of the workload on the new primary")
        _write(source, _AFTER_FAILOVER, bridge)
        _wait_subscriber(stack, source)
        # A planned failover back, so the stack is as it was (and the next demo finds it so).
        _failover(stack, state_dir, "standby", "primary", crash=False)
        with psycopg.connect(source) as conn:
            rows = {
                t: int(str((conn.execute(f"SELECT count(*) FROM {t}").fetchone() or (0,))[0]))
                for t in _TABLES
            }
    finally:
        bridge.terminate()
        bridge.wait(60)
    _consume(stack, state_dir)
    _say(
        f"bridge stopped (exit {bridge.returncode}); the stack is still up - "
        f"'slotbridge stack down --dir {state_dir}' stops it"
    )
    _report(stack, rows, state_dir / "demo-warehouse" / "tables")


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
        if " ERROR " in line:
            _say(line.strip())
    if proc.returncode != 0:
        raise click.ClickException(f"the Spark consumer failed (exit {proc.returncode})")


def _write(source: str, statements: list[str], bridge: subprocess.Popen[bytes]) -> None:
    """Run the statements on the primary, then wait until the slot confirmed them."""
    with psycopg.connect(source, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)
        target = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
    assert target is not None
    _wait_confirmed(source, bridge, str(target[0]))


def _subscribe(stack: Stack) -> None:
    """The subscriber cluster subscribes to shop.customers with a failover slot (once)."""
    with psycopg.connect(stack.primary_dsn, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_publication WHERE pubname = 'demo_sub'").fetchone():
            conn.execute("CREATE PUBLICATION demo_sub FOR TABLE shop.customers")
    with psycopg.connect(stack.subscriber_dsn, autocommit=True) as conn:
        conn.execute(_SUBSCRIBER_DDL)
        if not conn.execute(
            "SELECT 1 FROM pg_subscription WHERE subname = %s", (_SUBSCRIPTION,)
        ).fetchone():
            conn.execute(
                f"CREATE SUBSCRIPTION {_SUBSCRIPTION} CONNECTION '{stack.primary_dsn}' "
                "PUBLICATION demo_sub WITH (failover = true)"
            )


def _failover(stack: Stack, state_dir: Path, old: str, new: str, *, crash: bool) -> None:
    """``slotbridge failover promote`` of node ``new``, after a crash of ``old`` or planned;
    then ``old`` is rebuilt as the new primary's standby."""
    for slot in ("demo", _SUBSCRIPTION):
        stack.wait_slot_synced(slot, timeout=120, primary_name=old, standby_name=new)
    config = state_dir / "demo-failover.json"
    config.write_text(  # JSON is YAML
        json.dumps(
            {
                "primary": {"dsn": stack.node(old).dsn},
                "standbys": {new: {"dsn": stack.node(new).dsn}},
                "subscribers": {"subscriber": {"dsn": stack.subscriber_dsn}},
                "bridge_slots": ["demo"],
                "log_format": "text",
            }
        )
    )
    if crash:
        stack.node(old).stop("immediate")
        _say(f"crashed the primary ({old}: immediate shutdown)")
    began = time.monotonic()
    result = run_promote(config, new, *(["--force"] if crash else []))
    if result.returncode != 0:
        raise click.ClickException(
            f"slotbridge failover promote failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    _say(
        f"slotbridge failover promote --standby {new}: {new} is the primary after "
        f"{time.monotonic() - began:.1f}s; the subscriber follows it, so does the bridge"
    )
    stack.rejoin_as_standby(old, new)


def _wait_subscriber(stack: Stack, source: str) -> None:
    """The repointed subscriber holds every shop.customers row of the new primary."""
    query = "SELECT count(*) FROM shop.customers"
    with psycopg.connect(source) as conn:
        (want,) = conn.execute(query).fetchone() or (0,)
    if not wait_until(lambda: stack.node("subscriber").query(query) == [(want,)], 60):
        raise click.ClickException("the subscriber did not catch up with the new primary in 60 s")
    _say(f"the subscriber holds all {want} shop.customers rows of the new primary")


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


def _wait_confirmed(source: str, bridge: subprocess.Popen[bytes], target: str) -> None:
    _say(f"waiting until the slot confirms {target} (everything is in Kafka)")
    for _ in range(240):
        if bridge.poll() is not None:
            raise click.ClickException(f"the bridge exited with {bridge.returncode}")
        with psycopg.connect(source) as conn:
            done = conn.execute(
                "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM "
                "pg_replication_slots WHERE slot_name = 'demo'",
                (target,),
            ).fetchone()
        if done and done[0]:
            return
        time.sleep(0.5)
    raise click.ClickException("the bridge did not catch up within 120 s")
