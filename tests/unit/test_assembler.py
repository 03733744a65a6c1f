"""The assembler: pgoutput messages in, whole transactions out in commit order, whatever
shape they arrived in (regular, streamed and interleaved, two-phase)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.bridge.assemble.assembler import AssemblyError, Transaction
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder
from tests.unit.pgoutput_builder import encode
from tests.unit.replication import TS, Source

REL = m.Relation(None, 16_401, "public", "accounts", "d", (m.Column("id", 20, -1, True),))


def ins(key: int, xid: int | None = None) -> m.Insert:
    return m.Insert(xid, 16_401, [str(key)])


def changes(txn: Transaction) -> list[m.Message]:
    """The transaction's messages as the publisher decodes them."""
    decoder = PgOutputDecoder(4)
    return [decoder.decode(payload, txn.streamed) for _, payload in txn.spool]


def test_a_regular_transaction_is_sealed_at_its_commit(tmp_path: Path) -> None:
    source = Source(tmp_path)
    commit_lsn = source.next_commit(3)
    source.send(m.Begin(commit_lsn, TS, 700), REL, ins(1), ins(2))
    assert source.sealed == [] and not source.assembler.idle
    source.send(m.Commit(0, commit_lsn, commit_lsn + 8, TS + 1))
    (txn,) = source.sealed
    assert (txn.xid, txn.commit_lsn, txn.end_lsn, txn.commit_ts) == (
        700,
        commit_lsn,
        commit_lsn + 8,
        TS + 1,
    )
    assert not txn.streamed and txn.gid is None
    assert changes(txn) == [REL, ins(1), ins(2)]
    assert txn.relations == (encode(REL),)
    assert source.assembler.idle


def test_streamed_transactions_interleave_and_come_out_in_commit_order(tmp_path: Path) -> None:
    source = Source(tmp_path)
    source.stream(801, ins(1, 801))
    source.stream(802, ins(2, 802))
    source.commit(700, ins(3))  # a small transaction commits while both are open
    source.stream(801, ins(4, 801))
    assert [t.xid for t in source.sealed] == [700]
    source.stream_commit(802)
    source.stream_commit(801)
    assert [t.xid for t in source.sealed] == [700, 802, 801]
    big = source.sealed[-1]
    assert big.streamed and changes(big) == [ins(1, 801), ins(4, 801)]
    assert source.assembler.idle


def test_a_stream_abort_of_a_subtransaction_marks_only_its_changes(tmp_path: Path) -> None:
    source = Source(tmp_path)
    source.stream(801, ins(1, 801), ins(2, 901), ins(3, 902))
    source.send(m.StreamAbort(801, 901, None, None))
    txn = source.stream_commit(801)
    assert txn.aborted_subxids == frozenset({901})
    # The spool keeps every message; the publisher leaves out the aborted subtransaction's.
    assert len(changes(txn)) == 3


def test_a_stream_abort_of_the_whole_transaction_drops_it(tmp_path: Path) -> None:
    source = Source(tmp_path)
    source.stream(801, ins(1, 801))
    source.send(m.StreamAbort(801, 801, None, None))
    assert source.assembler.idle
    assert source.stats.memory_bytes == 0  # its spool is freed
    source.commit(700, ins(2))
    assert [t.xid for t in source.sealed] == [700]


def test_a_prepared_transaction_waits_for_commit_prepared(tmp_path: Path) -> None:
    prepared: list[tuple[str, int]] = []
    source = Source(tmp_path, on_prepared=lambda gid, lsn: prepared.append((gid, lsn)))
    prepare_lsn = source.prepare(700, "g1", REL, ins(1))
    assert prepared == [("g1", prepare_lsn)]
    assert source.sealed == [] and not source.assembler.idle
    source.commit(701, ins(2))  # commits while g1 is prepared
    txn = source.commit_prepared(700, "g1")
    assert [t.xid for t in source.sealed] == [701, 700]
    assert (txn.gid, txn.prepare_lsn) == ("g1", prepare_lsn)
    assert changes(txn) == [REL, ins(1)]
    assert source.assembler.idle


