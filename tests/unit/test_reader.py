"""The socket loop's two reading paths give the same transactions: the compiled one
(``decode._runs``: regular transactions read whole) and the reference one (message by
message into the assembler), on random streams of every shape the server sends, cut into
libpq buffers at random places. The compiled reader must be built here (bootstrap
requires a C compiler), so its import is not optional."""

from __future__ import annotations

import gc
import random
import struct
from pathlib import Path

import pytest

from services.bridge.assemble.assembler import Assembler, Transaction
from services.bridge.assemble.reader import Received, TransactionReader
from services.bridge.assemble.spool import Spool, SpoolStats
from services.bridge.decode import _runs  # noqa: F401 - built wherever the tests run
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder
from services.bridge.receive.stream import ReplicationConnection, StreamError
from tests.unit.pgoutput_builder import encode
from tests.unit.replication import TS

OID = 16_401
REL = m.Relation(None, OID, "public", "accounts", "d", (m.Column("id", 20, -1, True),))
MEMORY = 600  # the spools' memory limit: larger transactions spill, and are read per message
MAX_CHANGE = 200  # changes over it are spooled as stand-ins


class Buffered:
    """psycopg's ``get_copy_data(1)`` over a list of CopyData messages, which libpq holds
    in buffers ending after the frames ``cuts`` counts: 0 at each buffer's end, until
    ``wait``."""

    def __init__(self, frames: list[bytes], cuts: set[int], ends: bool = False) -> None:
        """``ends``: the server ends the COPY after the frames (-1, as libpq says it)."""
        self.frames = frames
        self.cuts = cuts
        self.ends = ends
        self.at = 0
        self.blocked = False

    def get_copy_data(self, _async: int) -> tuple[int, memoryview | bytes]:
        if self.blocked:
            return 0, b""
        if self.at >= len(self.frames):
            return (-1, b"") if self.ends else (0, b"")
        frame = self.frames[self.at]
        self.at += 1
        if self.at in self.cuts:
            self.blocked = True
        return len(frame), memoryview(frame)


class FakeStream(ReplicationConnection):
    """The stream over ``Buffered`` in place of libpq (its own framing, ``next_message``,
    reads it): ``wait`` opens the next buffer."""

    def __init__(self, buffered: Buffered) -> None:  # no connection
        self.buffered = buffered
        self.conn = buffered  # type: ignore[assignment]

    def wait(self, timeout_s: float) -> bool:
        self.buffered.blocked = False
        return self.buffered.at < len(self.buffered.frames)

    def stream_ended(self) -> StreamError:
        return StreamError("replication stream ended: the server closed the COPY")


def xlog(start: int, end: int, payload: bytes) -> bytes:
    return b"w" + struct.pack("!QQQ", start, end, 0) + payload


def keepalive(end: int, reply: bool) -> bytes:
    return b"k" + struct.pack("!QQB", end, 0, int(reply))


