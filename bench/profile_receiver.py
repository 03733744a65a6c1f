"""The socket thread's hot path without a server: CopyData messages -> sealed transactions.

    python bench/profile_receiver.py [--workload oltp|insert] [--transactions 50000]
                                     [--repeat 3] [--profile]

Builds the XLogData messages the server sends for ``bench/profile_publisher.py``'s
payloads (``oltp``: pgbench's transactions, three single-row updates and an insert;
``insert``: 1000-row transactions), with their Begin and Commit, and has
``TransactionReader.read`` take them from an in-memory stand-in for libpq's buffer, in
buffers of 64 kB, handing each read's transactions to a ``TxnQueue`` as the daemon does:
everything the socket thread does per message but the socket. Prints the CPU time per
source transaction and per message of the reference path (message by message through the
assembler) and of the compiled one (``decode._runs``), best of ``--repeat``. The stand-in
is a Python function, which psycopg's ``get_copy_data`` is not: its own cost is printed
too, and is part of both figures. The cyclic collector runs as the daemon's
(``space_out_collections``): with CPython's defaults its full collections walked the
queued transactions, which the bench keeps to the end, and the compiled path's `oltp`
figure was 12.6 us a source transaction instead of 5.2.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import struct
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_publisher import _insert, _oltp, _relation, _tables

from services.bridge.assemble import reader as reader_module
from services.bridge.assemble.assembler import Assembler
from services.bridge.assemble.reader import TransactionReader
from services.bridge.assemble.spool import Spool, SpoolStats
from services.bridge.decode.decoder import PgOutputDecoder
from services.bridge.publish.publisher import TxnQueue
from services.bridge.receive.stream import ReplicationConnection
from services.common.collector import freeze_startup_objects, space_out_collections

BUFFER = 64 * 1024  # what libpq holds after one read of the socket, at most
SPOOL_MEMORY = 8 * 1024 * 1024  # spool_memory_bytes' default


def _frames(workload: str, transactions: int) -> list[bytes]:
    """The stream's XLogData messages, LSNs in the server's order."""
    relations = [_relation(oid, name, cols) for oid, (name, cols) in _tables(workload).items()]
    frames = []
    lsn = 0x1_0000_0000
    for n in range(transactions):
        insert = [_insert(n * 1000 + i) for i in range(1000)] if workload == "insert" else []
        body = (relations if n == 0 else []) + (insert or _oltp(n))
        commit_lsn = lsn + 0x80 * (len(body) + 1)
        end_lsn = commit_lsn + 48
        ts = 785_000_000_000_000 + n
        frames.append(_xlog(lsn, b"B" + struct.pack("!QqI", commit_lsn, ts, 1000 + n)))
        for payload in body:
            lsn += 0x80
            frames.append(_xlog(lsn, payload))
        frames.append(_xlog(commit_lsn, b"C" + struct.pack("!BQQq", 0, commit_lsn, end_lsn, ts)))
        lsn = end_lsn
    return frames


def _xlog(lsn: int, payload: bytes) -> bytes:
    return b"w" + struct.pack("!QQQ", lsn, lsn, 0) + payload


class _Buffer:
    """psycopg's ``get_copy_data(1)`` over in-memory frames, ``BUFFER`` bytes at a time."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames
        self.at = 0
        self.held = 0  # bytes left of the current buffer

    def get_copy_data(self, _async: int) -> tuple[int, memoryview | bytes]:
        if self.held <= 0 or self.at >= len(self.frames):
            return 0, b""
        frame = self.frames[self.at]
        self.at += 1
        self.held -= len(frame)
        return len(frame), memoryview(frame)


class _Buffered(ReplicationConnection):
    """The stream over a ``_Buffer`` in place of libpq: its own framing reads it, and
    ``wait`` fills the next buffer."""

    def __init__(self, frames: list[bytes]) -> None:  # no connection
        self.buffer = _Buffer(frames)
        self.conn = self.buffer  # type: ignore[assignment]

    def wait(self, timeout_s: float) -> bool:
        self.buffer.held = BUFFER
        return self.buffer.at < len(self.buffer.frames)


def _run(frames: list[bytes], compiled: bool) -> float:
    """CPU seconds to read every frame into sealed, queued transactions."""
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        stats = SpoolStats()
        assembler = Assembler(
            PgOutputDecoder(4).decode,
            lambda name: Spool(folder, name, SPOOL_MEMORY, stats),
            max_change_bytes=3 * 16 * 1024 * 1024,
        )
        stream = _Buffered(frames)
        reader = TransactionReader(stream, assembler, SPOOL_MEMORY, compiled=compiled)
        queue = TxnQueue(1 << 40)
        started = time.process_time()
        while stream.buffer.at < len(frames):
            got = reader.read(0, 4 * 1024 * 1024)
            queue.put_all(got.transactions)
        return time.process_time() - started


def _stand_in(frames: list[bytes]) -> float:
    """CPU seconds of the stand-in for ``get_copy_data`` alone."""
    buffer = _Buffer(frames)
    started = time.process_time()
    while buffer.at < len(frames):
        buffer.held = BUFFER
        while buffer.get_copy_data(1)[0]:
            pass
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("oltp", "insert"), default="oltp")
    parser.add_argument("--transactions", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the compiled path")
    args = parser.parse_args()
    transactions = args.transactions or (50_000 if args.workload == "oltp" else 200)
    frames = _frames(args.workload, transactions)
    space_out_collections()  # as the daemon does (services/bridge/cli.py)
    freeze_startup_objects()
    if args.profile:
        cProfile.runctx("_run(frames, True)", globals(), {"frames": frames}, "/tmp/receiver.prof")
        pstats.Stats("/tmp/receiver.prof").sort_stats("tottime").print_stats(20)
        return
    print(f"{args.workload}: {transactions:,} source transactions, {len(frames):,} messages")
    stand_in = min(_stand_in(frames) for _ in range(args.repeat))
    paths = [("reference", False)]
    if reader_module.COMPILED:
        paths.append(("compiled", True))
    for name, compiled in paths:
        best = min(_run(frames, compiled) for _ in range(args.repeat))
        print(
            f"  {name:9s} {best / transactions * 1e6:8.2f} us per source transaction, "
            f"{best / len(frames) * 1e6:5.2f} us per message"
        )
    print(
        f"  of which the stand-in for get_copy_data {stand_in / transactions * 1e6:.2f} us per "
        "source transaction"
    )


if __name__ == "__main__":
    main()
