"""End-to-end bridge throughput per change kind, next to the decode ceiling, on the local stack.

    python bench/bridge_bench.py [--workload insert|update|update-full|delete|wide|oltp|all]
                                 [--format slotbridge|debezium|debezium-lean|both|all]
                                 [--rows 1000000]
                                 [--txn-size 1000] [--shapes both] [--repeat 1]
                                 [--stack-dir .stack/bench] [--keep-stack] [--json]

For each workload (``bench/workloads.py``: the change kinds, a wide row with jsonb and
TOAST, pgbench's OLTP mix), shape (``--txn-size``-row transactions, and one transaction of
every change) and repeat, on a fresh schema, publication and fresh failover slots (one for
the ceiling, one per record format):

1. load: the workload's rows are written before the slots exist (the rows updates and
   deletes need), its changes while they exist, so the WAL is there before anything reads
   it (the load time is printed, never part of a rate);
2. ceiling: a bare ``ReplicationConnection`` reads the first slot with the bridge's own
   START_REPLICATION options (pgoutput 4, streaming parallel, two_phase, messages) and only
   counts XLogData messages - it looks at the type byte of a message only to spot the
   final Commit / Stream Commit - until the last transaction's commit: the raw receive rate
   with no parsing, the most any consumer of this slot could do on this machine. It lets
   the data gather in the socket before it reads (``SO_RCVLOWAT`` of ``CEILING_LOWAT``
   bytes, or 2 ms): a walsender whose reader takes each message at once writes one message
   per send() call, which doubles its CPU per row and halves its rate (1M rows: ~300k rows/s
   read eagerly, 650-700k gathered, on this machine). Sessions before 2026-11-23 read it
   eagerly, so their ratios are about twice what this ceiling gives. For 1000-row
   transactions it is not a ceiling (2026-11-23): the bridge outruns it (e2e/ceiling above
   1), and the walsender spends about twice the CPU per row for this reader (5.1-5.5 us) as
   for the bridge (2.6-2.8 us), whose slower reads leave its socket full so the walsender
   sends in bulk. Neither other SO_RCVBUF / SO_RCVLOWAT sizes, nor pausing between reads,
   nor pg_recvlogical did better on that shape; read its ratio as "faster than a bare
   reader";
3. end to end: the real daemon (``slotbridge run`` subprocess, own slot, topic prefix and
   progress topic) catches up on the second slot. Its topics exist before it starts, as a
   bridge that has been running has long made them (creating four topics and waiting for
   their leaders took a second or more of a 100k-change run); the clock runs from its
   "streaming" log line to the moment a read_committed consumer of the progress topic sees
   a progress record whose ``end_lsn`` reaches the last commit's end. The figure from process start
   (connections, Kafka init_transactions) is printed too. Peak RSS is the daemon's VmHWM
   just before it is stopped; its CPU seconds over the same span (utime + stime) are in the
   ``--json`` output. With ``--verify`` (default) the change topics are read back
   with read_committed and must hold exactly the records the workload's changes make in
   that format (a delete: a record and a tombstone, or the record alone with
   ``--no-tombstones``), and their mean size (key and value
   bytes) is printed; the transaction topic is counted too. With ``--format both`` the
   Debezium-format daemon then catches up on its own slot of the same WAL (``all``: also
   the Debezium format without Connect schemas and context headers, ``debezium-lean``),
   and the rate of each
   format is printed as a share of the default format's.

4. CPU budget: the CPU microseconds per change of the daemon, of the walsender decoding
   for it and of the stack's broker over the same span; the rate at which the three would
   fill every core of this machine, and what is left per change for the daemon at 0.8 of
   the ceiling beside the other two. Per source transaction: the daemon's CPU and the
   records it wrote (change records plus the transaction topic's), the source transactions
   one Kafka transaction carried (``txn/ktx``) and the share of the span the publisher spent
   in Kafka commits (``commit``), read from the daemon's /metrics. The daemon's CPU
   includes its topic id probe (a child process asked before every Kafka commit) and, as
   ``rdk us``, what librdkafka's own threads spent (batching, compressing, sending): the
   daemon's Python threads share one core, so 1e6 / (bridge us - rdk us) bounds it alone.

Warm-up: the broker is a JVM, and a freshly started one spends far more CPU per record
until its JIT has compiled its paths. On a stack started just before (2026-11-29,
``--workload insert,update --rows 100000``), the first ``insert`` run cost the broker 10.7
us a change, and its e2e/ceiling was 0.47 against 1.04 and 0.96 in the next two; the
broker's us a change went 10.7, 4.3, 3.0 over the first three ``insert`` runs and stayed
at 1.7-3.4 over the eight runs of both workloads after them. So the first workload's
figures, and every ratio to them, were the broker's warm-up. Before the measured runs the
bench now runs ``--warm-up`` untimed passes (3 by default, 0 for none) of ``insert`` in
``--txn-size`` transactions, ``WARM_UP_ROWS`` rows each, in the default format, and drops
their figures: the two measured ``insert`` runs then cost the broker 4.3 and 5.2 us after
two passes, 3.8 and 2.2 after five (one fresh stack each). The broker's figure moves with
the machine too (0.85 us an ``insert`` in a run at 05:58 the same day): compare runs made
side by side.

The stack is stopped at the end if this bench started it, unless ``--keep-stack``.

The server's ``logical_decoding_work_mem`` is left as configured (64MB by default), so the
big transaction is streamed in chunks the way production would see it.

Figures, not assertions: the machine is shared, so run it a few times and take medians.
With ``--repeat`` above 1 the table's ``spread`` is how far the ceiling moved between the
runs (max - min, as a share of its median): the bare reader's rate moves with the machine
more than the daemon's, and an ``oltp`` ceiling has moved 2x between runs of the same code,
so read the daemon's CPU per change before the ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

# NewTopic's public home (the stubs do not declare the re-export).
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench.workloads import OLTP_CHANGES_PER_TXN, OLTP_CLIENTS, WORKLOADS, Plan, Workload
from services.bridge.receive.stream import ReplicationConnection
from services.bridge.settings import BridgeSettings
from services.bridge.sink.topics import RECORD_SLACK
from services.contract.topics import schema_topic, transaction_topic
from slotbridge_dev.stack.stack import Stack

ROOT = Path(__file__).resolve().parents[1]
START_OPTIONS = {
    "proto_version": "4",
    "streaming": "parallel",
    "messages": "true",
    "two_phase": "on",
}
# What the ceiling reader lets gather in the socket before it reads (see step 2 above).
CEILING_LOWAT = 128 * 1024
_COMMIT = ord("C")
_STREAM_COMMIT = ord("c")


def say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _rss_kb(pid: int, field: str = "VmHWM") -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of every thread of ``pid`` so far (0 once it is gone)."""
    try:
        # After the command name, which may itself hold ") ": utime and stime are fields
        # 14 and 15 of proc(5), the 12th and 13th after it.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_children_cpu_seconds(pid: int) -> float:
    """``cpu_seconds`` of ``pid`` and of its running child processes: the daemon's topic id
    probe is one (``sink/topic_id_probe.py``), asked before every Kafka commit."""
    children: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            children += [int(c) for c in (task / "children").read_text().split()]
    except OSError:
        pass
    return cpu_seconds(pid) + sum(cpu_seconds(child) for child in children)


