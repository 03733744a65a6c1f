"""Running the real bridge as a process against the stack, and reading what it wrote.

Each test gets its own slot, publication, topic prefix and progress topic (``Pipeline``),
so tests share the stack without seeing each other's records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, TopicPartition

from services.stack.stack import Stack

REPO = Path(__file__).resolve().parents[2]


def sql(dsn: str, statement: str, params: tuple[Any, ...] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(statement, params)  # type: ignore[arg-type]
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


@dataclass
class Record:
    topic: str
    key: Any
    value: Any
    partition: int
    offset: int


def read_topics(bootstrap: str, topics: list[str], timeout: float = 20.0) -> list[Record]:
    """Everything committed (read_committed) on the topics, in partition order.

    Kafka answers a transaction's commit before it has written the commit markers into
    the partitions, so for a moment a reader stops short of the newest committed records.
    A read that ended below a partition's high watermark is therefore read again.
    """
    deadline = time.monotonic() + timeout
    while True:
        records, behind = _read_once(bootstrap, topics, timeout)
        if not behind:
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{behind} still hold records past the last stable offset "
                                 f"after {timeout}s: a Kafka transaction is open")
        time.sleep(0.3)


def _read_once(bootstrap: str, topics: list[str],
               timeout: float) -> tuple[list[Record], list[tuple[str, int]]]:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"test-{uuid.uuid4()}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         "enable.partition.eof": True})
    try:
        meta = consumer.list_topics(timeout=timeout).topics
        parts = [TopicPartition(t, p, 0) for t in topics if t in meta
                 for p in meta[t].partitions]
        if not parts:
            return [], []
        consumer.assign(parts)
        pending = {(p.topic, p.partition) for p in parts}
        ends: dict[tuple[str, int], int] = {}
        out: list[Record] = []
        deadline = time.monotonic() + timeout
        while pending and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    pending.discard((msg.topic(), msg.partition()))
                    ends[(msg.topic(), msg.partition())] = msg.offset()
                    continue
                raise AssertionError(f"consumer error {msg.error()}")
            key = json.loads(msg.key()) if msg.key() else None
            value = json.loads(msg.value()) if msg.value() is not None else None
            out.append(Record(msg.topic(), key, value, msg.partition(), msg.offset()))
        if pending:
            raise AssertionError(f"did not reach the end of {sorted(pending)} in {timeout}s")
        behind = [tp for tp, end in ends.items()
                  if end < consumer.get_watermark_offsets(TopicPartition(*tp), timeout=10)[1]]
        return out, behind
    finally:
        consumer.close()


@dataclass
class Pipeline:
    """One bridge configuration: slot, publication, topics - unique per test."""

    stack: Stack
    tables: list[str] | None
    workdir: Path
    name: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:10]}")
    extra: dict[str, str] = field(default_factory=dict)
    # Another broker than the stack's (a test on another Kafka version); empty: the stack's.
    kafka_bootstrap: str = ""
    proc: subprocess.Popen[bytes] | None = None
    runs: int = 0

    def __post_init__(self) -> None:
        self.kafka_bootstrap = self.kafka_bootstrap or self.stack.kafka_bootstrap

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
        env.update({
            "SLOTBRIDGE_SOURCE_DSN": self.stack.primary_dsn,
            "SLOTBRIDGE_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            "SLOTBRIDGE_SLOT_NAME": self.name,
            "SLOTBRIDGE_PUBLICATION_NAME": self.name,
            "SLOTBRIDGE_TOPIC_PREFIX": self.prefix,
            "SLOTBRIDGE_PROGRESS_TOPIC": self.progress_topic,
            "SLOTBRIDGE_SPOOL_DIR": str(self.workdir / "spool"),
            "SLOTBRIDGE_HTTP_PORT": "0",
            "SLOTBRIDGE_LOG_FORMAT": "text",
            "SLOTBRIDGE_BATCH_MAX_MS": "100",
            "SLOTBRIDGE_STATUS_INTERVAL_S": "1",
        })
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
            [sys.executable, "-m", "services.cli", "run"], cwd=REPO,
            env={**self.env(), **extra_env}, stdout=log, stderr=subprocess.STDOUT)
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
                f"bridge did not exit within {timeout}s:\n{self.output()}") from None
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
        records = read_topics(self.kafka_bootstrap, [self.progress_topic], timeout=30)
        mine = [r.value for r in records if r.key == {"slot": self.name}]
        return max((v["end_lsn"] for v in mine if v), default=0)

    def wait_caught_up(self, timeout: float = 120) -> None:
        """Until Kafka's progress record covers everything the source has written now."""
        target = _lsn(sql(self.stack.primary_dsn, "SELECT pg_current_wal_insert_lsn()::text")[0][0])
        wait_for(lambda: self._confirmed() >= target, timeout,
                 f"slot {self.name} to confirm {target:X}\n{self.output()[-3000:]}")

    def _confirmed(self) -> int:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"bridge exited with {self.proc.returncode}:\n"
                                 f"{self.output()[-3000:]}")
        rows = sql(self.stack.primary_dsn, "SELECT confirmed_flush_lsn::text FROM "
                   "pg_replication_slots WHERE slot_name = %s", (self.name,))
        return _lsn(rows[0][0]) if rows and rows[0][0] else 0

    def changes(self, table: str) -> list[Record]:
        return [r for r in read_topics(self.kafka_bootstrap, [self.topic(table)])
                if r.value is not None]

    def cleanup(self) -> None:
        self.kill()
        dsn = self.stack.primary_dsn
        sql(dsn, "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                 "WHERE slot_name = %s AND NOT active", (self.name,))
        sql(dsn, f"DROP PUBLICATION IF EXISTS {self.name}")
        sql(dsn, "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin "
                 "WHERE roname = %s", (f"slotbridge_{self.name}",))


def _lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)
