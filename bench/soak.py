"""An hour of faults under a steady OLTP load, every verdict audited in the broker's log.

    python bench/soak.py [--minutes 60] [--fault-every-s 120] [--rate 100]
                         [--faults kill,pause,broker,cut,planned,crash]
                         [--stack-dir /tmp/slotbridge-soak] [--keep-stack] [--json]

One stack, one bridge on a multi-host DSN, and a TPC-B-like mix (per transaction three
single-row UPDATEs of accounts, tellers and branches and one INSERT into history, from
several clients at ``--rate`` transactions/s in all) for ``--minutes``. Every
``--fault-every-s`` one fault, in rotation:

- ``kill``: the bridge SIGKILLed and started again;
- ``pause``: the bridge SIGSTOPped, a successor started (it fences the paused one in Kafka
  and takes the slot over), the paused one resumed: it must stop by itself;
- ``broker``: the Kafka broker SIGKILLed and restarted;
- ``cut``: every connection between the bridge and Kafka cut (a Kafka-aware proxy);
- ``planned``: ``slotbridge failover promote`` of the standby with the primary fenced;
- ``crash``: the primary crashed (immediate stop), then ``promote --force``.

After a promotion the old primary is rebuilt as the new primary's standby, so drills go on
alternating. Each minute a line gives the transactions committed, the slot's lag behind the
current primary's WAL and the bridge's RSS. At the end, with writes stopped and the bridge
caught up: every history row of the surviving primary must be in Kafka exactly once and no
other (``lost``, ``duplicated``, ``extra``), every key's records must come in commit order
(``out_of_order``), every key's last record must equal its row, and the broker-log audit
must be clean. Exits non-zero otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from slotbridge_dev.drill import follow_primary, run_promote  # noqa: E402
from slotbridge_dev.stack.kafka_audit import audit  # noqa: E402
from slotbridge_dev.stack.kafka_proxy import KafkaFaultProxy  # noqa: E402
from slotbridge_dev.stack.stack import Stack, StackError  # noqa: E402
from tests.integration.bridge_harness import Pipeline, Record, read_topics  # noqa: E402

FAULTS = ["kill", "pause", "broker", "cut", "planned", "crash"]
TABLES = ("accounts", "tellers", "branches", "history")
ACCOUNTS, TELLERS, BRANCHES = 10_000, 100, 10
# No progress for this long is a failure (a wait that grows with volume is never timed).
STALL_S = 300.0


def _rss_mb(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def _say(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class OltpMix:
    """TPC-B-like transactions from ``clients`` threads at ``rate`` per second in all, on
    whichever server of ``dsn`` accepts writes; a failed transaction is not counted."""

    def __init__(self, dsn: str, rate: float, clients: int = 4) -> None:
        self.dsn, self.rate, self.clients = dsn, rate, clients
        self.committed = 0
        self.errors = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def create(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for table, rows in (
                ("accounts", ACCOUNTS),
                ("tellers", TELLERS),
                ("branches", BRANCHES),
            ):
                conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, balance bigint NOT NULL)")
                conn.execute(f"INSERT INTO {table} SELECT g, 0 FROM generate_series(1, {rows}) g")
            conn.execute(
                "CREATE TABLE history (id bigserial PRIMARY KEY, account int, teller int, "
                "branch int, delta int, at timestamptz DEFAULT now())"
            )

    def start(self) -> None:
        for n in range(self.clients):
            thread = threading.Thread(target=self._client, args=(n,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        period = self.clients / self.rate
        conn: psycopg.Connection[tuple[Any, ...]] | None = None
        due = time.monotonic()
        while not self._stop.is_set():
            due += period
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, connect_timeout=2)
                account = rng.randint(1, ACCOUNTS)
                teller, branch = rng.randint(1, TELLERS), rng.randint(1, BRANCHES)
                delta = rng.randint(-5000, 5000)
                with conn.transaction():
                    conn.execute(
                        "UPDATE accounts SET balance = balance + %s WHERE id = %s", (delta, account)
                    )
                    conn.execute(
                        "UPDATE tellers SET balance = balance + %s WHERE id = %s", (delta, teller)
                    )
                    conn.execute(
                        "UPDATE branches SET balance = balance + %s WHERE id = %s", (delta, branch)
                    )
                    conn.execute(
                        "INSERT INTO history (account, teller, branch, delta) "
                        "VALUES (%s, %s, %s, %s)",
                        (account, teller, branch, delta),
                    )
                with self._lock:
                    self.committed += 1
            except psycopg.Error:
                with self._lock:
                    self.errors += 1
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.2)
                due = time.monotonic()
            time.sleep(max(0.0, due - time.monotonic()))
        if conn is not None:
            conn.close()


class Soak:
    def __init__(self, stack: Stack, work: Path, rate: float, faults: list[str]) -> None:
        self.stack = stack
        self.work = work
        self.roles = {"primary": "primary", "standby": "standby"}  # role -> node name
        self.dsn = follow_primary(stack.primary_dsn, stack.standby_dsn)
        self.proxy = KafkaFaultProxy(stack.kafka_bootstrap).start()
        self.mix = OltpMix(self.dsn, rate)
        self.pipe = Pipeline(
            stack,
            [f"public.{t}" for t in TABLES],
            work,
            extra={
                "SLOTBRIDGE_SOURCE_DSN": self.dsn,
                "SLOTBRIDGE_KAFKA_BOOTSTRAP": self.proxy.bootstrap,
                "SLOTBRIDGE_LOG_LEVEL": "INFO",
            },
        )
        self.rotation = faults
        self.faults: dict[str, int] = defaultdict(int)
        self.takeover_s: list[float] = []
        self.promote_s: list[float] = []
        self.minutes: list[dict[str, Any]] = []

    # -- the source -------------------------------------------------------------------

    def primary(self) -> Any:
        return self.stack.node(self.roles["primary"])

    def lag_bytes(self) -> int | None:
        try:
            rows = self.primary().query(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint "
                "FROM pg_replication_slots WHERE slot_name = %s",
                (self.pipe.name,),
            )
        except (psycopg.Error, StackError):  # a primary down mid-drill has no lag to report
            return None
        return int(rows[0][0]) if rows and rows[0][0] is not None else None

    def wait_caught_up(self) -> None:
        """Until the slot confirms the primary's WAL; fails after STALL_S without progress."""
        best, moved = None, time.monotonic()
        while True:
            lag = self.lag_bytes()
            if lag is not None and lag <= 0:
                return
            if lag is not None and (best is None or lag < best):
                best, moved = lag, time.monotonic()
            if time.monotonic() - moved > STALL_S:
                raise SystemExit(f"no progress for {STALL_S:.0f}s (lag {lag}):\n{self.tail()}")
            self.check_bridge()
            time.sleep(1)

    # -- the bridge -------------------------------------------------------------------

    def tail(self) -> str:
        return self.pipe.output()[-4000:]

    def check_bridge(self) -> None:
        proc = self.pipe.proc
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"bridge exited by itself ({proc.returncode}):\n{self.tail()}")

    def rss_mb(self) -> float | None:
        proc = self.pipe.proc
        return _rss_mb(proc.pid) if proc else None

    def dump_stacks(self) -> None:
        """Where each of the bridge's threads stands, into its log (SIGUSR1: faulthandler)."""
        proc = self.pipe.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            _say(f"the bridge's threads are in {self.pipe.log_path}")

    def children_rss_mb(self) -> float | None:
        """The RSS of the bridge's child processes (its topic id probe)."""
        proc = self.pipe.proc
        if proc is None:
            return None
        try:
            tasks = Path(f"/proc/{proc.pid}/task").iterdir()
            pids = [int(p) for t in tasks for p in (t / "children").read_text().split()]
        except OSError:
            return None
        return sum(rss for pid in pids if (rss := _rss_mb(pid)) is not None)

    def wait_streaming(self, since: int) -> float:
        """Seconds until the bridge's log after offset ``since`` says it streams."""
        started = time.monotonic()
        while " streaming slot=" not in self.pipe.output()[since:]:
            self.check_bridge()
            if time.monotonic() - started > STALL_S:
                raise SystemExit(f"the bridge did not stream within {STALL_S:.0f}s:\n{self.tail()}")
            time.sleep(0.2)
        return time.monotonic() - started

    # -- faults -----------------------------------------------------------------------

    def inject(self, fault: str) -> None:
        getattr(self, f"_{fault}")()
        self.faults[fault] += 1

    def _kill(self) -> None:
        self.pipe.kill()
        since = len(self.pipe.output())
        self.pipe.start()
        self.wait_streaming(since)

    def _pause(self) -> None:
        paused = self.pipe.proc
        assert paused is not None
        paused.send_signal(signal.SIGSTOP)
        since = len(self.pipe.output())
        self.pipe.proc = None
        self.pipe.start()
        self.takeover_s.append(self.wait_streaming(since))
        paused.send_signal(signal.SIGCONT)
        try:
            code = paused.wait(STALL_S)
        except subprocess.TimeoutExpired:
            paused.kill()
            raise SystemExit("the resumed predecessor did not stop by itself") from None
        if code == 0:
            raise SystemExit(f"the resumed predecessor exited 0, not as fenced:\n{self.tail()}")

    def _broker(self) -> None:
        kafka = self.stack.kafka
        pid = kafka.pid()
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            while kafka.is_running():
                time.sleep(0.2)
        time.sleep(2)
        kafka.start()
        kafka.wait_ready()

    def _cut(self) -> None:
        self.proxy.cut()

    def _planned(self) -> None:
        self._failover(crash=False)

    def _crash(self) -> None:
        self._failover(crash=True)

    def _failover(self, crash: bool) -> None:
        old, new = self.roles["primary"], self.roles["standby"]
        self.stack.wait_slot_synced(
            self.pipe.name, timeout=STALL_S, primary_name=old, standby_name=new
        )
        config = self._failover_settings(old, new, fence=not crash)
        if crash:
            self.stack.node(old).stop("immediate")
        began = time.monotonic()
        result = run_promote(config, new, *(["--force"] if crash else []))
        if result.returncode != 0:
            raise SystemExit(f"promote failed:\n{result.stdout}{result.stderr}")
        self.promote_s.append(time.monotonic() - began)
        self.roles = {"primary": new, "standby": old}
        self.stack.rejoin_as_standby(old, new)

    def _failover_settings(self, old: str, new: str, fence: bool) -> Path:
        code = (
            "import sys; from pathlib import Path; from slotbridge_dev.stack.stack import "
            "Stack; sys.exit(0 if Stack(Path(sys.argv[1])).node(sys.argv[2]).stop('fast') "
            "else 1)"
        )
        settings: dict[str, Any] = {
            "primary": {"dsn": self.stack.node(old).dsn},
            "standbys": {new: {"dsn": self.stack.node(new).dsn}},
            "bridge_slots": [self.pipe.name],
            "log_format": "text",
            "catchup_timeout_s": 60,
        }
        if fence:
            settings["fence_command"] = [sys.executable, "-c", code, str(self.stack.state_dir), old]
        path = self.work / "failover.json"
        path.write_text(json.dumps(settings))  # JSON is YAML
        return path

    # -- the run ----------------------------------------------------------------------

    def minute(self, started: float) -> None:
        line = {
            "minute": round((time.monotonic() - started) / 60),
            "committed": self.mix.committed,
            "lag_bytes": self.lag_bytes(),
            "rss_mb": round(rss, 1) if (rss := self.rss_mb()) is not None else None,
            "children_rss_mb": (
                round(kids, 1) if (kids := self.children_rss_mb()) is not None else None
            ),
            "faults": sum(self.faults.values()),
        }
        self.minutes.append(line)
        _say(", ".join(f"{k}={v}" for k, v in line.items()))

    def run(self, minutes: float, every_s: float) -> None:
        self.mix.create()
        self.pipe.start()
        self.wait_streaming(0)
        self.wait_caught_up()
        self.mix.start()
        started = time.monotonic()
        next_fault, next_minute, n = started + every_s, started + 60, 0
        while time.monotonic() - started < minutes * 60:
            now = time.monotonic()
            if now >= next_fault:
                fault = self.rotation[n % len(self.rotation)]
                _say(f"fault {n + 1}: {fault}")
                self.inject(fault)
                n, next_fault = n + 1, time.monotonic() + every_s
            if now >= next_minute:
                self.minute(started)
                next_minute += 60
            self.check_bridge()
            time.sleep(0.5)
        self.mix.stop()
        self.wait_caught_up()
        if self.pipe.stop(STALL_S) != 0:
            raise SystemExit(f"bridge did not stop cleanly:\n{self.tail()}")

    def verdict(self) -> dict[str, Any]:
        topics = [self.pipe.topic(f"public.{t}") for t in TABLES]
        records = read_topics(self.stack.kafka, topics, stall_s=120)
        with psycopg.connect(self.primary().dsn) as conn:
            rows: dict[str, dict[int, int]] = {
                t: dict(conn.execute(f"SELECT id, {_value(t)} FROM {t}").fetchall()) for t in TABLES
            }
        history = [r for r in records if r.topic == topics[-1] and r.value is not None]
        ids = [r.value["after"]["id"] for r in history]
        table_ids = set(rows["history"])
        report = audit(self.stack.kafka, self.pipe.prefix, [self.pipe.progress_topic])
        for problem in report.problems[:20]:
            _say(f"AUDIT: {problem}")
        rss = [m["rss_mb"] for m in self.minutes if m["rss_mb"] is not None]
        kids = [m["children_rss_mb"] for m in self.minutes if m["children_rss_mb"] is not None]
        return {
            "transactions": self.mix.committed,
            "client_errors": self.mix.errors,
            "faults": dict(self.faults),
            "lost": len(table_ids - set(ids)),
            "duplicated": len(ids) - len(set(ids)),
            "extra": len(set(ids) - table_ids),
            "out_of_order": _out_of_order(records),
            "last_value_differs": _last_value_differs(records, topics, rows),
            "audit_problems": len(report.problems),
            "audit_committed": report.committed,
            "max_lag_bytes": max((m["lag_bytes"] or 0 for m in self.minutes), default=0),
            "takeover_s": [round(s, 1) for s in self.takeover_s],
            "promote_s": [round(s, 1) for s in self.promote_s],
            "rss_mb_first_last_max": [
                round(rss[0], 1) if rss else None,
                round(rss[-1], 1) if rss else None,
                round(max(rss), 1) if rss else None,
            ],
            "children_rss_mb_max": round(max(kids), 1) if kids else None,
        }