def librdkafka_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of ``pid``'s librdkafka threads so far (named ``rdk:``
    by librdkafka: its main and broker threads, where records are batched, compressed and
    sent): the daemon's CPU outside Python."""
    total = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        try:
            if not (task / "comm").read_text().startswith("rdk:"):
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended meanwhile
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def broker_pid(stack_dir: Path) -> int | None:
    """The local stack's Kafka broker process (its command line names the stack folder)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "kafka.Kafka" in cmdline and str(stack_dir.resolve()) in cmdline:
            return int(entry.name)
    return None


def walsender_pid(dsn: str, slot: str) -> int | None:
    """The server process streaming ``slot`` now, if any."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    return None if row is None else row[0]


class LogMark(threading.Thread):
    """Watches a process's log for the first line holding ``marker`` (the process streams):
    ``at`` is then the monotonic time it appeared and ``cpu_s`` the process's CPU seconds by
    then (``librdkafka_cpu_s``: its librdkafka threads'; ``others_cpu_s``: that of each of
    ``others``). Gives up when ``running()`` turns false."""

    def __init__(
        self,
        log_path: Path,
        marker: str,
        pid: int,
        running: Callable[[], bool],
        others: Sequence[int] = (),
    ) -> None:
        super().__init__(daemon=True)
        self.log_path = log_path
        self.marker = marker
        self.pid = pid
        self.running = running
        self.others = others
        self.at: float | None = None
        self.cpu_s = self.librdkafka_cpu_s = 0.0
        self.others_cpu_s = [cpu_seconds(other) for other in others]

    def run(self) -> None:
        line = ""
        with self.log_path.open() as reader:
            while self.running() and self.at is None:
                chunk = reader.readline()
                if not chunk:
                    time.sleep(0.005)
                    continue
                # A line still being written comes in pieces: judge it whole.
                line += chunk
                if not line.endswith("\n"):
                    continue
                if self.marker in line:
                    self.cpu_s = with_children_cpu_seconds(self.pid)
                    self.librdkafka_cpu_s = librdkafka_cpu_seconds(self.pid)
                    self.others_cpu_s = [cpu_seconds(other) for other in self.others]
                    self.at = time.monotonic()
                line = ""


