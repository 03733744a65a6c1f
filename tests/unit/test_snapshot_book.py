"""The snapshot book's chunk bookkeeping (services/bridge/snapshot/reader.py SnapshotBook): a
table's next chunk is read while the previous one waits for its watermark, and the
progress cursor only ever moves to what the publisher published, in order."""

from __future__ import annotations

from services.bridge.decode import messages as m
from services.bridge.snapshot.chunks import XidSnapshot
from services.bridge.snapshot.reader import ENDED_KEPT, Chunk, SnapshotBook

T = ("s", "t")
_RELATION = m.Relation(None, 1, "s", "t", "d", (m.Column("id", 23, -1, True),))


def _read(book: SnapshotBook, first: int, n: int, last: bool = False) -> Chunk:
    """What a reader does: claim the table, read ``n`` rows after its cursor, offer them."""
    state = book.claim(0)
    assert state is not None
    assert state.cursor == ([str(first - 1)] if first > 1 else None)
    chunk = Chunk(
        f"c{first}",
        T,
        _RELATION,
        [[str(i)] for i in range(first, first + n)],
        True,
        None,
        XidSnapshot(10, 10, frozenset()),
        state.cursor,
        [str(first + n - 1)],
        last,
        100,
    )
    assert book.offer(chunk)
    book.release(T)
    return chunk


def _book() -> SnapshotBook:
    book = SnapshotBook(held=4)
    assert book.add(T, "initial") is None
    return book


def test_next_chunk_is_read_while_the_previous_waits_for_its_watermark() -> None:
    book = _book()
    one, two = _read(book, 1, 10), _read(book, 11, 10)
    assert book.claim(0) is None  # two in flight: enough to keep reader and publisher busy
    assert book.states()[0].cursor is None  # nothing published yet
    assert book.take(one.token) is one
    assert book.advance(one, 10) is False
    assert book.states()[0].cursor == ["10"]
    assert book.take(two.token) is two
    book.advance(two, 10)
    assert book.states()[0].cursor == ["20"] and book.states()[0].rows == 20
    three = _read(book, 21, 5, last=True)
    assert book.claim(0) is None  # the last chunk is read: nothing more to claim
    assert book.take(three.token) is three
    assert book.advance(three, 5) is True
    assert not book.covers(T)
    # What `slotbridge snapshot` reports once the entry left the list: the published count.
    (ended,) = book.ended()
    assert (ended.id, ended.outcome, ended.rows, ended.chunks) == ("initial", "done", 25, 3)


def test_ended_snapshots_are_kept_with_their_outcome_up_to_a_bound() -> None:
    book = _book()
    book.fail(T, "the table is no longer published")
    assert book.claim(0) is None  # no more chunks of it
    assert book.ended() == []  # until the reader's cancel comes through the stream
    assert book.cancel("s.t") == [T]
    assert book.add(T, "r-1", "id < 3") is None
    assert book.cancel("r-1") == [T]
    failed, cancelled = book.ended()
    assert (failed.outcome, failed.reason) == ("failed", "the table is no longer published")
    assert (cancelled.id, cancelled.where, cancelled.outcome) == ("r-1", "id < 3", "cancelled")
    resumed = SnapshotBook(ended=book.ended() * ENDED_KEPT)  # a restart carries them on
    resumed.add(T, "r-2")
    resumed.cancel("r-2")
    assert len(resumed.ended()) == ENDED_KEPT and resumed.ended()[-1].id == "r-2"


def test_a_chunk_read_again_takes_the_later_ones_with_it() -> None:
    book = _book()
    one, two = _read(book, 1, 10), _read(book, 11, 10)
    assert book.take(one.token) is one
    book.again(one)  # the stream overtook it in a way fresh() cannot settle
    assert book.take(two.token) is None  # its rows would come before chunk one's
    again = _read(book, 1, 10)
    assert book.take(again.token) is again
    book.advance(again, 10)
    assert book.states()[0].cursor == ["10"]


def test_a_chunk_read_from_a_stale_cursor_is_refused() -> None:
    book = _book()
    first = _read(book, 1, 10)
    book.withdraw(first)  # its watermark did not commit
    stale = Chunk(
        "late",
        T,
        _RELATION,
        [["11"]],
        True,
        None,
        XidSnapshot(10, 10, frozenset()),
        ["10"],
        ["11"],
        False,
        100,
    )
    assert not book.offer(stale)  # read after chunk one, which is to be read again
    assert book.take(first.token) is None
