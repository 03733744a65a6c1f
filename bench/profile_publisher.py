"""The publisher thread's hot path without a server: spool -> decode -> records.

    python bench/profile_publisher.py [--rows 200000] [--txn-size 1000] [--repeat 3]
                                      [--workload insert|oltp|wide]
                                      [--format slotbridge|debezium]
                                      [--spill] [--profile] [--top 20]

Builds the pgoutput payloads ``bench/bridge_bench.py`` makes the server send (``insert``:
inserts into ``id bigint pk, a int, b text, c numeric, d timestamptz``; ``oltp``: pgbench's
TPC-B-like transactions, three single-row updates and an insert over its four tables,
``--txn-size`` ignored; ``wide``: ``bench/workloads.py``'s 40-column row with jsonb,
arrays, bytea and a 6 kB text, each transaction half inserts and half updates that leave
the text unchanged, so it is sent as an unchanged TOAST value), puts each transaction in a
``Spool`` (``--spill``: an 8 MB memory limit, so a big transaction goes to disk as in the
daemon), and runs ``Publisher._publish`` over them with a sink that only counts: everything
the publisher thread does per row but talk to Kafka. Prints rows/s and the CPU time per
source transaction (best of ``--repeat``); ``--profile`` prints the top functions by
cumulative and own time.

``--loop`` runs the publisher thread's whole loop instead (``Publisher._loop``, in this
thread): every transaction queued first, then taken off the ``TxnQueue`` one by one into
batches that are committed (the progress record, the origin, the confirm tracker, the
metrics) as the daemon's are under a backlog. What it adds to ``_publish`` is the cost of
a source transaction that does not grow with its rows.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import pstats
import struct
import sys
import tempfile
import time
from collections.abc import Container, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.bridge.assemble.assembler import Transaction
from services.bridge.assemble.spool import Spool, SpoolStats
from services.bridge.decode.decoder import PgOutputDecoder
from services.bridge.metrics import BridgeMetrics
from services.bridge.progress.confirm import ConfirmTracker
from services.bridge.progress.highwater import ServerIdentity
from services.bridge.publish.publisher import Publisher, TxnQueue
from services.bridge.records.catalog import ColumnFacts, RelationCatalog, TableFacts
from services.bridge.records.debezium import DebeziumEventBuilder
from services.bridge.records.default import DefaultEventBuilder
from services.bridge.records.events import Record
from services.bridge.settings import BridgeSettings
from services.bridge.snapshot.reader import SnapshotBook
from services.common.collector import freeze_startup_objects, space_out_collections

OID = 16_384
Columns = tuple[tuple[str, int, int], ...]  # name, type oid, key flag
COLUMNS: Columns = (("id", 20, 1), ("a", 23, 0), ("b", 25, 0), ("c", 1700, 0), ("d", 1184, 0))
# pgbench's tables (pgbench_history with the key the bench gives it), from OID + 1 on.
OLTP_TABLES: dict[str, Columns] = {
    "pgbench_accounts": (("aid", 23, 1), ("bid", 23, 0), ("abalance", 23, 0), ("filler", 1042, 0)),
    "pgbench_tellers": (("tid", 23, 1), ("bid", 23, 0), ("tbalance", 23, 0), ("filler", 1042, 0)),
    "pgbench_branches": (("bid", 23, 1), ("bbalance", 23, 0), ("filler", 1042, 0)),
    "pgbench_history": (
        *(("hid", 20, 1), ("tid", 23, 0), ("bid", 23, 0), ("aid", 23, 0), ("delta", 23, 0)),
        *(("mtime", 1114, 0), ("filler", 1042, 0)),
    ),
}


# bench/workloads.py's wide table (WIDE_OID), its columns in the same order.
WIDE_OID = OID + 10
WIDE_COLUMNS: Columns = (
    ("id", 20, 1),
    *((f"n{i}", 23, 0) for i in range(8)),
    *((f"s{i}", 25, 0) for i in range(8)),
    *((f"m{i}", 1700, 0) for i in range(6)),
    *((f"ts{i}", 1184, 0) for i in range(6)),
    *(("attrs", 3802, 0), ("meta", 3802, 0), ("tags", 1009, 0), ("codes", 1007, 0)),
    *(("blob", 17, 0), ("flag", 16, 0), ("day", 1082, 0), ("amount", 701, 0)),
    *(("ref", 2950, 0), ("doc", 25, 0)),
)


def _relation(oid: int = OID, name: str = "bench", columns: Columns = COLUMNS) -> bytes:
    cols = b"".join(
        struct.pack("!B", key) + column.encode() + b"\0" + struct.pack("!Ii", type_oid, -1)
        for column, type_oid, key in columns
    )
    head = b"R" + struct.pack("!I", oid) + b"public\0" + name.encode() + b"\0d"
    return head + struct.pack("!H", len(columns)) + cols


def _change(kind: bytes, oid: int, values: list[str | None]) -> bytes:
    """An Insert, or an Update sending no old row (REPLICA IDENTITY DEFAULT, key unchanged);
    None is a TOASTed value the update left unchanged."""
    out = [kind, struct.pack("!I", oid), b"N", struct.pack("!H", len(values))]
    for value in values:
        if value is None:
            out.append(b"u")
            continue
        raw = value.encode()
        out.append(b"t" + struct.pack("!I", len(raw)) + raw)
    return b"".join(out)


def _insert(i: int) -> bytes:
    return _change(
        b"I",
        OID,
        [
            str(i),
            str(i % 100_000),
            f"customer {i} note",
            f"{i * 1.25:.2f}",
            f"2024-01-{1 + i // 86_400 % 28:02d} {i // 3600 % 24:02d}:{i // 60 % 60:02d}:"
            f"{i % 60:02d}+00",
        ],
    )


def _oltp(i: int) -> list[bytes]:
    """pgbench's transaction number ``i``: an account, a teller and a branch updated, a
    history row inserted."""
    accounts, tellers, branches, history = range(OID + 1, OID + 5)
    aid, tid, bid, delta = 1 + i * 7919 % 100_000, 1 + i % 10, 1, (i * 31) % 10_001 - 5000
    return [
        _change(b"U", accounts, [str(aid), str(bid), str(delta), " " * 84]),
        _change(b"U", tellers, [str(tid), str(bid), str(delta), " " * 84]),
        _change(b"U", branches, [str(bid), str(delta), " " * 88]),
        _change(
            b"I",
            history,
            [str(i), str(tid), str(bid), str(aid), str(delta), "2024-01-02 03:04:05.123456", ""],
        ),
    ]


def _wide_row(g: int, doc: str | None) -> list[str | None]:
    """Row ``g`` as bench/workloads.py's wide row prints it (the same kinds of text)."""
    digest = hashlib.md5(str(g).encode()).hexdigest()
    return [
        str(g),
        *(str(g * (i + 3) % 100_000) for i in range(8)),
        *(f"value {g} of s{i}" for i in range(8)),
        *(f"{g * (i + 1) * 1.0625:.4f}" for i in range(6)),
        *(
            f"2024-01-{1 + (g + i) // 1440 % 28:02d} {(g + i) // 60 % 24:02d}:"
            f"{(g + i) % 60:02d}:00+00"
            for i in range(6)
        ),
        f'{{"id": {g}, "name": "item {g}", "price": {g * 0.5}, "labels": ["a", "b", {g % 7}],'
        f' "nested": {{"x": {g % 13}}}}}',
        f'{{"rev": {g % 5}, "source": "bench"}}',
        f"{{red,green,tag{g % 11}}}",
        f"{{{g % 3},{g % 5},{g % 7}}}",
        "\\x" + digest,
        "t" if g % 2 == 0 else "f",
        f"2024-{1 + g % 12:02d}-{1 + g % 28:02d}",
        str(g * 1.5),
        f"{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:]}",
        doc,
    ]