def catch_up(
    pid: int,
    spawned: float,
    mark: LogMark,
    reached: Callable[[], tuple[bool, int]],
    alive: Callable[[], None],
    changes: int,
    what: str,
    stall_s: float = 300,
) -> dict[str, Any]:
    """Times a CDC process (``pid``, spawned at monotonic ``spawned``) through a backlog of
    ``changes`` row changes: from ``mark`` (from the spawn if it never showed) until
    ``reached()`` - a probe that may block briefly, the loop's pace - says the last is
    readable by a read_committed consumer; it also says how far the process got (a number
    that grows while it works: a published LSN, records in its topics). ``alive()`` raises
    if the process failed; it runs once a second, as it may cost the process something.
    A process whose progress stands still for ``stall_s`` failed, however long the backlog
    takes. CPU seconds are the process's over the same span; peak RSS is its VmHWM, so it
    includes its start."""
    peak_kb = 0
    checked = reported = moved = spawned
    furthest = -1
    while True:
        caught_up, progress = reached()
        if caught_up:
            break
        now = time.monotonic()
        if progress > furthest:
            furthest, moved = progress, now
        peak_kb = max(peak_kb, _rss_kb(pid))
        if now - checked >= 1:
            alive()
            checked = now
        if now - reported >= 10:
            say(f"{what}: catching up, {now - spawned:.0f}s since its start")
            reported = now
        if now - moved > stall_s:
            raise TimeoutError(
                f"{what} made no progress for {stall_s:.0f} s (at {furthest}); see {mark.log_path}"
            )
    done = time.monotonic()
    cpu, librdkafka_cpu = with_children_cpu_seconds(pid), librdkafka_cpu_seconds(pid)
    peak_kb = max(peak_kb, _rss_kb(pid))
    began, cpu_began = (spawned, 0.0) if mark.at is None else (mark.at, mark.cpu_s)
    librdkafka_began = 0.0 if mark.at is None else mark.librdkafka_cpu_s
    return {
        "seconds": done - began,
        "seconds_from_spawn": done - spawned,
        "changes_per_s": changes / (done - began),
        "changes_per_s_from_spawn": changes / (done - spawned),
        "peak_rss_mb": peak_kb / 1024,
        "cpu_s": cpu - cpu_began,
        "cpu_s_from_spawn": cpu,
        "librdkafka_cpu_s": librdkafka_cpu - librdkafka_began,
        "cpu_s_per_1m_changes": (cpu - cpu_began) / changes * 1e6,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def metrics_text(http_port: int) -> str:
    """A daemon's /metrics, as Prometheus reads it."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as reply:
        return str(reply.read().decode())


def kafka_transactions(http_port: int) -> dict[str, float]:
    """The Kafka transactions a daemon committed and the seconds their commits took, from
    its ``slotbridge_kafka_transaction_seconds`` histogram."""
    found = {}
    for line in metrics_text(http_port).splitlines():
        name, _, number = line.partition(" ")
        if name.startswith("slotbridge_kafka_transaction_seconds_count"):
            found["kafka_txns"] = float(number)
        elif name.startswith("slotbridge_kafka_transaction_seconds_sum"):
            found["kafka_commit_s"] = float(number)
    return found


def stop_process(proc: subprocess.Popen[Any], pid: int | None = None) -> None:
    """SIGTERM (to ``pid`` when the process to stop is a child of ``proc``, as under py-spy),
    then up to 60 s for ``proc`` to exit before it is killed."""
    if proc.poll() is None:
        os.kill(proc.pid if pid is None else pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def daemon_env(
    dsn: str,
    bootstrap: str,
    slot: str,
    publication: str,
    tables: Sequence[str],
    prefix: str,
    spool_dir: Path,
    record_format: str = "slotbridge",
) -> dict[str, str]:
    """The environment of a daemon streaming ``tables`` (qualified names) from its own slot,
    with its own topic prefix and progress topic (``<prefix>.progress``), and no snapshot,
    writing ``record_format`` (a name of ``RECORD_FORMATS``)."""
    chosen = RECORD_FORMATS[record_format]
    return {
        **os.environ,
        "SLOTBRIDGE_SOURCE_DSN": dsn,
        "SLOTBRIDGE_KAFKA_BOOTSTRAP": bootstrap,
        "SLOTBRIDGE_SLOT_NAME": slot,
        "SLOTBRIDGE_PUBLICATION_NAME": publication,
        "SLOTBRIDGE_TABLES": json.dumps(list(tables)),
        "SLOTBRIDGE_TOPIC_PREFIX": prefix,
        "SLOTBRIDGE_PROGRESS_TOPIC": f"{prefix}.progress",
        "SLOTBRIDGE_VALUE_FORMAT": chosen.value_format,
        **(
            {"SLOTBRIDGE_DEBEZIUM_SCHEMAS": "false", "SLOTBRIDGE_DEBEZIUM_CONTEXT_HEADERS": "false"}
            if chosen.lean
            else {}
        ),
        "SLOTBRIDGE_SNAPSHOT_MODE": "never",
        "SLOTBRIDGE_SPOOL_DIR": str(spool_dir),
        "SLOTBRIDGE_HTTP_PORT": "0",
        "SLOTBRIDGE_LOG_FORMAT": "text",
    }


def drop_pipeline(
    dsn: str,
    bootstrap: str,
    slots: Sequence[str],
    daemon_slots: Sequence[str],
    publication: str,
    drop: str,
    prefix: str,
) -> None:
    """Drop the slots (once their readers let go), the daemons' origins, the publication,
    what ``drop`` names (``TABLE x``, ``SCHEMA s CASCADE``) and every topic under
    ``prefix``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for slot in slots:
            for _ in range(50):
                try:
                    conn.execute(
                        "SELECT pg_drop_replication_slot(%s) FROM"
                        " pg_replication_slots WHERE slot_name = %s",
                        (slot, slot),
                    )
                    break
                except psycopg.errors.ObjectInUse:
                    time.sleep(0.2)
        conn.execute(
            "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin"
            " WHERE roname = ANY(%s)",
            ([f"slotbridge_{slot}" for slot in daemon_slots],),
        )
        conn.execute(f"DROP PUBLICATION IF EXISTS {publication}")
        conn.execute(f"DROP {drop}")
    delete_topics(bootstrap, prefix)


def delete_topics(bootstrap: str, prefix: str) -> None:
    """Delete every topic under ``prefix``: a run's records would otherwise stay on the
    bench stack's disk (gigabytes after a few 10M-row runs)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    topics = [t for t in admin.list_topics(timeout=30).topics if t.startswith(prefix + ".")]
    if topics:
        for future in admin.delete_topics(topics, operation_timeout=30).values():
            try:
                future.result()
            except Exception as exc:
                say(f"could not delete a topic: {exc}")


def new_tag(workload: str, big: bool, index: int) -> str:
    kind = workload.replace("-", "")
    return f"{kind}_{'big' if big else 'txn'}{int(time.time()) % 1_000_000}_{index}"


class Run:
    """One workload, one shape, one repeat: its own schema, publication, slots and topics,
    and a daemon slot per record format in ``formats``, all over the same WAL.
    ``other_slots`` are created with the others, before the load, for other readers of the
    same WAL (plain pgoutput slots: failover, no two_phase); ``other_prefixes`` name their
    change topics (``<prefix>.<other prefix>.<table>``, see ``other_prefix``), made with the
    daemons' before the load."""

    def __init__(
        self,
        dsn: str,
        bootstrap: str,
        workload: Workload,
        rows: int,
        txn_size: int,
        tag: str,
        spool_dir: Path,
        verify: bool,
        formats: Sequence[str] = ("slotbridge",),
        py_spy: Path | None = None,
        other_slots: Sequence[str] = (),
        begin_records: bool = True,
        other_prefixes: Sequence[str] = (),
        tombstones: bool = True,
        transaction_metadata: bool = True,
    ) -> None:
        self.dsn, self.bootstrap = dsn, bootstrap
        # The daemons' transaction_begin_records, tombstones_on_delete and
        # transaction_metadata.
        self.begin_records = begin_records
        self.tombstones = tombstones
        self.transaction_metadata = transaction_metadata
        self.workload = workload
        self.rows, self.txn_size = rows, txn_size
        self.tag = tag
        self.schema = f"bench_{tag}"
        self.tables = [f"{self.schema}.{t}" for t in workload.tables]
        self.publication = f"pub_{tag}"
        self.ceiling_slot = f"ceil_{tag}"
        self.bridge_slots = {f: f"{_short(f)}_{tag}" for f in formats}
        self.prefix = f"bench.{tag}"
        self.spool_dir = spool_dir
        self.verify = verify
        self.py_spy = py_spy
        self.other_slots = list(other_slots)
        self.other_prefixes = list(other_prefixes)
        # The stack's broker, when its CPU seconds are to be measured too.
        self.broker_pid: int | None = None
        # What the load put in the WAL (``load`` sets it).
        self.plan = Plan(0, 0)

    @property
    def shape(self) -> str:
        if self.workload.name == "oltp":
            return f"pgbench, {OLTP_CLIENTS} clients"
        return f"{self.txn_size}-row txns" if self.txn_size < self.rows else "one big txn"

    def facts(self, load_s: float, ceiling: dict[str, Any]) -> dict[str, Any]:
        """What this run was, for a result: workload, shape, sizes, load time and ceiling."""
        return {
            "workload": self.workload.name,
            "shape": self.shape,
            "txn_size": self.txn_size,
            "changes": self.plan.changes,
            "transactions": self.plan.transactions,
            "load_s": load_s,
            "ceiling": ceiling,
        }

    def other_prefix(self, name: str) -> str:
        """The topic prefix of another reader (one of ``other_prefixes``)."""
        return f"{self.prefix}.{name}"

    def format_prefix(self, variant: str) -> str:
        return f"{self.prefix}.{_short(variant)}"

    @contextlib.contextmanager
    def prepared(self, keep: bool) -> Iterator[tuple[float, dict[str, Any]]]:
        """Set up, load and read the ceiling; yields the load's seconds and the ceiling, for
        the catch-ups to measure; drops everything afterwards unless ``keep``."""
        say(f"{self.tag}: {self.workload.name}, {self.rows:,} rows, {self.shape}")
        try:
            self.setup()
            load_s = self.load()
            self.settle()
            say(
                f"{self.tag}: {self.plan.changes:,} changes in {self.plan.transactions:,}"
                f" transaction(s) loaded in {load_s:.1f}s, vacuumed, checkpointed;"
                " reading the ceiling slot"
            )
            yield load_s, self.ceiling()
        finally:
            if not keep:
                self.cleanup()

    # -- setup -------------------------------------------------------------------------

    def setup(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {self.schema}")
            self.workload.create(conn, self.schema)
        self.workload.prefill(self.dsn, self.schema, self.rows)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                f"CREATE PUBLICATION {self.publication} FOR TABLE {', '.join(self.tables)}"
            )
            for slot in self.bridge_slots.values():
                # The mark the daemon leaves before creating a slot: without it, it refuses
                # a slot it did not create.
                conn.execute("SELECT pg_replication_origin_create(%s)", (f"slotbridge_{slot}",))
            for slot in (self.ceiling_slot, *self.bridge_slots.values()):
                # failover + two_phase, as the daemon creates its own.
                conn.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, true, true)",
                    (slot,),
                )
            for slot in self.other_slots:
                conn.execute(
                    "SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, false, true)",
                    (slot,),
                )
        # Every topic a daemon writes, made now as a running bridge has long made them: the
        # timed catch-up measures publishing, not creating topics. Likewise the other
        # readers' change topics (a consumer probing a topic before it exists may not see
        # it for minutes: librdkafka refreshes the metadata of topics it does not hold).
        limit = {
            "max.message.bytes": str(
                BridgeSettings.model_fields["max_row_bytes"].default + RECORD_SLACK
            )
        }
        compact = {**limit, "cleanup.policy": "compact"}
        topics = []
        for value_format in self.bridge_slots:
            prefix = self.format_prefix(value_format)
            topics += [
                NewTopic(f"{prefix}.progress", 1, replication_factor=-1, config=compact),
                NewTopic(schema_topic(prefix), 1, replication_factor=-1, config=compact),
                NewTopic(transaction_topic(prefix), 1, replication_factor=-1, config=limit),
            ]
            topics += [
                NewTopic(f"{prefix}.{table}", 1, replication_factor=-1, config=limit)
                for table in self.tables
            ]
        topics += [
            NewTopic(f"{self.other_prefix(name)}.{table}", 1, replication_factor=-1, config=limit)
            for name in self.other_prefixes
            for table in self.tables
        ]
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics(topics, operation_timeout=30).values():
            future.result()

    def load(self) -> float:
        """The workload's load step; returns the seconds it took (not part of any rate)."""
        started = time.monotonic()
        self.plan = self.workload.load(self.dsn, self.schema, self.rows, self.txn_size)
        return time.monotonic() - started

    def settle(self) -> None:
        """Vacuum the loaded tables and checkpoint before anything reads the slots. Left to
        autovacuum (its naptime is a minute) and the checkpointer (every 5 minutes or 1 GB
        of WAL), that work ran at any moment of the reads, taking CPU on 2 cores from the
        ceiling's reader or from a daemon's catch-up: on 2026-11-29 `pg_stat_user_tables`
        put autovacuums of the loaded tables inside both, at random. The readers stop at
        the load's last commit, so they never read the WAL this writes. (It did not narrow
        the ceiling's spread in three runs each: the daemon's own CPU per change moved
        by a third between runs of the same code, so the machine's speed moves too.)"""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for table in self.tables:
                conn.execute(f"VACUUM (ANALYZE) {table}")
            conn.execute("CHECKPOINT")

    # -- the ceiling -------------------------------------------------------------------

    def ceiling(self) -> dict[str, Any]:
        repl = ReplicationConnection(self.dsn)
        try:
            gather = socket.socket(fileno=repl.conn.socket)  # to set an option; not ours
            gather.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, CEILING_LOWAT)
            gather.detach()
            options = {**START_OPTIONS, "publication_names": f'"{self.publication}"'}
            repl.start(self.ceiling_slot, 0, options)
            conn = repl.conn
            started = time.monotonic()
            count = commits = nbytes = received = 0
            end_lsn = 0
            deadline = started + 600
            while commits < self.plan.transactions:
                nread, data = conn.get_copy_data(1)
                if nread == 0:
                    if time.monotonic() > deadline:
                        raise TimeoutError("ceiling reader: no final commit within 600 s")
                    select.select([conn.socket], [], [], 0.002)
                    conn.consume_input()  # on the timeout too: the stream's tail is short
                    continue
                if nread < 0:
                    raise RuntimeError("ceiling reader: the stream ended")
                raw = memoryview(data)
                if raw[0] == 0x77:  # XLogData: the header, then the pgoutput message
                    count += 1
                    nbytes += nread - 25
                    received = int.from_bytes(raw[9:17], "big")
                    first = raw[25]
                    if first == _COMMIT:
                        commits += 1
                        end_lsn = int.from_bytes(raw[35:43], "big")
                    elif first == _STREAM_COMMIT:
                        commits += 1
                        end_lsn = int.from_bytes(raw[39:47], "big")
                elif raw[0] == 0x6B and raw[17]:  # a keepalive that asks for a reply
                    repl.send_status(max(received, int.from_bytes(raw[1:9], "big")), 0)
            seconds = time.monotonic() - started
            sender = walsender_pid(self.dsn, self.ceiling_slot)
            sender_cpu_s = None if sender is None else cpu_seconds(sender)
        finally:
            repl.close()
        return {
            "seconds": seconds,
            "walsender_cpu_s": sender_cpu_s,
            "messages": count,
            "payload_bytes": nbytes,
            "changes_per_s": self.plan.changes / seconds,
            "msgs_per_s": count / seconds,
            "mb_per_s": nbytes / seconds / 1e6,
            "end_lsn": end_lsn,
        }

    # -- end to end --------------------------------------------------------------------

    def e2e(self, variant: str, end_lsn: int, log_path: Path) -> dict[str, Any]:
        """The daemon of ``variant`` (see ``variant_of``) through the backlog on its own
        slot."""
        slot, prefix = self.bridge_slots[variant], self.format_prefix(variant)
        record_format, hashed = variant_of(variant)
        env = daemon_env(
            self.dsn,
            self.bootstrap,
            slot,
            self.publication,
            self.tables,
            prefix,
            self.spool_dir,
            record_format,
        )
        env["SLOTBRIDGE_TRANSACTION_BEGIN_RECORDS"] = str(self.begin_records).lower()
        env["SLOTBRIDGE_TOMBSTONES_ON_DELETE"] = str(self.tombstones).lower()
        env["SLOTBRIDGE_TRANSACTION_METADATA"] = str(self.transaction_metadata).lower()
        if hashed:
            env["SLOTBRIDGE_TRANSFORMS"] = json.dumps(
                [
                    {
                        "tables": self.tables,
                        "columns": [f"s{i}" for i in range(hashed)],
                        "transform": "hash",
                    }
                ]
            )
            env["SLOTBRIDGE_MASKING_KEY"] = "bench masking key, 32 bytes long"
        # Its /metrics, read when it has caught up: how many Kafka transactions the backlog
        # took, and how long their commits held the publisher.
        http_port = free_port()
        env["SLOTBRIDGE_HTTP_PORT"] = str(http_port)
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"bench-{self.tag}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 10,
            }
        )
        consumer.assign([TopicPartition(f"{prefix}.progress", 0, OFFSET_BEGINNING)])
        spawned = time.monotonic()
        # This checkout's code: the venv's console script may belong to another worktree.
        command = [sys.executable, "-m", "services.cli", "run"]
        if self.py_spy is not None:
            # The daemon as py-spy's child (ptrace needs it); RSS is read from that child.
            command = [
                str(ROOT / ".venv/bin/py-spy"),
                "record",
                "--nonblocking",
                "--threads",
                "--rate",
                "250",
                "--format",
                "raw",
                "-o",
                str(self.py_spy / f"{self.tag}-{variant}.txt"),
                "--",
                *command,
            ]
        with log_path.open("w") as log_file:
            proc = subprocess.Popen(
                command, env=env, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT
            )
        bridge_pid = proc.pid
        while self.py_spy is not None and bridge_pid == proc.pid and proc.poll() is None:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
            bridge_pid = int(children[0]) if children else proc.pid
            time.sleep(0.01)
        broker = () if self.broker_pid is None else (self.broker_pid,)
        mark = LogMark(log_path, "streaming", bridge_pid, lambda: proc.poll() is None, broker)
        mark.start()
        published = 0

        def reached() -> tuple[bool, int]:
            nonlocal published
            msg = consumer.poll(0.02)
            value = None if msg is None or msg.error() is not None else msg.value()
            if value is not None:
                published = max(published, int(json.loads(value)["end_lsn"]))
            return published >= end_lsn, published

        def alive() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"bridge exited with {proc.returncode}; see {log_path}")

        what = f"{self.tag}: bridge ({variant})"
        try:
            result = catch_up(bridge_pid, spawned, mark, reached, alive, self.plan.changes, what)
            result.update(kafka_transactions(http_port))
            # The other processes on this machine's cores, over the same span (the
            # walsender's from its start: all of it is this backlog's decoding).
            sender = walsender_pid(self.dsn, slot)
            if sender is not None:
                result["walsender_cpu_s"] = cpu_seconds(sender)
            if broker:
                result["broker_cpu_s"] = cpu_seconds(broker[0]) - mark.others_cpu_s[0]
        finally:
            consumer.close()
            stop_process(proc, bridge_pid)
            mark.join(1)
        if self.verify:
            self.check_records(variant, result)
        return result

    def check_records(self, variant: str, result: dict[str, Any]) -> None:
        """Read the change and transaction topics back: the change records must be exactly
        what the workload's changes make; ``result`` gets the counts and the change
        records' mean size (key and value bytes: what the format costs the producer and
        the broker)."""
        prefix = self.format_prefix(variant)
        counted = [self.count(f"{prefix}.{table}") for table in self.tables]
        changes = sum(records for records, _ in counted)
        result["change_records"] = changes
        result["record_bytes"] = sum(size for _, size in counted) / max(changes, 1)
        result["transaction_records"] = self.count(f"{prefix}.transaction")[0]
        value_format = RECORD_FORMATS[variant_of(variant)[0]].value_format
        expected = self.workload.expected_records(value_format, self.plan, self.tombstones)
        if changes != expected:
            raise RuntimeError(
                f"{self.tag} ({variant}): the change topics hold {changes} records,"
                f" expected {expected}"
            )

    def count(self, topic: str) -> tuple[int, int]:
        """The records of ``topic`` (one partition) a read_committed consumer reads, up to
        its end offset (the consumer's position passes the transaction markers, which a
        count of records never reaches), and their keys' and values' bytes."""
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"bench-count-{self.tag}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        try:
            tp = TopicPartition(topic, 0, OFFSET_BEGINNING)
            _low, high = consumer.get_watermark_offsets(tp, timeout=30)
            consumer.assign([tp])
            count = size = idle = 0
            while idle < 50:
                batch = consumer.consume(10_000, 0.2)
                idle = 0 if batch else idle + 1
                for msg in batch:
                    err = msg.error()
                    if err is not None and err.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"reading {topic}: {err}")
                    if err is None:
                        count += 1
                        size += len(msg.key() or b"") + len(msg.value() or b"")
                if (consumer.position([tp])[0].offset or 0) >= high:
                    break
            return count, size
        finally:
            consumer.close()

    # -- teardown ----------------------------------------------------------------------

    def cleanup(self) -> None:
        drop_pipeline(
            self.dsn,
            self.bootstrap,
            [self.ceiling_slot, *self.bridge_slots.values(), *self.other_slots],
            list(self.bridge_slots.values()),
            self.publication,
            f"SCHEMA IF EXISTS {self.schema} CASCADE",
            self.prefix,
        )