def _value(table: str) -> str:
    return "delta" if table == "history" else "balance"


def _out_of_order(records: list[Record]) -> int:
    """Stream records of a key whose commit LSN is below the key's previous record's."""
    last: dict[tuple[str, str], int] = {}
    bad = 0
    for record in records:
        if record.value is None or record.value["op"] == "r":
            continue  # snapshot rows are reconciled by key, not ordered by commit
        key = (record.topic, json.dumps(record.key, sort_keys=True))
        lsn = int(record.value["source"]["commit_lsn"])
        if lsn < last.get(key, 0):
            bad += 1
        last[key] = lsn
    return bad


def _last_value_differs(
    records: list[Record], topics: list[str], rows: dict[str, dict[int, int]]
) -> int:
    latest: dict[tuple[str, int], int] = {}
    for record in records:
        if record.value is not None and record.value.get("after") is not None:
            table = TABLES[topics.index(record.topic)]
            after = record.value["after"]
            latest[(table, after["id"])] = int(after[_value(table)])
    return sum(
        1
        for table in TABLES
        for key, value in rows[table].items()
        if latest.get((table, key)) != value
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=60)
    parser.add_argument("--fault-every-s", type=float, default=120)
    parser.add_argument("--rate", type=float, default=100, help="source transactions/s")
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"the rotation, comma-separated (default: all of {', '.join(FAULTS)})",
    )
    parser.add_argument("--stack-dir", type=Path, default=Path("/tmp/slotbridge-soak"))
    parser.add_argument("--keep-stack", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rotation = args.faults.split(",")
    if unknown := sorted(set(rotation) - set(FAULTS)):
        parser.error(f"unknown fault {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    args.stack_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(args.stack_dir, 0o755)
    stack = Stack(args.stack_dir / "stack")
    stack.up()
    soak = Soak(stack, args.stack_dir, args.rate, rotation)
    finished = False
    try:
        soak.run(args.minutes, args.fault_every_s)
        result = soak.verdict()
        finished = True
    finally:
        soak.mix.stop()
        if not finished:
            soak.dump_stacks()
        soak.pipe.kill()
        soak.proxy.stop()
        # A run that broke off keeps its servers' logs and data: they are the evidence.
        if finished and not args.keep_stack:
            stack.down(purge=True)
            shutil.rmtree(args.stack_dir / "stack", ignore_errors=True)
            _say(f"stopped and removed the stack in {args.stack_dir / 'stack'}")
        else:
            stack.down()
            _say(f"stopped the stack, kept in {args.stack_dir} with the bridge's log")
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    bad = ("lost", "duplicated", "extra", "out_of_order", "last_value_differs", "audit_problems")
    return 1 if any(result[k] for k in bad) else 0


if __name__ == "__main__":
    sys.exit(main())