def _wide(first: int, count: int) -> list[bytes]:
    """A wide transaction of ``count`` changes: rows inserted from ``first`` on (the odd
    one out among them), and stored rows updated, their 6 kB text left alone."""
    half = count // 2
    inserts = [
        _change(
            b"I",
            WIDE_OID,
            _wide_row(
                g,
                "".join(hashlib.md5(str(g * 1000 + k).encode()).hexdigest() for k in range(1, 191)),
            ),
        )
        for g in range(first, first + count - half)
    ]
    updates = [_change(b"U", WIDE_OID, _wide_row(-g, None)) for g in range(first, first + half)]
    return inserts + updates


class _CountingSink:
    """A ``publisher.Sink`` that counts what it is given; only ``produce_all`` is on the
    measured path (``_publish`` neither begins nor commits)."""

    def __init__(self) -> None:
        self.records = 0
        self.bytes = 0

    def begin(self) -> None:
        pass

    def produce(self, topic: str, key: bytes | None, value: bytes | None) -> None:
        self.produce_all([(topic, key, value, None)], ())

    def produce_all(self, records: Iterable[Record], compacted: Container[str]) -> int:
        before = self.records
        for _topic, _key, value, _headers in records:
            self.records += 1
            self.bytes += len(value) if value is not None else 0
        return self.records - before

    def commit(self) -> float:
        return 0.0

    def abort(self) -> None:
        pass

    def topic_ids(self) -> dict[str, str]:
        return {}

    def prove_not_fenced(self) -> None:
        pass


class _Origin:
    def advance(self, lsn: int) -> None:
        pass


def _tables(workload: str) -> dict[int, tuple[str, Columns]]:
    """The workload's tables by oid: name and columns."""
    if workload == "oltp":
        return {OID + 1 + n: table for n, table in enumerate(OLTP_TABLES.items())}
    if workload == "wide":
        return {WIDE_OID: ("wide", WIDE_COLUMNS)}
    return {OID: ("bench", COLUMNS)}


