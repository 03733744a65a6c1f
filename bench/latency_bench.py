"""Insert-to-visible latency of the bridge at a steady write rate, on the local stack.

    python bench/latency_bench.py [--rate 5000] [--txn-rows 50] [--seconds 30] [--warm-up 0]
                                  [--modes new,old] [--stack-dir .stack/bench] [--keep-stack]
                                  [--json]

For each mode, on a fresh table, publication, slot and topics: the real daemon
(``python -m services.cli run`` of this checkout) streams the table; a writer commits
``--txn-rows``-row transactions at ``--rate`` rows/s for ``--seconds``, every row holding
``clock_timestamp()`` of its insert; a read_committed consumer of the change topic takes,
per row, its receive time minus that timestamp (server and bench share the machine's
clock). Printed: p50/p90/p99/max and the rows received, which must equal the rows written.
With ``--warm-up``, the same write runs that many seconds first and is not counted.

Modes: ``new`` is the daemon as configured by default (a batch is committed as soon as no
further transaction is ready); ``old`` sets ``batch_linger_ms`` to ``batch_max_ms``, the
behaviour before it existed: every batch stays open for its full time budget.

Figures, not assertions: the machine is shared, so run it a few times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from prometheus_client.parser import text_string_to_metric_families

from bench.bridge_bench import (
    add_stack_arguments,
    bench_stack,
    daemon_env,
    drop_pipeline,
    free_port,
    metrics_text,
    say,
    stop_process,
)
from bench.workloads import OLTP_CHANGES_PER_TXN, Oltp
from services.bridge.settings import BridgeSettings

ROOT = Path(__file__).resolve().parents[1]
BATCH_MAX_MS = BridgeSettings.model_fields["batch_max_ms"].default
MODES = {"new": {}, "old": {"SLOTBRIDGE_BATCH_LINGER_MS": str(BATCH_MAX_MS)}}


def _percentile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _after(value: Any) -> Any:
    """The row image of one of the bridge's change records."""
    return value["after"]


def inserted_at(after: Callable[[Any], Any] = _after) -> Callable[[Any], datetime]:
    """When a row of the bench's table was inserted: its ``ts``, in the row ``after`` finds
    in a record's decoded value."""
    return lambda value: datetime.fromisoformat(after(value)["ts"])


def _history_mtime(value: Any) -> datetime:
    """pgbench_history's ``mtime`` (a timestamp, written in UTC: see ``run_oltp``)."""
    return datetime.fromisoformat(value["after"]["mtime"]).replace(tzinfo=UTC)


_INSERTED_AT = inserted_at()


def _source_commit(value: Any) -> float:
    """A change record's source commit time (``source.ts_ms``, the pgoutput Commit's), in
    seconds since the epoch."""
    return float(value["source"]["ts_ms"]) / 1000


