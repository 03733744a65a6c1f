"""Bad input on the Kafka side gets one line and a non-zero exit, never a stall (issue #12).

- 7: a table whose name Kafka refuses in a topic gets a mapped topic; names that collide
  in Kafka's metric names stop the bridge with one line.
- 8: raising max_row_bytes raises the limit of the topics the bridge already made (a
  record the broker still refuses is one fatal line naming topic, size and setting:
  test_kafka_sink.py::test_refused_record_aborts_the_transaction).
- 9: max_row_bytes beyond the brokers' socket.request.max.bytes is refused at start; a
  huge row is refused from its pgoutput size, before its record is built.
- 11: unparsable JSON in SLOTBRIDGE_KAFKA_CONFIG / SLOTBRIDGE_KAFKA_OPTIONS, and
  ``consume --once`` against an absent Kafka: one line, in seconds.
- 12 and 15: Kafka unreachable, not Kafka, or another security protocol: one readable
  line naming kafka_bootstrap, before the publication and origin are created.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pytest

# Their public home, confluent_kafka.admin (its stubs do not declare the re-export).
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    ResourceType,
)

from services.contract.topics import table_topic
from slotbridge_dev.stack.cluster import free_ports
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import (
    Pipeline,
    _lsn,
    one_line_error,
    read_topics,
    run_cli,
    sql,
)

SCHEMA = "kfkbad"


@pytest.fixture
def schema(stack: Stack) -> None:
    sql(
        stack.primary_dsn,
        f"""
        DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; DROP SCHEMA IF EXISTS {SCHEMA}_x CASCADE;
        CREATE SCHEMA {SCHEMA}; CREATE TABLE {SCHEMA}.ok (id int PRIMARY KEY, v text);""",
    )


def _all_tables(stack: Stack, tmp_path: Path) -> Pipeline:
    """A FOR ALL TABLES publication (new tables stream from their creation), no snapshot."""
    pipe = Pipeline(stack, None, tmp_path)
    pipe.extra["SLOTBRIDGE_SNAPSHOT_MODE"] = "never"
    return pipe


def test_table_names_kafka_refuses_get_their_own_topics(
    stack: Stack, schema: None, tmp_path: Path
) -> None:
    pipe = _all_tables(stack, tmp_path)
    pipe.start()
    try:
        pipe.wait_caught_up(60)
        names = ["bad name", "a.b", "ümlaut"]
        for n, name in enumerate(names):
            sql(
                stack.primary_dsn,
                f'CREATE TABLE {SCHEMA}."{name}" (id int PRIMARY KEY);'
                f'INSERT INTO {SCHEMA}."{name}" VALUES ({n})',
            )
        sql(stack.primary_dsn, f"INSERT INTO {SCHEMA}.ok VALUES (1, 'after them')")
        pipe.wait_caught_up(60)
        assert pipe.stop() == 0
        for n, name in enumerate(names):
            records = [
                r
                for r in read_topics(stack.kafka, [table_topic(pipe.prefix, SCHEMA, name)])
                if r.value
            ]
            assert [(r.value["source"]["table"], r.value["after"]["id"]) for r in records] == [
                (name, n)
            ]
        assert [r.value["after"]["id"] for r in pipe.changes(f"{SCHEMA}.ok")] == [1]
        pipe.audit()
    finally:
        pipe.cleanup()


def test_topic_names_colliding_in_kafka_metrics_stop_with_one_line(
    stack: Stack, schema: None, tmp_path: Path
) -> None:
    """``{prefix}.kfkbad.x_y`` and ``{prefix}.kfkbad_x.y`` are one name to Kafka's metrics."""
    pipe = _all_tables(stack, tmp_path)
    pipe.start()
    try:
        pipe.wait_caught_up(60)
        sql(
            stack.primary_dsn,
            f"CREATE TABLE {SCHEMA}.x_y (id int PRIMARY KEY);INSERT INTO {SCHEMA}.x_y VALUES (1)",
        )
        sql(
            stack.primary_dsn,
            f"CREATE SCHEMA {SCHEMA}_x; CREATE TABLE {SCHEMA}_x.y "
            f"(id int PRIMARY KEY); INSERT INTO {SCHEMA}_x.y VALUES (1)",
        )
        assert pipe.proc is not None
        assert pipe.proc.wait(60) != 0
        line = one_line_error(pipe.output())
        assert f"{pipe.prefix}.{SCHEMA}_x.y" in line and "collides" in line
        assert "leave it out of the publication" in line
    finally:
        pipe.cleanup()


def _random_bytea(size: int) -> str:
    """SQL for ``size`` random bytes: a record that compression cannot shrink."""
    return f"decode('{base64.b64encode(os.urandom(size)).decode()}', 'base64')"