def test_a_streamed_prepare_is_held_like_a_regular_one(tmp_path: Path) -> None:
    prepared: list[str] = []
    source = Source(tmp_path, on_prepared=lambda gid, lsn: prepared.append(gid))
    source.stream(801, ins(1, 801))
    source.send(m.StreamPrepare(0, source.lsn + 0x10, source.lsn + 0x18, TS, 801, "g2"))
    assert prepared == ["g2"] and source.sealed == []
    txn = source.commit_prepared(801, "g2")
    assert txn.streamed and txn.gid == "g2" and changes(txn) == [ins(1, 801)]


def test_a_rollback_prepared_drops_the_transaction(tmp_path: Path) -> None:
    rolled_back: list[str] = []
    source = Source(tmp_path, on_rolled_back=rolled_back.append)
    source.prepare(700, "g1", ins(1))
    source.send(m.RollbackPrepared(0, source.lsn, source.lsn + 8, TS, TS, 700, "g1"))
    assert rolled_back == ["g1"] and source.sealed == []
    assert source.assembler.idle and source.stats.memory_bytes == 0


def test_commit_prepared_whose_content_went_by_is_sealed_empty(tmp_path: Path) -> None:
    """Its PREPARE was before the start position: the publisher decides whether it was
    published already or is a gap."""
    source = Source(tmp_path)
    txn = source.commit_prepared(700, "g1")
    assert txn.gid == "g1" and txn.prepare_lsn is None
    assert txn.spool.count == 0


def test_a_relation_sent_between_transactions_joins_the_next(tmp_path: Path) -> None:
    source = Source(tmp_path)
    source.send(REL)
    source.stream(801, ins(1, 801))
    txn = source.stream_commit(801)
    # Inside a streamed transaction it gets the transaction's xid, as its other payloads.
    described = m.Relation(801, 16_401, "public", "accounts", "d", REL.columns)
    assert changes(txn) == [described, ins(1, 801)]
    # What it describes is at hand without reading its spool again.
    assert txn.relations == (encode(described),)


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([m.Commit(0, 1, 2, TS)], "Commit without an open transaction"),
        ([m.Begin(9, TS, 1), m.Begin(9, TS, 2)], "Begin of 2 while 1 is still open"),
        ([m.StreamStart(1, True), m.StreamStart(2, True)], "Stream Start inside a stream block"),
        ([ins(1)], "Insert message outside a transaction"),
        ([m.StreamCommit(5, 0, 1, 2, TS)], "Stream Commit for unknown streamed transaction 5"),
        ([m.Prepare(0, 1, 2, TS, 1, "g")], "Prepare without an open transaction"),
    ],
)
def test_a_stream_out_of_protocol_order_ends_the_session(
    tmp_path: Path, messages: list[m.Message], error: str
) -> None:
    with pytest.raises(AssemblyError, match=error):
        Source(tmp_path).send(*messages)


def test_discard_all_frees_every_open_transaction(tmp_path: Path) -> None:
    source = Source(tmp_path)
    source.stream(801, ins(1, 801))
    source.prepare(700, "g1", ins(2))
    source.send(m.Begin(source.lsn + 0x100, TS, 702), ins(3))
    assert source.stats.memory_bytes > 0
    source.assembler.discard_all()
    assert source.assembler.idle and source.stats.memory_bytes == 0


def test_the_assembler_only_decodes_control_messages(tmp_path: Path) -> None:
    """Changes are kept as sent and decoded once, when published: a truncated one passes."""
    source = Source(tmp_path)
    raw = b"I\x00\x00"
    source.send(m.Begin(0x2000, TS, 700))
    source.assembler.feed(0x1FF0, raw)
    source.send(m.Commit(0, 0x2000, 0x2008, TS))
    assert list(source.sealed[0].spool) == [(0x1FF0, raw)]
