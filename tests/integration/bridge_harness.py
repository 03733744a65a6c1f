"""Running the real bridge as a process against the stack, and reading what it wrote.

Each test gets its own slot, publication, topic prefix and progress topic (``Pipeline``),
so tests share the stack without seeing each other's records.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, TopicPartition

from services.bridge.progress.kafka_reader import read_kafka_progress
from services.common.kafka import END_READER_CONFIG
from slotbridge_dev.stack.kafka import Kafka
from slotbridge_dev.stack.kafka_audit import (
    AuditReport,
    audit,
    committing_producers,
    dump_segments,
    partition_dirs,
    read_records,
    transaction_at,
    transaction_outcomes,
)
from slotbridge_dev.stack.stack import Stack

REPO = Path(__file__).resolve().parents[2]


def sql(dsn: str, statement: str, params: tuple[Any, ...] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(statement, params)
        return cur.fetchall() if cur.description else []


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def wait_progressing(
    done: Callable[[], bool],
    progress: Callable[[], Any],
    stall_s: float,
    what: Callable[[], str],
) -> None:
    """Until ``done()``; fails only when ``progress()`` (a position that moves while the
    work goes on) stayed the same for ``stall_s``: work that grows with volume is never
    given a fixed deadline. ``what()`` names the wait when it fails (a bridge's log as it
    is then, not as it was when the wait began)."""
    last, moved = progress(), time.monotonic()
    while not done():
        now = progress()
        if now != last:
            last, moved = now, time.monotonic()
        elif time.monotonic() - moved > stall_s:
            raise AssertionError(f"no progress for {stall_s}s (at {last}) waiting for {what()}")
        time.sleep(0.5)


def one_line_error(output: str) -> str:
    """The only error line of a run (an ERROR log line, or a CLI's ``slotbridge: ...``
    refusal); fails on a traceback or a raw Kafka repr."""
    assert "Traceback" not in output and "KafkaError{" not in output, output
    errors = [
        line for line in output.splitlines() if " ERROR " in line or line.startswith("slotbridge: ")
    ]
    assert len(errors) == 1, output
    return errors[0]


def run_cli(*args: str, env: dict[str, str], timeout: float = 60) -> tuple[int, str]:
    """``slotbridge <args>`` of this checkout to its end: (exit code, stdout + stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout + proc.stderr


@dataclass
class Record:
    topic: str
    key: Any
    value: Any
    partition: int
    offset: int
    raw: bytes | None = None  # the value as written, for checks json.loads would blur


def read_topics(kafka: Kafka, topics: list[str], stall_s: float = 20.0) -> list[Record]:
    """Everything committed (read_committed) on the topics, in partition order.

    ``stall_s``: how long the read may go without a new record (or a new end of
    partition) before it fails; never a bound on the whole read, whose length grows with
    the topics.

    A read_committed reader stops at the last stable offset, below the high watermark
    while a Kafka transaction begins there that has no COMMIT/ABORT marker yet. A short
    read is read again while the brokers' logs say that transaction has ended since, or
    that the coordinator has decided to commit it (its markers are on their way, see
    committing_producers); one still open and undecided holds nothing committed, and a
    bridge's topics have one producer, so nothing committed lies behind it. A reader
    stopped anywhere else is missing a record, and the read fails.
    """
    seen: list[tuple[str, int, int]] = []
    stuck_since = time.monotonic()
    while True:
        records, behind = _read_once(kafka.bootstrap, topics, stall_s)
        if not behind:
            return records
        # The coordinator's decisions first, the partitions' logs after: the transaction
        # a reader stopped at began before both looks, and a producer begins its next one
        # only once the last has all its markers, so one still without its marker in the
        # second look was its producer's last in the first.
        deciding = committing_producers(kafka)
        found = {where: transaction_at(kafka, *where) for where in behind}
        unexplained = [where for where, txn in found.items() if txn is None]
        if unexplained:
            raise AssertionError(
                f"read_committed stopped below the high watermark at "
                f"{unexplained} where no transaction begins in the log"
            )
        committed = [
            where
            for where, txn in found.items()
            if txn is not None and (txn.ended or txn.producer_id in deciding)
        ]
        if not committed:
            return records
        if committed != seen:  # the transactions moved on: progress, however long the read
            seen, stuck_since = committed, time.monotonic()
        if time.monotonic() - stuck_since > stall_s:
            raise AssertionError(
                f"{committed}: Kafka transactions committed there still have no COMMIT "
                f"marker after {stall_s}s"
            )
        time.sleep(0.3)


def _read_once(
    bootstrap: str, topics: list[str], stall_s: float
) -> tuple[list[Record], list[tuple[str, int, int]]]:
    consumer = Consumer(
        {
            **END_READER_CONFIG,
            "bootstrap.servers": bootstrap,
            "group.id": f"test-{uuid.uuid4()}",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    try:
        meta = consumer.list_topics(timeout=stall_s).topics
        parts = [TopicPartition(t, p, 0) for t in topics if t in meta for p in meta[t].partitions]
        if not parts:
            return [], []
        consumer.assign(parts)
        pending = {(p.topic, p.partition) for p in parts}
        ends: dict[tuple[str, int], int] = {}
        out: list[Record] = []
        stalled_at = time.monotonic() + stall_s
        while pending and time.monotonic() < stalled_at:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            stalled_at = time.monotonic() + stall_s  # progress: the clock starts again
            topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
            assert topic is not None and partition is not None and offset is not None
            error = msg.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    pending.discard((topic, partition))
                    ends[(topic, partition)] = offset
                    continue
                raise AssertionError(f"consumer error {error}")
            raw_key, raw = msg.key(), msg.value()
            key = json.loads(raw_key) if raw_key else None
            value = json.loads(raw) if raw is not None else None
            out.append(Record(topic, key, value, partition, offset, raw))
        if pending:
            raise AssertionError(
                f"no record from {sorted(pending)} for {stall_s}s before their end"
            )
        highs = _high_watermarks(bootstrap, list(ends))
        return out, [(*tp, end) for tp, end in ends.items() if end < highs[tp]]
    finally:
        consumer.close()


def _high_watermarks(bootstrap: str, parts: list[tuple[str, int]]) -> dict[tuple[str, int], int]:
    """Each partition's high watermark, asked by a read_uncommitted client: a
    read_committed consumer is answered its last stable offset, where it stopped anyway."""
    consumer = Consumer(
        {
            **END_READER_CONFIG,
            "bootstrap.servers": bootstrap,
            "group.id": f"test-{uuid.uuid4()}",
            "isolation.level": "read_uncommitted",
        }
    )
    try:
        return {
            tp: consumer.get_watermark_offsets(TopicPartition(*tp), timeout=10)[1] for tp in parts
        }
    finally:
        consumer.close()


def metric(port: int, name: str) -> dict[str, float]:
    """A metric of the process serving /metrics on ``port``: its labels' text -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        labels: float(value)
        for labels, value in re.findall(rf"^{name}\{{([^}}]*)\}} (\S+)$", text, re.MULTILINE)
    }


def kafka_write_wait(port: int) -> float:
    """``slotbridge_kafka_write_wait_seconds`` of the bridge serving /metrics on ``port``."""
    (value,) = metric(port, "slotbridge_kafka_write_wait_seconds").values()
    return value


@dataclass
class Pipeline:
    """One bridge configuration: slot, publication, topics - unique per test."""

    stack: Stack
    tables: list[str] | None
    workdir: Path
    name: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}")
    extra: dict[str, str] = field(default_factory=dict)
    # Another broker than the stack's (a test on another Kafka version); None: the stack's.
    broker: Kafka | None = None
    proc: subprocess.Popen[bytes] | None = None
    runs: int = 0

    @property
    def kafka(self) -> Kafka:
        return self.broker or self.stack.kafka

    @property
    def prefix(self) -> str:
        return f"sb{self.name}"

    @property
    def progress_topic(self) -> str:
        return f"{self.prefix}.progress"

    def topic(self, table: str) -> str:
        return f"{self.prefix}.{table}"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"bridge-{self.name}.log"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLOTBRIDGE_")}
        env.update(
            {
                "SLOTBRIDGE_SOURCE_DSN": self.stack.primary_dsn,
                "SLOTBRIDGE_KAFKA_BOOTSTRAP": self.kafka.bootstrap,
                "SLOTBRIDGE_SLOT_NAME": self.name,
                "SLOTBRIDGE_PUBLICATION_NAME": self.name,
                "SLOTBRIDGE_TOPIC_PREFIX": self.prefix,
                "SLOTBRIDGE_PROGRESS_TOPIC": self.progress_topic,
                "SLOTBRIDGE_SPOOL_DIR": str(self.workdir / "spool"),
                "SLOTBRIDGE_HTTP_PORT": "0",
                "SLOTBRIDGE_LOG_FORMAT": "text",
                "SLOTBRIDGE_BATCH_MAX_MS": "100",
                "SLOTBRIDGE_STATUS_INTERVAL_S": "1",
            }
        )
        if self.tables is not None:
            env["SLOTBRIDGE_TABLES"] = json.dumps(self.tables)
        env.update(self.extra)
        return env

    def start(self, **extra_env: str) -> subprocess.Popen[bytes]:
        assert self.proc is None or self.proc.poll() is not None, "bridge already running"
        self.runs += 1
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        log.write(f"--- run {self.runs} {extra_env}\n".encode())
        log.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "run"],
            cwd=REPO,
            env={**self.env(), **extra_env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        return self.proc

    def run_to_exit(self, timeout: float = 60, **extra_env: str) -> tuple[int, str]:
        """Run the bridge expecting it to stop by itself; returns (exit code, its output)."""
        before = self.log_path.stat().st_size if self.log_path.exists() else 0
        proc = self.start(**extra_env)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(
                f"bridge did not exit within {timeout}s:\n{self.output()}"
            ) from None
        return code, self.log_path.read_bytes()[before:].decode(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def peak_rss_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmHWM")

    def wait_for_log(self, text: str, timeout: float) -> None:
        wait_for(lambda: text in self.output() or self._exited(), timeout, f"log line {text!r}")
        assert text in self.output(), self.output()[-3000:]

    def _exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def output(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def published_end_lsn(self) -> int:
        records = read_topics(self.kafka, [self.progress_topic], stall_s=30)
        mine = [r.value for r in records if r.key == {"slot": self.name}]
        return max((v["end_lsn"] for v in mine if v), default=0)

    def committed_end_lsn(self) -> int:
        """Like ``published_end_lsn``, but of every Kafka transaction committed, markers
        or not: what the bridge may confirm to PostgreSQL once its commit has returned,
        from the broker's own logs. A reader stops before a committed transaction until
        its markers are in, which can take as long as a follower is away (see
        committing_producers).

        For a bridge that cannot commit meanwhile (Kafka refuses its writes): the
        coordinator's decision is about the transaction open in the log only if the log
        did not move while the decisions were read, which fails the call otherwise.
        """
        [before] = dump_segments(partition_dirs(self.kafka.data_dir, [self.progress_topic]))
        deciding = committing_producers(self.kafka)
        [part] = dump_segments(partition_dirs(self.kafka.data_dir, [self.progress_topic]))
        assert part.batches == before.batches, "the bridge wrote its progress topic meanwhile"
        producers = {
            offset: b.producer_id
            for b in part.batches
            for offset in range(b.base_offset, b.last_offset + 1)
        }
        committed = {
            offset
            for offset, outcome in transaction_outcomes(part).items()
            if outcome == "committed" or (outcome == "open" and producers[offset] in deciding)
        }
        values = read_records(
            self.kafka.bootstrap,
            [part],
            lambda topic, partition, offset: offset in committed,
            lambda topic, value: value,
        )
        return max(
            (
                v["end_lsn"]
                for (_, _, offset), v in values.items()
                if offset in committed and v and v.get("slot") == self.name
            ),
            default=0,
        )

    def wait_caught_up(self, stall_s: float = 120) -> None:
        """Until the bridge has published everything the source has written now; fails when
        for ``stall_s`` the server decoded nothing more for the slot and neither its confirmed
        position nor the origin moved (a streamed transaction is confirmed only once whole).

        The slot's confirmed position alone says too little: snapshots are read in chunks
        while the slot streams. The bridge confirms only what Kafka holds, and advances its
        replication origin right after each Kafka commit, so: origin moved (unless no
        snapshot is taken), slot confirmed up to now, and Kafka's progress record lists no
        snapshot still under way.
        """
        target = _lsn(sql(self.stack.primary_dsn, "SELECT pg_current_wal_insert_lsn()::text")[0][0])
        snapshot = self.env().get("SLOTBRIDGE_SNAPSHOT_MODE", "initial") != "never"
        wait_progressing(
            lambda: (
                self._confirmed() >= target
                and (not snapshot or (self._origin() > 0 and not self._snapshots_under_way()))
            ),
            lambda: (self._confirmed(), self._origin(), self._decoded_bytes()),
            stall_s,
            lambda: (
                f"slot {self.name} to confirm {target:X} after its snapshots\n"
                f"{self.output()[-3000:]}"
            ),
        )

    def _decoded_bytes(self) -> int:
        rows = sql(
            self.stack.primary_dsn,
            "SELECT total_bytes FROM pg_stat_replication_slots WHERE slot_name = %s",
            (self.name,),
        )
        return int(rows[0][0]) if rows and rows[0][0] is not None else 0

    def _snapshots_under_way(self) -> bool:
        progress = read_kafka_progress(
            {"bootstrap.servers": self.kafka.bootstrap}, self.progress_topic, self.name
        )
        return progress is None or bool(progress.snapshots)

    def _origin(self) -> int:
        rows = sql(
            self.stack.primary_dsn,
            "SELECT pg_replication_origin_progress(roname, true)"
            "::text FROM pg_replication_origin WHERE roname = %s",
            (f"slotbridge_{self.name}",),
        )
        return _lsn(rows[0][0]) if rows and rows[0][0] else 0

    def _confirmed(self) -> int:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(
                f"bridge exited with {self.proc.returncode}:\n{self.output()[-3000:]}"
            )
        rows = sql(
            self.stack.primary_dsn,
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (self.name,),
        )
        return _lsn(rows[0][0]) if rows and rows[0][0] else 0

    def changes(self, table: str) -> list[Record]:
        """The table's change records (tombstones left out)."""
        return [r for r in read_topics(self.kafka, [self.topic(table)]) if r.value is not None]

    def audit(self) -> AuditReport:
        """The broker-log audit of everything this pipeline's bridges wrote; fails on any
        gap, loss, duplicate or open transaction. Call it with no bridge running."""
        begins = self.extra.get("SLOTBRIDGE_TRANSACTION_BEGIN_RECORDS", "true") != "false"
        ends = self.extra.get("SLOTBRIDGE_TRANSACTION_METADATA", "true") != "false"
        report = audit(
            self.kafka,
            self.prefix,
            [self.progress_topic],
            begin_records=begins and ends,
            end_records=ends,
        )
        print(f"\n{self.name} {report.summary()}")
        report.assert_clean()
        return report

    def cleanup(self) -> None:
        self.kill()
        dsn = self.stack.primary_dsn
        sql(
            dsn,
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s AND NOT active",
            (self.name,),
        )
        sql(dsn, f"DROP PUBLICATION IF EXISTS {self.name}")
        sql(
            dsn,
            "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin "
            "WHERE roname = %s",
            (f"slotbridge_{self.name}",),
        )


def own_table_pipeline(stack: Stack, workdir: Path, table: str, extra: dict[str, str]) -> Pipeline:
    """A pipeline, with the settings ``extra``, over ``table`` alone, made afresh as
    ``(id int PRIMARY KEY, tag text)``: a bridge configuration a test checks on its own
    table."""
    schema = table.split(".", 1)[0]
    sql(
        stack.primary_dsn,
        f"CREATE SCHEMA IF NOT EXISTS {schema}; DROP TABLE IF EXISTS {table};"
        f" CREATE TABLE {table} (id int PRIMARY KEY, tag text)",
    )
    return Pipeline(stack, [table], workdir, extra=dict(extra))


def _lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def unpublished_commits(dsn: str, slot: str, tables: list[str], published: int) -> list[str]:
    """Transactions that changed ``tables`` and that a restart of ``slot`` would skip though
    Kafka does not hold them: their commit record starts at or after ``published`` (the
    end of the last transaction Kafka's progress record covers) and before the slot's
    confirmed position. A line each (xid, commit start and end), from the WAL itself
    (pg_walinspect); empty when nothing is lost.

    PostgreSQL decodes a transaction again after a restart only if its commit record starts
    at or after the slot's confirmed position, so this, not ``confirmed <= published``, is
    the rule a bridge must keep: with nothing in flight it confirms a keepalive's WAL end
    (ARCHITECTURE.md, "Idle databases", as PostgreSQL's own subscriber does), and the
    walsender sends the end of the last record it decoded, which can lie inside a
    transaction still open then (its commit comes later and is decoded again) or after WAL
    holding no change of the tables. The scan starts at the slot's restart_lsn, before the
    first change of any transaction a restart decodes, and goes on to the end of the WAL
    (pg_walinspect lists only records that end within its range). The tables are found by
    their relfilenodes of now: a table truncated meanwhile is not followed.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
        slot_row = conn.execute(
            "SELECT restart_lsn::text, confirmed_flush_lsn::text FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (slot,),
        ).fetchone()
        assert slot_row is not None, f"no slot {slot}"
        restart, confirmed = slot_row
        # A block reference names a relation as tablespace/database/filenode.
        records = conn.execute(
            "WITH nodes AS (SELECT '%%/' || d.oid || '/' || pg_relation_filenode(t::regclass)"
            " || ' %%' AS node FROM pg_database d, unnest(%s::text[]) t"
            " WHERE d.datname = current_database()) "
            "SELECT start_lsn::text, end_lsn::text, xid::text::bigint, record_type, description,"
            " block_ref LIKE ANY (SELECT node FROM nodes) "
            "FROM pg_get_wal_records_info(%s::pg_lsn, pg_current_wal_insert_lsn()) "
            "WHERE record_type LIKE 'COMMIT%%' OR block_ref LIKE ANY (SELECT node FROM nodes) "
            "ORDER BY start_lsn",
            (tables, restart),
        ).fetchall()
    writers = {xid for _, _, xid, _, _, writes in records if writes}
    lost = []
    for start, end, xid, kind, description, _ in records:
        subxacts = re.search(r"subxacts: ([\d ]+)", description or "")
        xids = {xid, *(int(x) for x in subxacts[1].split())} if subxacts else {xid}
        skipped = published <= _lsn(start) < _lsn(confirmed)
        if kind.startswith("COMMIT") and xids & writers and skipped:
            lost.append(f"xid {xid} {kind} at {start} (ends {end})")
    return lost


class CounterWorkload(threading.Thread):
    """Small transactions against the primary until stopped, checkable exactly.

    Each transaction bumps one to three per-key counters by one and logs a unique row per
    bump, and inserts one row into each table of ``fresh`` (tables a test creates while the
    bridge runs). A read_committed consumer must then see each counter's values as
    0, 1, 2, ... (a gap is a loss, a repeat a duplicate, an inversion an order error), and
    every log and fresh-table id inserted once and snapshotted at most once.
    """

    def __init__(self, dsn: str, schema: str, keys: int = 8, seed: int = 7) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.schema = schema
        self.keys = keys
        self.seed = seed
        self.fresh: list[str] = []  # schema.table names; appended to while running
        self.stop_flag = threading.Event()
        self.committed = 0
        self.error: BaseException | None = None

    def create(self) -> list[str]:
        """(Re)create the schema's counters and log tables; returns their names."""
        s = self.schema
        sql(
            self.dsn,
            f"""
            DROP SCHEMA IF EXISTS {s} CASCADE; CREATE SCHEMA {s};
            CREATE TABLE {s}.counters (k int PRIMARY KEY, v int NOT NULL);
            CREATE TABLE {s}.log (id bigserial PRIMARY KEY, k int NOT NULL);""",
        )
        return [f"{s}.counters", f"{s}.log"]

    def seed_counters(self) -> None:
        sql(
            self.dsn,
            f"INSERT INTO {self.schema}.counters "
            f"SELECT g, 0 FROM generate_series(0, {self.keys - 1}) g",
        )

    def add_fresh_table(self, name: str, rows: int, publication: str) -> str:
        """Create ``schema.name`` (id bigserial, k int) with ``rows`` rows, have the workload
        write to it too, then add it to ``publication``: the bridge snapshots it while the
        workload already changes it, into topics created right then."""
        table = f"{self.schema}.{name}"
        sql(
            self.dsn,
            f"CREATE TABLE {table} (id bigserial PRIMARY KEY, k int NOT NULL);"
            f"INSERT INTO {table} (k) SELECT g % {self.keys} "
            f"FROM generate_series(1, {rows}) g",
        )
        self.fresh.append(table)
        sql(self.dsn, f"ALTER PUBLICATION {publication} ADD TABLE {table}")
        return table

    def run(self) -> None:
        rng = random.Random(self.seed)
        try:
            with psycopg.connect(self.dsn) as conn:
                while not self.stop_flag.is_set():
                    for _ in range(rng.randint(1, 3)):
                        k = rng.randrange(self.keys)
                        conn.execute(
                            f"UPDATE {self.schema}.counters SET v = v + 1 WHERE k = %s", (k,)
                        )
                        conn.execute(f"INSERT INTO {self.schema}.log (k) VALUES (%s)", (k,))
                    for table in list(self.fresh):
                        conn.execute(
                            f"INSERT INTO {table} (k) VALUES (%s)", (rng.randrange(self.keys),)
                        )
                    conn.commit()
                    self.committed += 1
                    time.sleep(0.005)
        except BaseException as exc:  # reported by finish()
            self.error = exc

    def start_under(self, pipe: Pipeline, transactions: int = 100) -> None:
        """Start ``pipe``'s bridge, then this workload once the bridge's snapshot is done;
        return when ``transactions`` are committed. Rows written before the snapshot read
        them may reach Kafka only as the stream's later changes (the snapshot leaves out
        keys changed meanwhile): the counters start at 0 in Kafka only if inserted after."""
        pipe.start()
        pipe.wait_caught_up(60)
        self.seed_counters()
        self.start()
        wait_for(lambda: self.committed >= transactions, 60, f"{transactions} transactions")

    def finish(self) -> None:
        self.stop_flag.set()
        self.join(30)
        assert self.error is None, self.error

    def settle(self, pipe: Pipeline) -> tuple[int, AuditReport]:
        """Stop writing, let ``pipe``'s bridge publish the rest and stop it cleanly; then the
        per-key check and the broker-log audit: (records checked, the audit)."""
        self.finish()
        pipe.wait_caught_up()
        assert pipe.stop() == 0
        return self.verify(pipe), pipe.audit()

    def verify(self, pipe: Pipeline) -> int:
        """Assert exactly-once and per-key order on every table; returns records checked."""
        dsn = pipe.stack.primary_dsn
        final = dict(sql(dsn, f"SELECT k, v FROM {self.schema}.counters"))
        seen: dict[int, list[int]] = {}
        counters = pipe.changes(f"{self.schema}.counters")
        for r in counters:
            seen.setdefault(r.value["after"]["k"], []).append(r.value["after"]["v"])
        for k, v in final.items():
            assert seen.get(k) == list(range(v + 1)), _counter_mismatch(k, seen.get(k, []), v)
        checked = len(counters)
        for table in [f"{self.schema}.log", *self.fresh]:
            source = [r[0] for r in sql(dsn, f"SELECT id FROM {table} ORDER BY id")]
            records = pipe.changes(table)
            # Each id inserted once and snapshotted at most once. Both may come: a chunk
            # read after a restart can hold a row the stream inserted before it
            # (services/bridge/snapshot/chunks.py), never a stale one.
            for op in ("c", "r"):
                ids = [r.value["after"]["id"] for r in records if r.value["op"] == op]
                assert len(ids) == len(set(ids)), f"rows of {table} published twice as {op!r}"
            assert sorted({r.value["after"]["id"] for r in records}) == source, (
                f"rows of {table} missing from Kafka"
            )
            checked += len(records)
        return checked


def _counter_mismatch(key: int, seen: list[int], final: int) -> str:
    """What a counter's records got wrong against 0..final: values missing, values
    published more than once, and the first place the order breaks."""
    expected = list(range(final + 1))
    counts: dict[int, int] = {}
    for value in seen:
        counts[value] = counts.get(value, 0) + 1
    missing = [v for v in expected if v not in counts]
    twice = sorted(v for v, n in counts.items() if n > 1)
    # Where the records first differ; a list that only ends early or late differs where
    # the shorter one ends.
    first = next(
        (i for i, (a, b) in enumerate(zip(seen, expected, strict=False)) if a != b),
        min(len(seen), len(expected)),
    )
    around = seen[max(0, first - 3) : first + 5]
    return (
        f"key {key} (source v={final}, {len(seen)} records): missing {missing[:20]}, "
        f"published more than once {twice[:20]}, order breaks at index {first}: {around}"
    )