@pytest.fixture
def blobs(stack: Stack) -> str:
    sql(
        stack.primary_dsn,
        f"DROP SCHEMA IF EXISTS {SCHEMA} CASCADE; CREATE SCHEMA {SCHEMA};"
        f"CREATE TABLE {SCHEMA}.blobs (id int PRIMARY KEY, b bytea)",
    )
    return f"{SCHEMA}.blobs"


def test_raising_max_row_bytes_raises_the_topics_limit(
    stack: Stack, blobs: str, tmp_path: Path
) -> None:
    pipe = Pipeline(stack, [blobs], tmp_path)
    small = {"SLOTBRIDGE_MAX_ROW_BYTES": "20000"}
    pipe.start(**small)
    try:
        sql(stack.primary_dsn, f"INSERT INTO {blobs} VALUES (1, {_random_bytea(1000)})")
        pipe.wait_caught_up(60)  # the topic exists, made for 20000-byte records
        sql(stack.primary_dsn, f"INSERT INTO {blobs} VALUES (2, {_random_bytea(100_000)})")
        assert pipe.proc is not None
        assert pipe.proc.wait(60) != 0
        assert "max_row_bytes" in one_line_error(pipe.output())
        # The operator raises max_row_bytes as the line says; the row must now go through.
        pipe.start(SLOTBRIDGE_MAX_ROW_BYTES="1000000")
        pipe.wait_caught_up(60)
        assert pipe.stop() == 0
        assert "raised the topic's max.message.bytes" in pipe.output()
        assert [r.value["after"]["id"] for r in pipe.changes(blobs)] == [1, 2]
        pipe.audit()
    finally:
        pipe.cleanup()


def test_record_refused_after_its_topic_limit_was_lowered_is_published_by_a_new_session(
    stack: Stack, blobs: str, tmp_path: Path
) -> None:
    """Someone lowers a topic's limit while the bridge streams, and the broker refuses a
    record the session had made the topic take: the commit fails naming it, and the next
    session aligns the topic's limit as a new session does and publishes the row, once."""
    pipe = Pipeline(stack, [blobs], tmp_path)
    pipe.start()
    try:
        sql(stack.primary_dsn, f"INSERT INTO {blobs} VALUES (1, {_random_bytea(100)})")
        pipe.wait_caught_up(60)  # the topic exists, and its partition is proven
        topic = pipe.topic(blobs)
        lower = ConfigResource(
            ResourceType.TOPIC,
            topic,
            incremental_configs=[
                ConfigEntry(
                    "max.message.bytes", "2000", incremental_operation=AlterConfigOpType.SET
                )
            ],
        )
        admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
        admin.incremental_alter_configs([lower])[lower].result(timeout=30)
        sql(stack.primary_dsn, f"INSERT INTO {blobs} VALUES (2, {_random_bytea(20_000)})")
        pipe.wait_caught_up(90)
        assert pipe.stop() == 0
        output = pipe.output()
        assert "MSG_SIZE_TOO_LARGE" in output and "a new session raises it again" in output
        assert "raised the topic's max.message.bytes" in output
        assert [r.value["after"]["id"] for r in pipe.changes(blobs)] == [1, 2]
        pipe.audit()
    finally:
        pipe.cleanup()


def test_max_row_bytes_beyond_the_brokers_request_limit_is_refused_at_start(
    stack: Stack, blobs: str, tmp_path: Path
) -> None:
    """The broker would close the connection of every request carrying such a row, with no
    error the producer can report: the bridge would stall, silently, its memory growing."""
    pipe = Pipeline(stack, [blobs], tmp_path)
    code, output = pipe.run_to_exit(60, SLOTBRIDGE_MAX_ROW_BYTES=str(200 * 1024 * 1024))
    assert code != 0
    line = one_line_error(output)
    assert "socket.request.max.bytes=104857600" in line and "lower max_row_bytes" in line
    assert not sql(
        stack.primary_dsn, "SELECT 1 FROM pg_publication WHERE pubname = %s", (pipe.name,)
    )


