"""A row change too large to publish is spooled as a small stand-in (assembler.py)."""

from __future__ import annotations

from pathlib import Path

from services.bridge.assemble.assembler import Assembler
from services.bridge.assemble.spool import Spool, SpoolStats
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder, streamed_xid
from tests.unit.pgoutput_builder import encode


def test_only_changes_over_the_limit_are_replaced(tmp_path: Path) -> None:
    decoder = PgOutputDecoder(4)
    assembler = Assembler(
        lambda payload: decoder.decode(payload, False),
        lambda name: Spool(tmp_path, name, 1 << 20, SpoolStats()),
        max_change_bytes=1000,
    )
    small = encode(m.Insert(None, 42, ["1", "x"]))
    huge = encode(m.Insert(None, 42, ["2", "x" * 5000]))
    assembler.feed(1, encode(m.Begin(100, 0, 7)))
    assembler.feed(2, small)
    assembler.feed(3, huge)
    txn = assembler.feed(4, encode(m.Commit(0, 100, 110, 0)))
    assert txn is not None
    spooled = list(txn.spool)
    assert spooled[0] == (2, small)
    lsn, stand_in = spooled[1]
    assert lsn == 3 and len(stand_in) < 20
    assert decoder.decode(stand_in, False) == m.OversizedChange(None, 42, len(huge))


def test_a_streamed_stand_in_keeps_its_subtransaction(tmp_path: Path) -> None:
    """A Stream Abort of a subtransaction drops its changes by the xid in bytes 1-4."""
    decoder = PgOutputDecoder(4)
    assembler = Assembler(
        lambda payload: decoder.decode(payload, True),
        lambda name: Spool(tmp_path, name, 1 << 20, SpoolStats()),
        max_change_bytes=1000,
    )
    assembler.feed(1, encode(m.StreamStart(7, True)))
    huge = encode(m.Insert(9, 42, ["2", "x" * 5000]))
    assembler.feed(2, huge)
    assembler.feed(3, encode(m.StreamStop()))
    txn = assembler.feed(4, encode(m.StreamCommit(7, 0, 100, 110, 0)))
    assert txn is not None
    ((_, stand_in),) = list(txn.spool)
    assert streamed_xid(stand_in) == 9
    assert decoder.decode(stand_in, True) == m.OversizedChange(9, 42, len(huge))