class Receiver(threading.Thread):
    """Reads the change topic (read_committed) and keeps each row's delay in seconds;
    ``stamp`` finds when the row was written in a record's decoded value. With
    ``commit_delays``, each record's delay from its source commit too (``source.ts_ms``:
    what a row written at a transaction's start cannot tell)."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        stamp: Callable[[Any], datetime] = _INSERTED_AT,
        *,
        commit_delays: bool = False,
    ) -> None:
        super().__init__(daemon=True)
        self.stamp = stamp
        self.commit_delays: list[float] | None = [] if commit_delays else None
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"lat-{topic}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 5,
                "fetch.error.backoff.ms": 5,
            }
        )
        self.consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        self.delays: list[float] = []
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_flag.is_set():
                msg = self.consumer.poll(0.05)
                value = None if msg is None else msg.value()
                if msg is None or value is None:
                    continue
                received = time.time()
                if msg.error() is not None:
                    raise RuntimeError(f"consumer: {msg.error()}")
                decoded = json.loads(value)
                self.delays.append(received - self.stamp(decoded).timestamp())
                if self.commit_delays is not None:
                    self.commit_delays.append(received - _source_commit(decoded))
        except BaseException as exc:  # reported by the caller
            self.error = exc
        finally:
            self.consumer.close()


def _wait_for_topic(bootstrap: str, topic: str, timeout: float) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout
    while topic not in admin.list_topics(timeout=10).topics:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{topic} was not created within {timeout:.0f}s")
        time.sleep(0.1)


def _write(dsn: str, table: str, rate: int, txn_rows: int, seconds: float) -> tuple[int, float]:
    """Commit ``txn_rows``-row transactions on a fixed schedule; returns (rows, seconds)."""
    interval = txn_rows / rate
    count = int(seconds / interval)
    insert = f"INSERT INTO {table} (pad) SELECT 'row ' || g FROM generate_series(1, {txn_rows}) g"
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.monotonic()
        for i in range(count):
            # Behind schedule (a slow commit), the next one goes at once: the rate holds.
            delay = started + i * interval - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            conn.execute(insert)
        return count * txn_rows, time.monotonic() - started


def create_table(dsn: str, table: str, publication: str) -> None:
    """The bench's table, whose ``ts`` is each row's clock_timestamp() at its insert, and a
    publication of it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"CREATE TABLE {table} (id bigserial PRIMARY KEY, "
            "ts timestamptz NOT NULL DEFAULT clock_timestamp(), pad text)"
        )
        conn.execute(f"CREATE PUBLICATION {publication} FOR TABLE {table}")


def wait_streaming(
    log_path: Path, marker: str, alive: Callable[[], None], timeout: float = 60
) -> None:
    """Until the CDC process's log holds ``marker``; ``alive()`` raises if it failed."""
    deadline = time.monotonic() + timeout
    while marker not in log_path.read_text():
        alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"not streaming after {timeout:.0f}s; see {log_path}")
        time.sleep(0.05)


def _arrived(
    receiver: Receiver, count: int, timeout: float, alive: Callable[[], None], what: str
) -> bool:
    """Whether ``receiver`` holds ``count`` rows within ``timeout`` seconds; raises if the
    CDC process (``alive()``) or the consumer failed."""
    deadline = time.monotonic() + timeout
    while len(receiver.delays) < count and time.monotonic() < deadline:
        alive()
        if receiver.error is not None:
            raise RuntimeError(f"{what}: the consumer failed ({receiver.error})")
        time.sleep(0.05)
    return len(receiver.delays) >= count


def measure(
    args: argparse.Namespace,
    dsn: str,
    bootstrap: str,
    table: str,
    topic: str,
    what: str,
    alive: Callable[[], None],
    stamp: Callable[[Any], datetime] = _INSERTED_AT,
) -> dict[str, Any]:
    """The delays through a CDC process streaming ``table`` into ``topic``: a warm-up row
    (which also has the topic created), the same write as measured for ``args.warm_up``
    seconds, not counted, then ``args.rate`` rows/s in ``args.txn_rows``-row transactions for
    ``args.seconds``, every row of which must arrive. ``alive()`` raises if the process
    failed; ``stamp`` is the Receiver's."""

    def arrived(count: int, timeout: float) -> bool:
        return _arrived(receiver, count, timeout, alive, what)

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {table} (pad) VALUES ('warm-up')")
    _wait_for_topic(bootstrap, topic, 60)
    receiver = Receiver(bootstrap, topic, stamp)
    receiver.start()
    try:
        if not arrived(1, 30):
            raise TimeoutError(f"{what}: no warm-up row within 30s")
        if args.warm_up > 0:
            say(f"{what}: warming up, {args.rate:,} rows/s for {args.warm_up:.0f}s")
            warm_rows, _ = _write(dsn, table, args.rate, args.txn_rows, args.warm_up)
            if not arrived(1 + warm_rows, 60):
                raise TimeoutError(f"{what}: the warm-up rows did not all arrive within 60s")
        receiver.delays.clear()
        say(
            f"{what}: writing {args.rate:,} rows/s in {args.txn_rows}-row transactions "
            f"for {args.seconds:.0f}s"
        )
        rows, write_s = _write(dsn, table, args.rate, args.txn_rows, args.seconds)
        arrived(rows, 60)
    finally:
        receiver.stop_flag.set()
        receiver.join(10)
    return _figures(what, receiver.delays, rows, rows / write_s)