def _one(
    args: argparse.Namespace,
    dsn: str,
    bootstrap: str,
    workload: Workload,
    txn_size: int,
    index: int,
    work: Path,
) -> list[dict[str, Any]]:
    """One run of ``workload``: the ceiling, then the daemon in each format of --format."""
    tag = new_tag(workload.name, txn_size >= args.rows, index)
    run = Run(
        dsn,
        bootstrap,
        workload,
        args.rows,
        txn_size,
        tag,
        work / "spool",
        args.verify,
        variants(args),
        args.py_spy,
        begin_records=not args.no_begin_records,
        tombstones=not args.no_tombstones,
        transaction_metadata=not args.no_transaction_metadata,
    )
    run.broker_pid = broker_pid(args.stack_dir)
    results = []
    with run.prepared(args.keep) as (load_s, ceiling):
        say(f"{tag}: ceiling {ceiling['changes_per_s']:,.0f} changes/s")
        for variant in variants(args):
            e2e = run.e2e(variant, ceiling["end_lsn"], work / f"{tag}-{variant}.log")
            say(
                f"{tag}: {variant} end to end {e2e['changes_per_s']:,.0f} changes/s, "
                f"peak RSS {e2e['peak_rss_mb']:.0f} MB"
            )
            results.append(
                {
                    **run.facts(load_s, ceiling),
                    "format": variant,
                    "e2e": e2e,
                    "ratio": e2e["changes_per_s"] / ceiling["changes_per_s"],
                    "cpu_budget": cpu_budget(run.plan, ceiling, e2e),
                }
            )
    return results


