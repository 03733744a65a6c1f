"""End-to-end bridge throughput next to the decode ceiling, on the local stack.

    python bench/bridge_bench.py [--rows 1000000] [--txn-size 1000] [--shapes both]
                                 [--repeat 1] [--stack-dir .stack/bench] [--json]

For each workload shape (``--txn-size`` rows per transaction, and one ``--rows``-row
transaction) and each repeat, on a fresh table, publication and two fresh failover slots:

1. load: the rows are inserted while both slots already exist, so the WAL is there before
   anything reads it (the load time is printed, never part of a rate);
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
   progress topic) catches up on the second slot; the clock runs from its "streaming" log
   line to the moment a read_committed consumer of the progress topic sees a progress
   record whose ``end_lsn`` reaches the last commit's end. The figure from process start
   (connections, Kafka init_transactions) is printed too. Peak RSS is the daemon's VmHWM
   just before it is stopped; its CPU seconds over the same span (utime + stime) are in the
   ``--json`` output. With ``--verify`` (default) the change topic is read back
   with read_committed and must hold exactly ``--rows`` records.

4. CPU budget: the CPU seconds per row of the daemon, of the walsender decoding for it and
   of the stack's broker over the same span; the rate at which the three would fill every
   core of this machine, and what is left per row for the daemon at 0.8 of the ceiling
   (the goal of issue #14) beside the other two. The daemon's Python threads share one
   core, so its own figure also bounds it alone: 1e6 / bridge us per row.

The server's ``logical_decoding_work_mem`` is left as configured (64MB by default), so the
big transaction is streamed in chunks the way production would see it.

Figures, not assertions: the machine is shared, so run it a few times and take medians.
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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from services.bridge.stream import ReplicationConnection
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
    then (``others_cpu_s``: that of each of ``others``). Gives up when ``running()`` turns
    false."""

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
        self.cpu_s = 0.0
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
                    self.cpu_s = cpu_seconds(self.pid)
                    self.others_cpu_s = [cpu_seconds(other) for other in self.others]
                    self.at = time.monotonic()
                line = ""


def catch_up(
    pid: int,
    spawned: float,
    mark: LogMark,
    reached: Callable[[], bool],
    alive: Callable[[], None],
    rows: int,
    what: str,
    timeout: float = 1800,
) -> dict[str, Any]:
    """Times a CDC process (``pid``, spawned at monotonic ``spawned``) through a backlog of
    ``rows`` rows: from ``mark`` (from the spawn if it never showed) until ``reached()`` - a
    probe that may block briefly, the loop's pace - says the last row is readable by a
    read_committed consumer. ``alive()`` raises if the process failed; it runs once a second,
    as it may cost the process something. CPU seconds are the process's over the same span;
    peak RSS is its VmHWM, so it includes its start."""
    peak_kb = 0
    checked = reported = spawned
    while not reached():
        now = time.monotonic()
        peak_kb = max(peak_kb, _rss_kb(pid))
        if now - checked >= 1:
            alive()
            checked = now
        if now - reported >= 10:
            say(f"{what}: catching up, {now - spawned:.0f}s since its start")
            reported = now
        if now - spawned > timeout:
            raise TimeoutError(f"{what} did not catch up in {timeout:.0f} s; see {mark.log_path}")
    done = time.monotonic()
    cpu = cpu_seconds(pid)
    peak_kb = max(peak_kb, _rss_kb(pid))
    began, cpu_began = (spawned, 0.0) if mark.at is None else (mark.at, mark.cpu_s)
    return {
        "seconds": done - began,
        "seconds_from_spawn": done - spawned,
        "rows_per_s": rows / (done - began),
        "rows_per_s_from_spawn": rows / (done - spawned),
        "peak_rss_mb": peak_kb / 1024,
        "cpu_s": cpu - cpu_began,
        "cpu_s_from_spawn": cpu,
        "cpu_s_per_1m_rows": (cpu - cpu_began) / rows * 1e6,
    }


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
    dsn: str, bootstrap: str, slot: str, publication: str, table: str, prefix: str, spool_dir: Path
) -> dict[str, str]:
    """The environment of a daemon streaming ``public.<table>`` from its own slot, with
    its own topic prefix and progress topic (``<prefix>.progress``), and no snapshot."""
    return {
        **os.environ,
        "SLOTBRIDGE_SOURCE_DSN": dsn,
        "SLOTBRIDGE_KAFKA_BOOTSTRAP": bootstrap,
        "SLOTBRIDGE_SLOT_NAME": slot,
        "SLOTBRIDGE_PUBLICATION_NAME": publication,
        "SLOTBRIDGE_TABLES": json.dumps([f"public.{table}"]),
        "SLOTBRIDGE_TOPIC_PREFIX": prefix,
        "SLOTBRIDGE_PROGRESS_TOPIC": f"{prefix}.progress",
        "SLOTBRIDGE_SNAPSHOT_MODE": "never",
        "SLOTBRIDGE_SPOOL_DIR": str(spool_dir),
        "SLOTBRIDGE_HTTP_PORT": "0",
        "SLOTBRIDGE_LOG_FORMAT": "text",
    }