def _transactions(
    workload: str, rows: int, txn_size: int, memory: int, folder: Path
) -> list[Transaction]:
    stats = SpoolStats()
    relations = [
        _relation(oid, name, columns) for oid, (name, columns) in _tables(workload).items()
    ]
    if workload == "oltp":
        changes = [_oltp(n) for n in range(rows // 4)]
    elif workload == "wide":
        changes = [
            _wide(first + 1, min(txn_size, rows - first)) for first in range(0, rows, txn_size)
        ]
    else:
        changes = [
            [_insert(i + 1) for i in range(first, min(first + txn_size, rows))]
            for first in range(0, rows, txn_size)
        ]
    txns = []
    lsn = 0x1_0000_0000
    for n, payloads in enumerate(changes):
        spool = Spool(folder, f"txn-{n}", memory, stats)
        described = relations if n == 0 else []
        for payload in (*described, *payloads):
            lsn += 120
            spool.append(lsn, payload)
        txns.append(
            Transaction(
                1000 + n,
                lsn + 120,
                lsn + 168,
                785_000_000_000_000 + n,
                spool,
                False,
                frozenset(),
                relations=tuple(described),
            )
        )
        lsn += 168
    return txns


def _run(
    workload: str, value_format: str, rows: int, txn_size: int, memory: int, loop: bool
) -> tuple[float, float, int, _CountingSink]:
    """rows/s, CPU seconds, source transactions and the sink of one pass."""
    tables = _tables(workload)

    def facts(oid: int) -> TableFacts:
        _, columns = tables[oid]
        return TableFacts(
            {n: ColumnFacts(str(t), not key) for n, t, key in columns},
            tuple(n for n, _, key in columns if key),
        )

    catalog = RelationCatalog("bench", facts)
    builder = (
        DebeziumEventBuilder(catalog, "bench", "postgres", 1_000_000, None)
        if value_format == "debezium"
        else DefaultEventBuilder(catalog, "bench", "postgres", 1_000_000)
    )
    decoder = PgOutputDecoder(4, parallel_abort=True)
    sink = _CountingSink()
    settings = BridgeSettings(
        source_dsn="host=bench", kafka_bootstrap="bench:9092", slot_name="bench"
    )
    queue = TxnQueue(1 << 20)
    publisher = Publisher(
        settings=settings,
        sink=sink,
        origin=_Origin(),
        builder=builder,
        tracker=ConfirmTracker(0),
        identity=ServerIdentity("0", 1),
        high_water=0,
        last_commit_lsn=0,
        queue=queue,
        decode=lambda payload, streamed: decoder.decode(payload, streamed),
        metrics=BridgeMetrics(settings.slot_name, SpoolStats()),
        book=SnapshotBook(),
        snapshot_added=False,
        published=set,
    )
    with tempfile.TemporaryDirectory() as folder:
        txns = _transactions(workload, rows, txn_size, memory, Path(folder))
        if loop:
            queue.put_all(txns)
            queue.stop()  # the loop commits its last batch at the stop, and ends
        started, cpu = time.perf_counter(), time.process_time()
        if loop:
            publisher._loop()
        else:
            for txn in txns:
                publisher._publish(txn)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    return rows / seconds, cpu, len(txns), sink


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--txn-size", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--spill",
        action="store_true",
        help="8 MB spool memory limit (the daemon's default), else all in memory",
    )
    parser.add_argument("--workload", choices=("insert", "oltp", "wide"), default="insert")
    parser.add_argument("--format", choices=("slotbridge", "debezium"), default="slotbridge")
    parser.add_argument(
        "--loop",
        action="store_true",
        help="the publisher's whole loop (queue, batches, commits), not _publish alone",
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    space_out_collections()  # as the daemon does (services/bridge/cli.py)
    freeze_startup_objects()
    memory = 8 * 1024 * 1024 if args.spill else 1 << 40
    run = (args.workload, args.format, args.rows, args.txn_size, memory, args.loop)

    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(_run, *run)
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)
        return
    passes = [_run(*run) for _ in range(args.repeat)]
    rates = sorted(rate for rate, _, _, _ in passes)
    _, cpu, txns, sink = min(passes, key=lambda p: p[1])
    shape = (
        "pgbench's transactions"
        if args.workload == "oltp"
        else f"transactions of {args.txn_size:,}"
    )
    print(
        f"{args.format}: {args.rows:,} rows in {shape}"
        f"{' (spilled)' if args.spill else ''}{', whole loop' if args.loop else ''}: "
        f"best {rates[-1]:,.0f} rows/s, "
        f"median {rates[len(rates) // 2]:,.0f} rows/s; CPU {cpu / txns * 1e6:.1f} us per "
        f"source transaction, {cpu / args.rows * 1e6:.2f} us per row (least of {args.repeat}) "
        f"({sink.records:,} records, {sink.bytes / sink.records:.0f} B/value)"
    )


if __name__ == "__main__":
    main()
