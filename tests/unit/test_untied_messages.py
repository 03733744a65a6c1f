"""Non-transactional logical messages (``pg_logical_emit_message(false, ...)``) arrive
outside any transaction; the assembler hands them aside instead of failing (assembler.py)."""

from __future__ import annotations

from pathlib import Path

from services.bridge.assemble.assembler import Assembler
from services.bridge.assemble.spool import Spool, SpoolStats
from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder
from tests.unit.pgoutput_builder import encode


def test_an_untied_message_is_handed_aside_and_the_stream_goes_on(tmp_path: Path) -> None:
    decoder = PgOutputDecoder(4)
    untied: list[m.LogicalMessage] = []
    assembler = Assembler(
        lambda payload: decoder.decode(payload, False),
        lambda name: Spool(tmp_path, name, 1 << 20, SpoolStats()),
        on_untied_message=untied.append,
    )
    ping = m.LogicalMessage(None, False, 90, "heartbeat", b"ping")
    assert assembler.feed(90, encode(ping)) is None
    assert untied == [ping]
    assert assembler.idle
    # A transaction after it, holding a transactional message, is assembled as before.
    note = encode(m.LogicalMessage(None, True, 101, "app.note", b"hello"))
    assembler.feed(100, encode(m.Begin(110, 0, 7)))
    assembler.feed(101, note)
    txn = assembler.feed(102, encode(m.Commit(0, 110, 120, 0)))
    assert txn is not None and list(txn.spool) == [(101, note)]
    assert untied == [ping]