def drop_pipeline(
    dsn: str,
    bootstrap: str,
    slots: list[str],
    daemon_slot: str,
    publication: str,
    table: str,
    prefix: str,
) -> None:
    """Drop the slots (once their readers let go), the daemon's origin, the publication,
    the table and every topic under ``prefix``."""
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
            " WHERE roname = %s",
            (f"slotbridge_{daemon_slot}",),
        )
        conn.execute(f"DROP PUBLICATION IF EXISTS {publication}")
        conn.execute(f"DROP TABLE IF EXISTS {table}")
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


def new_tag(rows: int, txn_size: int, index: int) -> str:
    return f"{'big' if txn_size >= rows else 'txn'}{int(time.time()) % 1_000_000}_{index}"


class Run:
    """One shape, one repeat: its own table, publication, slots and topics. ``other_slots``
    are created with the others, before the load, for other readers of the same WAL (plain
    pgoutput slots: failover, no two_phase)."""

    def __init__(
        self,
        dsn: str,
        bootstrap: str,
        rows: int,
        txn_size: int,
        tag: str,
        spool_dir: Path,
        verify: bool,
        py_spy: Path | None = None,
        other_slots: Sequence[str] = (),
    ) -> None:
        self.dsn, self.bootstrap = dsn, bootstrap
        self.rows, self.txn_size = rows, txn_size
        self.tag = tag
        self.table = f"bench_{tag}"
        self.publication = f"pub_{tag}"
        self.ceiling_slot = f"ceil_{tag}"
        self.bridge_slot = f"bridge_{tag}"
        self.prefix = f"bench.{tag}"
        self.progress_topic = f"{self.prefix}.progress"
        self.spool_dir = spool_dir
        self.verify = verify
        self.py_spy = py_spy
        self.other_slots = list(other_slots)
        # The stack's broker, when its CPU seconds are to be measured too.
        self.broker_pid: int | None = None
        self.txns = -(-rows // txn_size)

    @property
    def shape(self) -> str:
        return f"{self.txn_size}-row txns" if self.txns > 1 else f"one {self.rows}-row txn"

    def facts(self, load_s: float, ceiling: dict[str, Any]) -> dict[str, Any]:
        """What this run was, for a result: shape, sizes, load time and ceiling."""
        return {
            "shape": self.shape,
            "txn_size": self.txn_size,
            "rows": self.rows,
            "load_s": load_s,
            "ceiling": ceiling,
        }

    @contextlib.contextmanager
    def prepared(self, keep: bool) -> Iterator[tuple[float, dict[str, Any]]]:
        """Set up, load and read the ceiling; yields the load's seconds and the ceiling, for
        the catch-ups to measure; drops everything afterwards unless ``keep``."""
        say(f"{self.tag}: {self.rows:,} rows in {self.txns:,} transaction(s) of {self.txn_size:,}")
        try:
            self.setup()
            load_s = self.load()
            say(f"{self.tag}: loaded in {load_s:.1f}s; reading the ceiling slot")
            yield load_s, self.ceiling()
        finally:
            if not keep:
                self.cleanup()

    # -- setup -------------------------------------------------------------------------

    def setup(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                f"CREATE TABLE {self.table} (id bigint PRIMARY KEY, a int, b text,"
                " c numeric, d timestamptz)"
            )
            conn.execute(f"CREATE PUBLICATION {self.publication} FOR TABLE {self.table}")
            # The mark the daemon leaves before creating a slot: without it, it refuses a
            # slot it did not create.
            conn.execute(
                "SELECT pg_replication_origin_create(%s)", (f"slotbridge_{self.bridge_slot}",)
            )
            for slot in (self.ceiling_slot, self.bridge_slot):
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
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        for future in admin.create_topics(
            [
                NewTopic(
                    self.progress_topic,
                    num_partitions=1,
                    replication_factor=-1,
                    config={"cleanup.policy": "compact"},
                )
            ],
            operation_timeout=30,
        ).values():
            future.result()

    def load(self) -> float:
        """Insert the rows; returns the seconds it took (not part of any rate)."""
        started = time.monotonic()
        select = (
            "SELECT g, (g % 100000)::int, 'customer ' || g || ' note', "
            "(g * 1.25)::numeric(14,2), "
            "timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second' "
            "FROM generate_series({lo}, {hi}) g"
        )
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute("SET synchronous_commit = off")
            if self.txns == 1:
                conn.execute(f"INSERT INTO {self.table} " + select.format(lo=1, hi=self.rows))
            else:
                conn.execute(
                    f"DO $$ BEGIN FOR i IN 0..{self.txns - 1} LOOP "
                    f"INSERT INTO {self.table} "
                    + select.format(
                        lo=f"i * {self.txn_size} + 1",
                        hi=f"least((i + 1) * {self.txn_size}, {self.rows})",
                    )
                    + "; COMMIT; END LOOP; END $$"
                )
        return time.monotonic() - started

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
            while commits < self.txns:
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
            "rows_per_s": self.rows / seconds,
            "msgs_per_s": count / seconds,
            "mb_per_s": nbytes / seconds / 1e6,
            "end_lsn": end_lsn,
        }

    # -- end to end --------------------------------------------------------------------

    def e2e(self, end_lsn: int, log_path: Path) -> dict[str, Any]:
        env = daemon_env(
            self.dsn,
            self.bootstrap,
            self.bridge_slot,
            self.publication,
            self.table,
            self.prefix,
            self.spool_dir,
        )
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": f"bench-{self.tag}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 10,
            }
        )
        consumer.assign([TopicPartition(self.progress_topic, 0, OFFSET_BEGINNING)])
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
                "100",
                "--format",
                "raw",
                "-o",
                str(self.py_spy / f"{self.tag}.txt"),
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

        def reached() -> bool:
            nonlocal published
            msg = consumer.poll(0.02)
            value = None if msg is None or msg.error() is not None else msg.value()
            if value is not None:
                published = max(published, int(json.loads(value)["end_lsn"]))
            return published >= end_lsn

        def alive() -> None:
            if proc.poll() is not None:
                raise RuntimeError(f"bridge exited with {proc.returncode}; see {log_path}")

        try:
            result = catch_up(
                bridge_pid, spawned, mark, reached, alive, self.rows, f"{self.tag}: bridge"
            )
            # The other processes on this machine's cores, over the same span (the
            # walsender's from its start: all of it is this backlog's decoding).
            sender = walsender_pid(self.dsn, self.bridge_slot)
            if sender is not None:
                result["walsender_cpu_s"] = cpu_seconds(sender)
            if broker:
                result["broker_cpu_s"] = cpu_seconds(broker[0]) - mark.others_cpu_s[0]
        finally:
            consumer.close()
            stop_process(proc, bridge_pid)
            mark.join(1)
        if self.verify:
            result["records"] = self.count(f"{self.prefix}.public.{self.table}")
            if result["records"] != self.rows:
                raise RuntimeError(
                    f"change topic holds {result['records']} records, expected {self.rows}"
                )
        return result

    def count(self, topic: str) -> int:
        """The records of ``topic`` (one partition) a read_committed consumer reads."""
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
            count = 0
            position = 0
            idle = 0
            while position < high - 1 and idle < 50:
                batch = consumer.consume(10_000, 0.2)
                if not batch:
                    idle += 1
                    continue
                idle = 0
                for msg in batch:
                    err = msg.error()
                    if err is not None and err.code() != KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"reading {topic}: {err}")
                    if err is None:
                        count += 1
                        position = msg.offset() or 0  # None only on error events
            return count
        finally:
            consumer.close()

    # -- teardown ----------------------------------------------------------------------

    def cleanup(self) -> None:
        drop_pipeline(
            self.dsn,
            self.bootstrap,
            [self.ceiling_slot, self.bridge_slot, *self.other_slots],
            self.bridge_slot,
            self.publication,
            self.table,
            self.prefix,
        )