def warm_up(stack: Stack, stack_dir: Path, work: Path, passes: int, txn_size: int) -> None:
    """``passes`` untimed runs of ``insert`` through the default format's daemon, figures
    dropped, so the measured runs meet a broker whose JIT has compiled its paths (module
    doc). ``bench/vs_debezium.py`` runs them too, before both systems' runs."""
    options = argparse.Namespace(
        rows=WARM_UP_ROWS,
        format="slotbridge",
        hashed_columns=0,
        py_spy=None,
        verify=True,  # the read back warms the broker's fetch path too
        no_begin_records=False,
        no_tombstones=False,
        no_transaction_metadata=False,
        stack_dir=stack_dir,
        keep=False,
    )
    for index in range(passes):
        say(f"warm-up pass {index + 1} of {passes}: figures dropped")
        _one(
            options,
            stack.primary_dsn,
            stack.kafka_bootstrap,
            WORKLOADS["insert"],
            txn_size,
            index,
            work,
        )


def variants(args: argparse.Namespace) -> tuple[str, ...]:
    """The daemons of a run: one per record format of --format, and with
    --hashed-columns N a second one of each hashing N text columns (``<format>-hN``)."""
    formats = FORMATS[args.format]
    if not args.hashed_columns:
        return formats
    return formats + tuple(f"{f}-h{args.hashed_columns}" for f in formats)