class StreamWriter:
    """A random slot stream, as CopyData frames with LSNs in the server's order."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.lsn = 0x1000
        self.frames: list[bytes] = []
        self.xid = 700
        self.prepared: list[tuple[int, str]] = []
        self.streams: list[int] = []

    def send(self, *msgs: m.Message) -> None:
        for msg in msgs:
            self.lsn += 0x10
            # walEnd: where the server's WAL ends as it sends, at or past the message.
            self.frames.append(xlog(self.lsn, self.lsn + self.rng.choice((0, 0x100)), encode(msg)))

    def change(self, xid: int | None = None) -> m.Message:
        rng = self.rng
        size = rng.choice((3, 10, 40, 90, 300))  # 300: over MAX_CHANGE
        value = "x" * size
        kind = rng.random()
        if kind < 0.5:
            return m.Insert(xid, OID, [str(rng.randrange(100)), value])
        if kind < 0.8:
            return m.Update(xid, OID, None, False, [str(rng.randrange(100)), value])
        return m.Delete(xid, OID, [str(rng.randrange(100))], True)

    def regular(self) -> None:
        rng = self.rng
        self.xid += 1
        body: list[m.Message] = [self.change() for _ in range(rng.choice((0, 1, 3, 4, 8)))]
        extra = rng.random()
        if extra < 0.05:
            body.insert(rng.randrange(len(body) + 1), REL)
        elif extra < 0.08:
            body.insert(0, m.Origin(0x55, "upstream"))
        elif extra < 0.11:
            body.append(m.LogicalMessage(None, True, self.lsn, "app", b"hello"))
        elif extra < 0.13:
            body.append(m.Truncate(None, 0, (OID,)))
        commit_lsn = self.lsn + 0x10 * (len(body) + 2)
        self.send(m.Begin(commit_lsn, TS, self.xid))
        for msg in body:
            self.send(msg)
            if rng.random() < 0.03:
                self.frames.append(keepalive(self.lsn, rng.random() < 0.5))
        self.send(m.Commit(0, commit_lsn, commit_lsn + 8, TS + self.xid))

    def streamed(self) -> None:
        rng = self.rng
        if self.streams and rng.random() < 0.5:
            xid = self.streams.pop(rng.randrange(len(self.streams)))
            if rng.random() < 0.8:
                commit_lsn = self.lsn + 0x10
                self.send(m.StreamCommit(xid, 0, commit_lsn, commit_lsn + 8, TS))
            else:
                self.send(m.StreamAbort(xid, xid, None, None))
            return
        if self.streams and rng.random() < 0.5:
            xid = self.streams[0]
        else:
            self.xid += 1
            xid = self.xid
            self.streams.append(xid)
        changes = [self.change(xid) for _ in range(rng.randint(1, 4))]
        self.send(m.StreamStart(xid, False), *changes, m.StreamStop())

    def two_phase(self) -> None:
        rng = self.rng
        if self.prepared and rng.random() < 0.6:
            xid, gid = self.prepared.pop()
            commit_lsn = self.lsn + 0x10
            if rng.random() < 0.8:
                self.send(m.CommitPrepared(0, commit_lsn, commit_lsn + 8, TS, xid, gid))
            else:
                self.send(m.RollbackPrepared(0, commit_lsn, commit_lsn + 8, TS, TS, xid, gid))
            return
        self.xid += 1
        gid = f"gid-{self.xid}"
        changes = [self.change() for _ in range(rng.randint(1, 3))]
        prepare_lsn = self.lsn + 0x10 * (len(changes) + 2)
        self.send(
            m.BeginPrepare(prepare_lsn, prepare_lsn + 8, TS, self.xid, gid),
            *changes,
            m.Prepare(0, prepare_lsn, prepare_lsn + 8, TS, self.xid, gid),
        )
        self.prepared.append((self.xid, gid))

    def write(self, count: int) -> list[bytes]:
        rng = self.rng
        for _ in range(count):
            shape = rng.random()
            if shape < 0.7:
                self.regular()
            elif shape < 0.8:
                self.streamed()
            elif shape < 0.87:
                self.two_phase()
            elif shape < 0.92:
                self.send(REL)  # described between transactions: the next one adopts it
            elif shape < 0.95:
                self.send(m.LogicalMessage(None, False, self.lsn, "heartbeat", b""))
            else:
                self.frames.append(keepalive(self.lsn, rng.random() < 0.5))
        return self.frames


def read_all(frames: list[bytes], cuts: set[int], tmp: Path, compiled: bool) -> list[object]:
    """Everything the reader gives, until the stream ends: each transaction as its facts and
    messages, each keepalive, and the WAL end of each read."""
    decoder = PgOutputDecoder(4)
    stats = SpoolStats()
    assembler = Assembler(
        decoder.decode,
        lambda name: Spool(tmp, name, MEMORY, stats),
        max_change_bytes=MAX_CHANGE,
    )
    buffered = Buffered(frames, cuts)
    reader = TransactionReader(FakeStream(buffered), assembler, MEMORY, compiled=compiled)
    out: list[object] = []
    wal_end = 0
    while buffered.at < len(frames) or buffered.blocked:
        got: Received = reader.read(0.0, 2_000)
        out.extend(_facts(txn) for txn in got.transactions)
        if got.keepalive is not None:
            out.append(("keepalive", got.keepalive))
        wal_end = max(wal_end, got.wal_end)
        out.append(("wal end", wal_end))
        if not got.transactions and got.keepalive is None and not buffered.blocked:
            break
    return out


def _facts(txn: Transaction) -> tuple[object, ...]:
    return (
        txn.xid,
        txn.commit_lsn,
        txn.end_lsn,
        txn.commit_ts,
        txn.streamed,
        sorted(txn.aborted_subxids),
        txn.gid,
        txn.prepare_lsn,
        txn.relations,
        list(txn.spool),
        txn.spool.count,
        txn.spool.size,
    )


@pytest.mark.parametrize("seed", range(40))
def test_the_compiled_reader_gives_what_the_reference_gives(seed: int, tmp_path: Path) -> None:
    rng = random.Random(seed)
    frames = StreamWriter(rng).write(rng.choice((5, 30, 120)))
    cuts = {rng.randrange(len(frames) + 1) for _ in range(rng.randint(0, len(frames) // 3 + 1))}
    (tmp_path / "ref").mkdir()
    (tmp_path / "c").mkdir()
    reference = read_all(frames, cuts, tmp_path / "ref", compiled=False)
    compiled = read_all(frames, cuts, tmp_path / "c", compiled=True)
    sealed = [x for x in reference if not isinstance(x[0], str)]  # type: ignore[index]
    assert sealed or len(frames) < 10
    assert compiled == reference


@pytest.mark.parametrize("cuts", [set(), {1, 2, 3}], ids=["one buffer", "four buffers"])
def test_a_regular_transaction_is_read_whole(cuts: set[int], tmp_path: Path) -> None:
    """The compiled path seals a transaction of row changes itself, also across libpq's
    buffers: the assembler never sees its messages (it would open a transaction at the
    Begin), and the reader says a transaction is arriving while it holds part of one."""
    writer = StreamWriter(random.Random(1))
    commit_lsn = writer.lsn + 0x10 * 4
    writer.send(m.Begin(commit_lsn, TS, 900), m.Insert(None, OID, ["1", "a"]))
    writer.send(m.Delete(None, OID, ["2"], True), m.Commit(0, commit_lsn, commit_lsn + 8, TS))
    fed: list[int] = []
    decoder = PgOutputDecoder(4)

    def decode(payload: bytes) -> m.Message:
        fed.append(payload[0])
        return decoder.decode(payload)

    stats = SpoolStats()
    assembler = Assembler(decode, lambda name: Spool(tmp_path, name, MEMORY, stats))
    buffered = Buffered(writer.frames, cuts)
    reader = TransactionReader(FakeStream(buffered), assembler, MEMORY, compiled=True)
    stats.count_unsealed(lambda: reader.unsealed_bytes)
    arriving = []
    held = []  # the spool metric's memory bytes after each read
    sealed: list[Transaction] = []
    while not sealed:
        sealed = reader.read(0, 1000).transactions
        arriving.append(reader.mid_transaction)
        held.append(stats.memory_bytes)
    (txn,) = sealed
    assert (txn.xid, txn.commit_lsn, txn.end_lsn, txn.spool.count) == (
        900,
        commit_lsn,
        commit_lsn + 8,
        2,
    )
    assert fed == []
    # Its (lsn, payload) pairs are out of the cyclic collector's sight (services.common.collector).
    assert not any(gc.is_tracked(entry) for entry in txn.spool)
    # A read takes what libpq holds, then what one wait brings: four buffers take three.
    assert arriving == ([True, True, False] if cuts else [False])
    assert reader.idle
    # The part read before the transaction was sealed counts too, then its spool does.
    size = txn.spool.size
    assert held == ([held[0], held[1], size] if cuts else [size])
    assert all(0 < h <= size for h in held) and held == sorted(held)


@pytest.mark.parametrize("compiled", [False, True], ids=["reference", "compiled"])
def test_the_end_of_the_stream_inside_a_transaction_ends_the_read(
    compiled: bool, tmp_path: Path
) -> None:
    """The server closing the COPY mid-transaction is the stream's error on both paths, and
    the transaction read so far is the assembler's (dropped with the session)."""
    writer = StreamWriter(random.Random(2))
    writer.send(m.Begin(writer.lsn + 0x40, TS, 901), m.Insert(None, OID, ["1", "a"]))
    assembler = Assembler(
        PgOutputDecoder(4).decode, lambda name: Spool(tmp_path, name, MEMORY, SpoolStats())
    )
    buffered = Buffered(writer.frames, set(), ends=True)
    reader = TransactionReader(FakeStream(buffered), assembler, MEMORY, compiled=compiled)
    with pytest.raises(StreamError, match="closed the COPY"):
        reader.read(0, 1000)
    assert assembler.mid_transaction and not reader.idle
