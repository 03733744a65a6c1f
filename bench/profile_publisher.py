"""The publisher thread's hot path without a server: spool -> decode -> records.

    python bench/profile_publisher.py [--rows 200000] [--txn-size 1000] [--repeat 3]
                                      [--spill] [--profile] [--top 20]

Builds the pgoutput payloads ``bench/bridge_bench.py`` makes the server send (inserts
into ``id bigint pk, a int, b text, c numeric, d timestamptz``), puts each transaction
in a ``Spool`` (``--spill``: an 8 MB memory limit, so a big transaction goes to disk as
in the daemon), and runs ``Publisher._publish`` over them with a sink that only counts:
everything the publisher thread does per row but talk to Kafka. Prints rows/s (best
of ``--repeat``); ``--profile`` prints the top functions by cumulative and own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import struct
import sys
import tempfile
import time
from collections.abc import Container, Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.bridge.assembler import Transaction
from services.bridge.catalog import ColumnFacts, RelationCatalog, TableFacts
from services.bridge.confirm import ConfirmTracker
from services.bridge.decoder import PgOutputDecoder
from services.bridge.events import EventBuilder, Record
from services.bridge.highwater import ServerIdentity
from services.bridge.metrics import BridgeMetrics
from services.bridge.publisher import Publisher, TxnQueue
from services.bridge.settings import BridgeSettings
from services.bridge.snapshot import SnapshotBook
from services.bridge.spool import Spool, SpoolStats

OID = 16_384
COLUMNS = (("id", 20, 1), ("a", 23, 0), ("b", 25, 0), ("c", 1700, 0), ("d", 1184, 0))


def _relation() -> bytes:
    cols = b"".join(
        struct.pack("!B", key) + name.encode() + b"\0" + struct.pack("!Ii", oid, -1)
        for name, oid, key in COLUMNS
    )
    return (
        b"R" + struct.pack("!I", OID) + b"public\0bench\0d" + struct.pack("!H", len(COLUMNS)) + cols
    )


def _insert(i: int) -> bytes:
    values = [
        str(i),
        str(i % 100_000),
        f"customer {i} note",
        f"{i * 1.25:.2f}",
        f"2024-01-{1 + i // 86_400 % 28:02d} {i // 3600 % 24:02d}:{i // 60 % 60:02d}:"
        f"{i % 60:02d}+00",
    ]
    out = [b"I", struct.pack("!I", OID), b"N", struct.pack("!H", len(values))]
    for value in values:
        raw = value.encode()
        out.append(b"t" + struct.pack("!I", len(raw)) + raw)
    return b"".join(out)


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


def _transactions(rows: int, txn_size: int, memory: int, folder: Path) -> list[Transaction]:
    stats = SpoolStats()
    txns = []
    for n, first in enumerate(range(0, rows, txn_size)):
        spool = Spool(folder, f"txn-{n}", memory, stats)
        lsn = 0x1_0000_0000 + first * 120
        if n == 0:
            spool.append(lsn, _relation())
        for i in range(first, min(first + txn_size, rows)):
            spool.append(lsn + i * 120, _insert(i + 1))
        txns.append(
            Transaction(
                1000 + n,
                lsn + txn_size * 120,
                lsn + txn_size * 120 + 48,
                785_000_000_000_000 + n,
                spool,
                False,
                frozenset(),
                relations=(_relation(),) if n == 0 else (),
            )
        )
    return txns


def _run(rows: int, txn_size: int, memory: int) -> tuple[float, _CountingSink]:
    facts = TableFacts({n: ColumnFacts(str(t), n != "id") for n, t, _ in COLUMNS}, ("id",))
    builder = EventBuilder(
        RelationCatalog("bench", lambda oid: facts), "bench", "postgres", 1_000_000
    )
    decoder = PgOutputDecoder(4, parallel_abort=True)
    sink = _CountingSink()
    settings = BridgeSettings(
        source_dsn="host=bench", kafka_bootstrap="bench:9092", slot_name="bench"
    )
    publisher = Publisher(
        settings=settings,
        sink=sink,
        origin=_Origin(),
        builder=builder,
        tracker=ConfirmTracker(0),
        identity=ServerIdentity("0", 1),
        high_water=0,
        last_commit_lsn=0,
        queue=TxnQueue(1 << 20),
        decode=lambda payload, streamed: decoder.decode(payload, streamed),
        metrics=BridgeMetrics(settings.slot_name, SpoolStats()),
        book=SnapshotBook(),
        snapshot_added=False,
        published=set,
    )
    with tempfile.TemporaryDirectory() as folder:
        txns = _transactions(rows, txn_size, memory, Path(folder))
        started = time.perf_counter()
        for txn in txns:
            publisher._publish(txn)
        seconds = time.perf_counter() - started
    return rows / seconds, sink


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
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    memory = 8 * 1024 * 1024 if args.spill else 1 << 40

    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(_run, args.rows, args.txn_size, memory)
        stats = pstats.Stats(profiler)
        stats.sort_stats("cumulative").print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)
        return
    rates = []
    for _ in range(args.repeat):
        rate, sink = _run(args.rows, args.txn_size, memory)
        rates.append(rate)
    print(
        f"{args.rows:,} rows in transactions of {args.txn_size:,}"
        f"{' (spilled)' if args.spill else ''}: best {max(rates):,.0f} rows/s, "
        f"median {sorted(rates)[len(rates) // 2]:,.0f} rows/s "
        f"({sink.records:,} records, {sink.bytes / sink.records:.0f} B/value)"
    )


if __name__ == "__main__":
    main()