def variant_of(variant: str) -> tuple[str, int]:
    """A daemon variant's record format (a name of ``RECORD_FORMATS``) and how many columns
    it hashes."""
    record_format, _, hashed = variant.partition("-h")
    return record_format, int(hashed or 0)


def _short(variant: str) -> str:
    """A variant's part of slot and topic names."""
    record_format, hashed = variant_of(variant)
    return RECORD_FORMATS[record_format].short + (f"h{hashed}" if hashed else "")


@dataclass(frozen=True)
class RecordFormat:
    """What a record format of ``--format`` sets in the daemon, and its part of slot and
    topic names."""

    value_format: str
    short: str
    # debezium_schemas and debezium_context_headers: Debezium's defaults, or neither.
    lean: bool = False


GOAL_RATIO = 0.8  # the end-to-end goal of issues #14 and #33, as a share of the ceiling
WARM_UP_ROWS = 100_000  # rows of each untimed warm-up pass (see the module's doc)
RECORD_FORMATS = {
    "slotbridge": RecordFormat("slotbridge", "slo"),
    "debezium": RecordFormat("debezium", "deb"),
    # Without Connect schemas (JsonConverter's schemas.enable=false) and context headers
    # (extended.headers.enabled=false): Debezium's cheapest records.
    "debezium-lean": RecordFormat("debezium", "dbl", lean=True),
}
FORMATS = {
    **{name: (name,) for name in RECORD_FORMATS},
    "both": ("slotbridge", "debezium"),
    "all": tuple(RECORD_FORMATS),
}