def _one(
    args: argparse.Namespace, dsn: str, bootstrap: str, txn_size: int, index: int, work: Path
) -> dict[str, Any]:
    tag = new_tag(args.rows, txn_size, index)
    run = Run(dsn, bootstrap, args.rows, txn_size, tag, work / "spool", args.verify, args.py_spy)
    run.broker_pid = broker_pid(args.stack_dir)
    with run.prepared(args.keep) as (load_s, ceiling):
        say(f"{tag}: ceiling {ceiling['rows_per_s']:,.0f} rows/s; starting the bridge")
        e2e = run.e2e(ceiling["end_lsn"], work / f"{tag}.log")
        say(
            f"{tag}: end to end {e2e['rows_per_s']:,.0f} rows/s, "
            f"peak RSS {e2e['peak_rss_mb']:.0f} MB"
        )
    return {
        **run.facts(load_s, ceiling),
        "e2e": e2e,
        "ratio": e2e["rows_per_s"] / ceiling["rows_per_s"],
        "cpu_budget": cpu_budget(args.rows, ceiling, e2e),
    }


GOAL_RATIO = 0.8  # issue #14's end-to-end goal, as a share of the ceiling


def cpu_budget(rows: int, ceiling: dict[str, Any], e2e: dict[str, Any]) -> dict[str, Any] | None:
    """Where the machine's cores go per row, end to end: the bridge, the walsender decoding
    for it and the broker taking its records. ``bound_rows_per_s``: the rate at which the
    three would fill every core; ``bridge_us_at_goal``: the bridge's CPU per row that would
    leave room for ``GOAL_RATIO`` of the ceiling beside the other two (negative: none)."""
    if "walsender_cpu_s" not in e2e or "broker_cpu_s" not in e2e:
        return None
    per_row = {
        "bridge_us": e2e["cpu_s"] / rows * 1e6,
        "walsender_us": e2e["walsender_cpu_s"] / rows * 1e6,
        "broker_us": e2e["broker_cpu_s"] / rows * 1e6,
    }
    cores = os.cpu_count() or 1
    goal = GOAL_RATIO * ceiling["rows_per_s"]
    others_us = per_row["walsender_us"] + per_row["broker_us"]
    return {
        **per_row,
        "cores": cores,
        "bound_rows_per_s": cores / (sum(per_row.values()) / 1e6),
        "goal_rows_per_s": goal,
        "others_cores_at_goal": goal * others_us / 1e6,
        "bridge_us_at_goal": cores / goal * 1e6 - others_us,
    }