def test_huge_row_is_refused_from_its_raw_size(stack: Stack, blobs: str, tmp_path: Path) -> None:
    pipe = Pipeline(stack, [blobs], tmp_path)
    pipe.start(SLOTBRIDGE_MAX_ROW_BYTES="100000")
    try:
        sql(stack.primary_dsn, f"INSERT INTO {blobs} VALUES (1, 'small')")
        pipe.wait_caught_up(60)
        before = pipe._confirmed()
        sql(stack.primary_dsn, f"INSERT INTO {blobs} VALUES (2, {_random_bytea(1_000_000)})")
        commit = _lsn(sql(stack.primary_dsn, "SELECT pg_current_wal_lsn()::text")[0][0])
        assert pipe.proc is not None
        assert pipe.proc.wait(60) != 0
        line = one_line_error(pipe.output())
        assert f"a change of {blobs} at LSN" in line and "in the replication stream" in line
        assert "over the limit of 100000" in line
        assert [r.value["after"]["id"] for r in pipe.changes(blobs)] == [1]
        after = _lsn(
            sql(
                stack.primary_dsn,
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (pipe.name,),
            )[0][0]
        )
        assert before <= after < commit
    finally:
        pipe.cleanup()


@pytest.mark.parametrize("problem", ["nobody listens", "not kafka", "sasl vs plaintext"])
def test_kafka_problems_are_one_line_before_postgres_is_touched(
    stack: Stack, tmp_path: Path, problem: str
) -> None:
    pipe = Pipeline(stack, None, tmp_path)
    pg_port = stack.primary_dsn.split("port=")[1].split()[0]
    bootstrap, expected = {
        "nobody listens": (f"127.0.0.1:{free_ports(1)[0]}", "Connection refused"),
        "not kafka": (f"127.0.0.1:{pg_port}", "does not speak the Kafka protocol"),
        "sasl vs plaintext": (stack.kafka_bootstrap, "the listener does not use SASL"),
    }[problem]
    pipe.extra["SLOTBRIDGE_KAFKA_BOOTSTRAP"] = bootstrap
    if problem == "sasl vs plaintext":
        pipe.extra["SLOTBRIDGE_KAFKA_CONFIG"] = (
            '{"security.protocol": "SASL_PLAINTEXT", '
            '"sasl.mechanism": "PLAIN", "sasl.username": "u"}'
        )
        pipe.extra["SLOTBRIDGE_KAFKA_SASL_PASSWORD"] = "s3cret-kafka-pw"
    started = time.monotonic()
    code, output = pipe.run_to_exit(40)
    assert code != 0 and time.monotonic() - started < 30
    line = one_line_error(output)
    assert f"Kafka at {bootstrap}" in line and expected in line and "kafka_bootstrap" in line
    assert "s3cret-kafka-pw" not in output
    assert len(output.splitlines()) <= 3, output
    assert not sql(
        stack.primary_dsn, "SELECT 1 FROM pg_publication WHERE pubname = %s", (pipe.name,)
    )
    assert not sql(
        stack.primary_dsn,
        "SELECT 1 FROM pg_replication_origin WHERE roname = %s",
        (f"slotbridge_{pipe.name}",),
    )


def test_unparsable_kafka_config_is_one_line(stack: Stack, tmp_path: Path) -> None:
    pipe = Pipeline(stack, None, tmp_path)
    code, output = pipe.run_to_exit(30, SLOTBRIDGE_KAFKA_CONFIG="{bad json")
    assert code == 2
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if not line.startswith("--- run")]
    assert len(lines) == 1 and "SLOTBRIDGE_KAFKA_CONFIG" in lines[0], output


def _consume(tmp_path: Path, **env: str) -> tuple[int, str, float]:
    started = time.monotonic()
    code, output = run_cli(
        "consume",
        "--once",
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("SLOTBRIDGE_")},
            "SLOTBRIDGE_WAREHOUSE": str(tmp_path / "wh"),
            "SLOTBRIDGE_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
            **env,
        },
        timeout=120,
    )
    return code, output, time.monotonic() - started


def test_consume_bad_options_and_absent_kafka_are_one_line(stack: Stack, tmp_path: Path) -> None:
    code, output, _ = _consume(
        tmp_path, SLOTBRIDGE_KAFKA_BOOTSTRAP=stack.kafka_bootstrap, SLOTBRIDGE_KAFKA_OPTIONS="{nope"
    )
    assert code != 0 and "Traceback" not in output
    assert output.strip().count("\n") == 0 and "SLOTBRIDGE_KAFKA_OPTIONS" in output, output
    absent = f"127.0.0.1:{free_ports(1)[0]}"
    code, output, took = _consume(tmp_path, SLOTBRIDGE_KAFKA_BOOTSTRAP=absent)
    assert code != 0 and took < 30 and "Traceback" not in output
    assert output.strip().count("\n") == 0 and f"Kafka at {absent}" in output, output
    # Local mode without the jars' folder: refused before a JVM starts, in one line.
    code, output, _ = _consume(tmp_path, SLOTBRIDGE_KAFKA_BOOTSTRAP=stack.kafka_bootstrap)
    assert code != 0 and "Traceback" not in output
    assert output.strip().count("\n") == 0 and "jars_dir is not set" in output, output