def cpu_budget(plan: Plan, ceiling: dict[str, Any], e2e: dict[str, Any]) -> dict[str, Any] | None:
    """Where the machine's cores go per change, end to end: the bridge, the walsender
    decoding for it and the broker taking its records. ``bound_changes_per_s``: the rate at
    which the three would fill every core; ``bridge_us_at_goal``: the bridge's CPU per
    change that would leave room for ``GOAL_RATIO`` of the ceiling beside the other two
    (negative: none). Per source transaction: the bridge's CPU and the records it wrote
    (change records and the transaction topic's BEGIN, unless --no-begin-records, and
    END, unless --no-transaction-metadata), when they were counted."""
    if "walsender_cpu_s" not in e2e or "broker_cpu_s" not in e2e:
        return None
    per_change = {
        "bridge_us": e2e["cpu_s"] / plan.changes * 1e6,
        "walsender_us": e2e["walsender_cpu_s"] / plan.changes * 1e6,
        "broker_us": e2e["broker_cpu_s"] / plan.changes * 1e6,
    }
    cores = os.cpu_count() or 1
    goal = GOAL_RATIO * ceiling["changes_per_s"]
    others_us = per_change["walsender_us"] + per_change["broker_us"]
    budget = {
        **per_change,
        "cores": cores,
        "bound_changes_per_s": cores / (sum(per_change.values()) / 1e6),
        "goal_changes_per_s": goal,
        "others_cores_at_goal": goal * others_us / 1e6,
        "bridge_us_at_goal": cores / goal * 1e6 - others_us,
        "bridge_us_per_txn": e2e["cpu_s"] / plan.transactions * 1e6,
        # Of bridge_us, what librdkafka's threads spent: batching, compressing, sending.
        "librdkafka_us": e2e["librdkafka_cpu_s"] / plan.changes * 1e6,
    }
    if "kafka_txns" in e2e:
        # How many source transactions one Kafka transaction carried, and the share of the
        # run the publisher spent waiting on Kafka commits.
        budget["txns_per_kafka_txn"] = plan.transactions / max(1.0, e2e["kafka_txns"])
        budget["commit_share"] = e2e["kafka_commit_s"] / e2e["seconds"]
    if "change_records" in e2e:
        records = e2e["change_records"] + e2e["transaction_records"]
        budget["records_per_txn"] = records / plan.transactions
    return budget


def add_stack_arguments(parser: argparse.ArgumentParser) -> None:
    """--stack-dir and --keep-stack, which ``bench_stack`` reads."""
    parser.add_argument("--stack-dir", type=Path, default=ROOT / ".stack" / "bench")
    parser.add_argument(
        "--keep-stack",
        action="store_true",
        help="leave a stack this bench started running when it ends",
    )


def add_run_arguments(parser: argparse.ArgumentParser, rows: int) -> None:
    """The workload, repeat, stack and clean-up options (``rows`` is --rows' default)."""
    parser.add_argument(
        "--workload",
        default="insert",
        help=f"comma-separated, of {', '.join(WORKLOADS)}, or all (default: insert)",
    )
    parser.add_argument("--rows", type=int, default=rows, help="rows the load changes")
    parser.add_argument("--txn-size", type=int, default=1000)
    parser.add_argument(
        "--shapes",
        choices=("both", "small", "big"),
        default="both",
        help="small: --txn-size transactions; big: one --rows transaction (oltp: small only)",
    )
    parser.add_argument("--repeat", type=int, default=1)
    add_stack_arguments(parser)
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip reading the change topics back to count the records",
    )
    parser.add_argument("--keep", action="store_true", help="keep schemas, slots and topics")