_PERCENTILES = ("p50_ms", "p90_ms", "p99_ms", "max_ms")


def _figures(what: str, delays: list[float], rows: int, rate: float) -> dict[str, Any]:
    """Percentiles of the rows' delays; every row written must have arrived."""
    delays = sorted(delays)
    if len(delays) != rows:
        raise RuntimeError(f"{what}: received {len(delays)} rows, wrote {rows}")
    return {
        "rows": rows,
        "write_rows_per_s": rate,
        "p50_ms": _percentile(delays, 0.50) * 1000,
        "p90_ms": _percentile(delays, 0.90) * 1000,
        "p99_ms": _percentile(delays, 0.99) * 1000,
        "max_ms": delays[-1] * 1000,
        "mean_ms": statistics.fmean(delays) * 1000,
    }


def start_daemon(
    env: dict[str, str], log_path: Path
) -> tuple[subprocess.Popen[bytes], Callable[[], None]]:
    """This checkout's daemon with ``env``, its output in ``log_path``; and a check that
    raises if it has exited."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "run"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    def alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"the daemon exited with {proc.returncode}; see {log_path}")

    return proc, alive


def run_mode(
    mode: str, args: argparse.Namespace, dsn: str, bootstrap: str, work: Path
) -> dict[str, Any]:
    tag = f"lat{mode}{int(time.time()) % 1_000_000}"
    table, prefix = f"bench_{tag}", f"bench.{tag}"
    create_table(dsn, table, tag)
    log_path = work / f"{tag}.log"
    env = {
        **daemon_env(dsn, bootstrap, tag, tag, [f"public.{table}"], prefix, work / "spool"),
        **MODES[mode],
    }
    try:
        proc, alive = start_daemon(env, log_path)
        try:
            # The daemon creates the topic for the warm-up row once it streams.
            wait_streaming(log_path, "streaming", alive)
            result = measure(args, dsn, bootstrap, table, f"{prefix}.public.{table}", mode, alive)
        finally:
            stop_process(proc)
    finally:
        if not args.keep:
            drop_pipeline(dsn, bootstrap, [tag], [tag], tag, f"TABLE IF EXISTS {table}", prefix)
    return {"mode": mode, **result}


def run_oltp(args: argparse.Namespace, dsn: str, bootstrap: str, work: Path) -> dict[str, Any]:
    """The OLTP mix at ``args.rate`` changes/s: pgbench's TPC-B-like script (three UPDATEs
    and an INSERT into pgbench_history per transaction) rate-limited to a quarter of that in
    transactions, by 8 clients, for ``args.seconds``. A history row's ``mtime`` is its
    transaction's start, so its delay is start-to-visible: commit-to-visible plus the few
    milliseconds a four-statement transaction takes (on a loaded machine, more). Also each
    row's commit-to-visible, from its record's ``source.ts_ms``: what the goal names."""
    tag = f"latoltp{int(time.time()) % 1_000_000}"
    schema, prefix = f"bench_{tag}", f"bench.{tag}"
    oltp = OLTP
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    oltp.prefill(dsn, schema, 0)
    tables = [f"{schema}.{t}" for t in oltp.tables]
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE PUBLICATION {tag} FOR TABLE {', '.join(tables)}")
    log_path = work / f"{tag}.log"
    env = daemon_env(dsn, bootstrap, tag, tag, tables, prefix, work / "spool")
    env["SLOTBRIDGE_TRANSACTION_METADATA"] = str(not args.no_transaction_metadata).lower()
    http_port = free_port()
    env["SLOTBRIDGE_HTTP_PORT"] = str(http_port)
    topic = f"{prefix}.{schema}.pgbench_history"
    try:
        proc, alive = start_daemon(env, log_path)
        try:
            wait_streaming(log_path, "streaming", alive)
            before = metrics_text(http_port)
            result = _oltp_delays(args, dsn, bootstrap, schema, topic, alive)
            after = metrics_text(http_port)
            return {
                "mode": "oltp",
                **result,
                **_daemon_quantiles(commit_to_visible(before), commit_to_visible(after)),
                **_kafka_figures(kafka_transactions(before), kafka_transactions(after)),
            }
        finally:
            stop_process(proc)
    finally:
        if not args.keep:
            drop_pipeline(
                dsn, bootstrap, [tag], [tag], tag, f"SCHEMA IF EXISTS {schema} CASCADE", prefix
            )


def kafka_transactions(text: str) -> tuple[float, float]:
    """The daemon's Kafka transactions so far: how many, and the seconds their flush and
    commit took in all."""
    count = total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "slotbridge_kafka_transaction_seconds":
            for sample in family.samples:
                if sample.name.endswith("_count"):
                    count = sample.value
                elif sample.name.endswith("_sum"):
                    total = sample.value
    return count, total


def commit_to_visible(text: str) -> dict[float, float]:
    """The daemon's ``slotbridge_commit_to_visible_seconds`` buckets: upper bound ->
    source transactions at or under it."""
    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "slotbridge_commit_to_visible_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[float(sample.labels["le"])] = sample.value
    return buckets


def _daemon_quantiles(before: dict[float, float], after: dict[float, float]) -> dict[str, Any]:
    """p50 and p99 of the daemon's own source commit -> Kafka commit histogram over the run
    (the warm-up's transactions taken out), each as the bucket bound it falls under: the
    part of the delay that pgbench's lock waits and the consumer's fetch are not in."""
    counts = {bound: after[bound] - before.get(bound, 0.0) for bound in sorted(after)}
    total = counts.get(float("inf"), 0.0)

    def under(q: float) -> float:
        return next((b for b, n in counts.items() if n >= q * total), float("inf"))

    return {
        "daemon_transactions": total,
        "daemon_p50_ms_at_most": under(0.50) * 1000,
        "daemon_p99_ms_at_most": under(0.99) * 1000,
    }


def _kafka_figures(before: tuple[float, float], after: tuple[float, float]) -> dict[str, Any]:
    """The daemon's Kafka transactions over the run: how many, and their mean flush and
    commit time: a source transaction waits for the batch it lands in to fill, then for
    its commit, so these two say where its delay goes."""
    count, seconds = after[0] - before[0], after[1] - before[1]
    return {
        "kafka_transactions": count,
        "kafka_commit_mean_ms": seconds / count * 1000 if count else 0.0,
    }


def _oltp_delays(
    args: argparse.Namespace,
    dsn: str,
    bootstrap: str,
    schema: str,
    topic: str,
    alive: Callable[[], None],
) -> dict[str, Any]:
    def history_rows() -> int:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(f"SELECT count(*) FROM {schema}.pgbench_history").fetchone()
            assert row is not None
            return int(row[0])

    # One transaction first, so the daemon has made the topic the receiver reads; its row
    # must have arrived before the load starts: a consumer still connecting held the load's
    # first half second of rows and gave them all at once, which was the p99 at any rate.
    OLTP.run_pgbench(dsn, schema, "-n", "-t", "1", "-c", "1")
    _wait_for_topic(bootstrap, topic, 60)
    receiver = Receiver(bootstrap, topic, _history_mtime, commit_delays=True)
    receiver.start()
    try:
        if not _arrived(receiver, 1, 30, alive, "oltp"):
            raise TimeoutError("oltp: the warm-up transaction's row did not arrive within 30s")
        before = history_rows()
        tps = max(1, args.rate // OLTP_CHANGES_PER_TXN)
        say(f"oltp: {tps:,} transactions/s ({args.rate:,} changes/s) for {args.seconds:.0f}s")
        started = time.monotonic()
        OLTP.run_pgbench(
            dsn, schema, "-n", "-R", str(tps), "-T", str(int(args.seconds)), "-c", "8", "-j", "2"
        )
        write_s = time.monotonic() - started
        rows = history_rows() - before
        _arrived(receiver, rows + 1, 60, alive, "oltp")
    finally:
        receiver.stop_flag.set()
        receiver.join(10)
    # The first transaction's row is the warm-up.
    figures = _figures("oltp", receiver.delays[1:], rows, rows * OLTP_CHANGES_PER_TXN / write_s)
    assert receiver.commit_delays is not None
    from_commit = _figures("oltp", receiver.commit_delays[1:], rows, 0.0)
    return {**figures, **{f"commit_{k}": from_commit[k] for k in _PERCENTILES}}


OLTP = Oltp()


def add_rate_arguments(parser: argparse.ArgumentParser, warm_up: float = 0) -> None:
    """The steady write's options, as ``measure`` reads them (``warm_up``: --warm-up's
    default)."""
    parser.add_argument("--rate", type=int, default=5000, help="rows per second")
    parser.add_argument("--txn-rows", type=int, default=50, help="rows per transaction")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument(
        "--warm-up",
        type=float,
        default=warm_up,
        help="seconds of the same write before the measured one, not counted",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_rate_arguments(parser)
    parser.add_argument(
        "--modes",
        default="new,old",
        help=f"comma-separated, of {', '.join(MODES)} (see the module doc)",
    )
    add_stack_arguments(parser)
    parser.add_argument(
        "--workload",
        choices=("insert", "oltp"),
        default="insert",
        help="insert: --txn-rows-row inserts, in each of --modes; oltp: pgbench's mix at "
        "--rate changes/s, the default mode",
    )
    parser.add_argument(
        "--no-transaction-metadata",
        action="store_true",
        help="oltp: the daemon writes no transaction topic (transaction_metadata: false)",
    )
    parser.add_argument("--keep", action="store_true", help="keep tables, slots and topics")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")

    with bench_stack(args) as stack:
        work = args.stack_dir / "latency-bench"
        work.mkdir(parents=True, exist_ok=True)
        if args.workload == "oltp":
            results = [run_oltp(args, stack.primary_dsn, stack.kafka_bootstrap, work)]
        else:
            results = [
                run_mode(mode, args, stack.primary_dsn, stack.kafka_bootstrap, work)
                for mode in modes
            ]
    if args.json:
        print(json.dumps(results, indent=2))
        return
    what = (
        f"pgbench's mix, {args.rate:,} changes/s: transaction start"
        if args.workload == "oltp"
        else f"{args.rate:,} rows/s in {args.txn_rows}-row transactions: insert"
    )
    print(f"\n{what} -> read_committed consumer, {args.seconds:.0f}s")
    print(
        f"{'mode':6} {'rows':>8} {'rows/s':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}"
        f" {'max ms':>8}"
    )
    for r in results:
        print(
            f"{r['mode']:6} {r['rows']:8,} {r['write_rows_per_s']:8,.0f} {r['p50_ms']:8.1f}"
            f" {r['p90_ms']:8.1f} {r['p99_ms']:8.1f} {r['max_ms']:8.1f}"
        )
        if "commit_p99_ms" in r:
            print(
                f"       the same rows from their source commit (source.ts_ms, in ms): p50"
                f" {r['commit_p50_ms']:.1f}, p90 {r['commit_p90_ms']:.1f}, p99"
                f" {r['commit_p99_ms']:.1f}, max {r['commit_max_ms']:.1f} ms"
            )
        if "daemon_transactions" in r:
            print(
                f"       the daemon's own source commit -> Kafka commit, over"
                f" {r['daemon_transactions']:,.0f} transactions: p50 <= "
                f"{r['daemon_p50_ms_at_most']:.0f} ms, p99 <= {r['daemon_p99_ms_at_most']:.0f} ms"
            )
            per_batch = r["daemon_transactions"] / max(1.0, r["kafka_transactions"])
            print(
                f"       in {r['kafka_transactions']:,.0f} Kafka transactions ({per_batch:,.1f}"
                f" source transactions each), flush + commit {r['kafka_commit_mean_ms']:.1f} ms"
                " on average"
            )


if __name__ == "__main__":
    main()