def add_run_arguments(parser: argparse.ArgumentParser, rows: int) -> None:
    """The workload, repeat, stack and clean-up options (``rows`` is --rows' default)."""
    parser.add_argument("--rows", type=int, default=rows)
    parser.add_argument("--txn-size", type=int, default=1000)
    parser.add_argument(
        "--shapes",
        choices=("both", "small", "big"),
        default="both",
        help="small: --txn-size transactions; big: one --rows transaction",
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--stack-dir", type=Path, default=ROOT / ".stack" / "bench")
    parser.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip reading the change topics back to count the records",
    )
    parser.add_argument("--keep", action="store_true", help="keep tables, slots and topics")


def txn_sizes(args: argparse.Namespace) -> list[int]:
    """The transaction size of each shape --shapes asks for."""
    sizes: list[int] = {
        "small": [args.txn_size],
        "big": [args.rows],
        "both": [args.txn_size, args.rows],
    }[args.shapes]
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser, 1_000_000)
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        metavar="DIR",
        help="run the daemon under py-spy, raw stacks into DIR (skews figures)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()

    stack = Stack(args.stack_dir)
    with contextlib.redirect_stdout(sys.stderr):  # keep --json output clean
        stack.up()
    work = args.stack_dir / "bridge-bench"
    work.mkdir(parents=True, exist_ok=True)
    sizes = txn_sizes(args)
    results = [
        _one(args, stack.primary_dsn, stack.kafka_bootstrap, size, i, work)
        for i in range(args.repeat)
        for size in sizes
    ]
    summary = []
    for size in sizes:
        runs = [r for r in results if r["txn_size"] == size]
        summary.append(
            {
                "shape": runs[0]["shape"],
                "runs": len(runs),
                "ceiling_rows_per_s": statistics.median(r["ceiling"]["rows_per_s"] for r in runs),
                "e2e_rows_per_s": statistics.median(r["e2e"]["rows_per_s"] for r in runs),
                "e2e_rows_per_s_from_spawn": statistics.median(
                    r["e2e"]["rows_per_s_from_spawn"] for r in runs
                ),
                "ratio": statistics.median(r["ratio"] for r in runs),
                "peak_rss_mb": statistics.median(r["e2e"]["peak_rss_mb"] for r in runs),
            }
        )
    if args.json:
        print(json.dumps({"runs": results, "median": summary}, indent=2))
        return
    print(
        f"\n{'shape':24} {'ceiling rows/s':>15} {'e2e rows/s':>12} {'e2e/ceiling':>12}"
        f" {'e2e from spawn':>15} {'peak RSS MB':>12} {'load s':>7}"
    )
    for r in results:
        print(
            f"{r['shape']:24} {r['ceiling']['rows_per_s']:15,.0f} {r['e2e']['rows_per_s']:12,.0f}"
            f" {r['ratio']:12.3f} {r['e2e']['rows_per_s_from_spawn']:15,.0f}"
            f" {r['e2e']['peak_rss_mb']:12.0f} {r['load_s']:7.1f}"
        )
    budgets = [(r["shape"], r["cpu_budget"]) for r in results if r["cpu_budget"]]
    if budgets:
        print(
            f"\nCPU per row (us) {'bridge':>7} {'walsender':>9} {'broker':>7}"
            f" {'bound rows/s':>13} {'goal rows/s':>12} {'others cores':>13}"
            f" {'bridge us left':>15}"
        )
        for shape, b in budgets:
            print(
                f"{shape:16} {b['bridge_us']:7.2f} {b['walsender_us']:9.2f} {b['broker_us']:7.2f}"
                f" {b['bound_rows_per_s']:13,.0f} {b['goal_rows_per_s']:12,.0f}"
                f" {b['others_cores_at_goal']:13.2f} {b['bridge_us_at_goal']:15.2f}"
            )
    if args.repeat > 1:
        print("median")
        for s in summary:
            print(
                f"{s['shape']:24} {s['ceiling_rows_per_s']:15,.0f} {s['e2e_rows_per_s']:12,.0f}"
                f" {s['ratio']:12.3f} {s['e2e_rows_per_s_from_spawn']:15,.0f}"
                f" {s['peak_rss_mb']:12.0f}"
            )


if __name__ == "__main__":
    main()