def workloads(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Workload]:
    """The workloads --workload names (exits with a usage line on an unknown one)."""
    names = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    if unknown := [n for n in names if n not in WORKLOADS]:
        parser.error(f"unknown workload {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    return [WORKLOADS[n] for n in names]


def txn_sizes(args: argparse.Namespace, workload: Workload) -> list[int]:
    """The transaction size of each shape --shapes asks for (pgbench makes its own)."""
    if workload.name == "oltp":
        return [OLTP_CHANGES_PER_TXN]
    sizes: list[int] = {
        "small": [args.txn_size],
        "big": [args.rows],
        "both": [args.txn_size, args.rows],
    }[args.shapes]
    return sizes


@contextlib.contextmanager
def bench_stack(args: argparse.Namespace) -> Iterator[Stack]:
    """The local stack under --stack-dir, up; stopped at the end if this bench started it
    (and not --keep-stack)."""
    stack = Stack(args.stack_dir)
    was_running = stack.running()
    with contextlib.redirect_stdout(sys.stderr):  # keep --json output clean
        stack.up()
    try:
        yield stack
    finally:
        if was_running or args.keep_stack:
            say(f"the stack in {args.stack_dir} stays up (slotbridge stack down --dir ...)")
        else:
            with contextlib.redirect_stdout(sys.stderr):
                stack.down()
            say(f"stopped the stack this bench started in {args.stack_dir}")


def median_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload, shape and format: the medians over the repeats."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in results:
        groups.setdefault((r["workload"], r["shape"], r["format"]), []).append(r)
    summary = []
    for (workload, shape, value_format), runs in groups.items():
        budgets = [r["cpu_budget"] for r in runs if r["cpu_budget"]]
        sizes = [r["e2e"]["record_bytes"] for r in runs if "record_bytes" in r["e2e"]]

        def per(key: str, budgets: list[dict[str, Any]] = budgets) -> float | None:
            values = [b[key] for b in budgets if key in b]
            return statistics.median(values) if values else None

        ceilings = [r["ceiling"]["changes_per_s"] for r in runs]
        ceiling = statistics.median(ceilings)

        summary.append(
            {
                "workload": workload,
                "shape": shape,
                "format": value_format,
                "runs": len(runs),
                "ceiling_changes_per_s": ceiling,
                # How far the ceiling moved between the runs, as a share of its median: the
                # bare reader's rate moves with the machine more than the daemon's does, and
                # a ratio is worth only as much as its ceiling (None: one run).
                "ceiling_spread": (max(ceilings) - min(ceilings)) / ceiling
                if len(ceilings) > 1
                else None,
                "e2e_changes_per_s": statistics.median(r["e2e"]["changes_per_s"] for r in runs),
                "ratio": statistics.median(r["ratio"] for r in runs),
                "peak_rss_mb": statistics.median(r["e2e"]["peak_rss_mb"] for r in runs),
                # Read back by --verify only.
                "record_bytes": statistics.median(sizes) if sizes else None,
                **{
                    key: per(key)
                    for key in (
                        "bridge_us",
                        "librdkafka_us",
                        "walsender_us",
                        "broker_us",
                        "bridge_us_per_txn",
                        "records_per_txn",
                        "txns_per_kafka_txn",
                        "commit_share",
                    )
                },
            }
        )
    return summary


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(summary: list[dict[str, Any]]) -> None:
    print(
        f"\n{'workload':12} {'shape':20} {'format':16} {'ceiling/s':>10} {'spread':>6}"
        f" {'e2e/s':>9}"
        f" {'e2e/ceil':>8} {'bridge us':>9} {'rdk us':>6} {'walsnd us':>9} {'broker us':>9}"
        f" {'us/txn':>8} {'rec/txn':>7} {'txn/ktx':>7} {'commit':>6} {'RSS MB':>6}"
        f" {'B/rec':>6}"
    )
    for s in summary:
        print(
            f"{s['workload']:12} {s['shape']:20} {s['format']:16}"
            f" {s['ceiling_changes_per_s']:10,.0f} {_fmt(s['ceiling_spread'], '6.0%')}"
            f" {s['e2e_changes_per_s']:9,.0f}"
            f" {s['ratio']:8.2f} {_fmt(s['bridge_us'], '9.2f')} {_fmt(s['librdkafka_us'], '6.2f')}"
            f" {_fmt(s['walsender_us'], '9.2f')}"
            f" {_fmt(s['broker_us'], '9.2f')} {_fmt(s['bridge_us_per_txn'], '8.1f')}"
            f" {_fmt(s['records_per_txn'], '7.2f')} {_fmt(s['txns_per_kafka_txn'], '7.0f')}"
            f" {_fmt(s['commit_share'], '6.0%')} {s['peak_rss_mb']:6.0f}"
            f" {_fmt(s['record_bytes'], '6.0f')}"
        )
    default = {
        (s["workload"], s["shape"]): s["e2e_changes_per_s"]
        for s in summary
        if s["format"] == "slotbridge"
    }
    others = [
        s for s in summary if s["format"] != "slotbridge" and (s["workload"], s["shape"]) in default
    ]
    if others:
        # Issue #33's goal: the Debezium format at >= 0.8 of the default format's rate.
        print(f"\n{'workload':12} {'shape':20} {'format':16} {'e2e / default format':>20}")
        for s in others:
            ratio = s["e2e_changes_per_s"] / default[s["workload"], s["shape"]]
            print(f"{s['workload']:12} {s['shape']:20} {s['format']:16} {ratio:20.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, 1_000_000)
    parser.add_argument(
        "--format",
        choices=tuple(FORMATS),
        default="slotbridge",
        help="the daemon's record format(s) (debezium-lean: without Connect schemas and "
        "context headers); both: the default and debezium, all: the three, one daemon each "
        "over the same WAL",
    )
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the daemon under py-spy, raw stacks into DIR (skews figures)",
    )
    parser.add_argument(
        "--hashed-columns",
        type=int,
        default=0,
        metavar="N",
        help="wide only: also run each format's daemon with a hash transform on N of the "
        "table's 8 text columns, over the same WAL (the cost of masking)",
    )
    parser.add_argument(
        "--no-begin-records",
        action="store_true",
        help="the daemons write no BEGIN records on the transaction topic "
        "(transaction_begin_records: false), only ENDs",
    )
    parser.add_argument(
        "--no-transaction-metadata",
        action="store_true",
        help="the daemons write no transaction topic, neither BEGIN nor END records "
        "(transaction_metadata: false, as Debezium's default)",
    )
    parser.add_argument(
        "--no-tombstones",
        action="store_true",
        help="the daemons write no tombstone after a delete's record (tombstones_on_delete: false)",
    )
    parser.add_argument(
        "--warm-up",
        type=int,
        default=3,
        metavar="PASSES",
        help=f"untimed passes of insert ({WARM_UP_ROWS:,} rows, default format) before the "
        "measured runs, for the broker's JIT (default 3; 0: none)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    chosen = workloads(parser, args)
    if args.hashed_columns and (
        [w.name for w in chosen] != ["wide"] or not 0 < args.hashed_columns <= 8
    ):
        parser.error("--hashed-columns takes 1 to 8, with --workload wide alone")
    if args.py_spy is not None:
        # Checked before the load: py-spy is a profiling tool, not one of the venv's.
        if not (ROOT / ".venv/bin/py-spy").exists():
            parser.error("--py-spy needs py-spy in the venv: .venv/bin/pip install py-spy")
        args.py_spy.mkdir(parents=True, exist_ok=True)

    with bench_stack(args) as stack:
        work = args.stack_dir / "bridge-bench"
        work.mkdir(parents=True, exist_ok=True)
        warm_up(stack, args.stack_dir, work, args.warm_up, args.txn_size)
        results = [
            result
            for i in range(args.repeat)
            for workload in chosen
            for size in txn_sizes(args, workload)
            for result in _one(
                args, stack.primary_dsn, stack.kafka_bootstrap, workload, size, i, work
            )
        ]
    summary = median_rows(results)
    if args.json:
        print(json.dumps({"runs": results, "median": summary}, indent=2))
        return
    print_table(summary)
    if args.repeat > 1:
        print(f"(medians of {args.repeat} runs)")


if __name__ == "__main__":
    main()
