"""Reconciling snapshot chunks with the stream (services/bridge/snapshot/chunks.py)."""

from __future__ import annotations

from services.bridge.snapshot.chunks import RecentCommits, Row, StreamWatch, XidSnapshot

T = ("s", "t")


def test_snapshot_visibility_is_postgres_own() -> None:
    snap = XidSnapshot.parse("100:110:103,107")
    assert snap.sees(99) and snap.sees(100 - 1)
    assert snap.sees(101) and snap.sees(104)  # committed before the snapshot
    assert not snap.sees(103) and not snap.sees(107)  # running then
    assert not snap.sees(110) and not snap.sees(200)  # began after


def test_stream_xids_are_widened_across_the_epoch() -> None:
    # Epoch 1: full ids 2^32 + n; the stream sends n only.
    snap = XidSnapshot.parse(f"{(1 << 32) + 5}:{(1 << 32) + 9}:{(1 << 32) + 6}")
    assert snap.full(7) == (1 << 32) + 7
    assert snap.sees(0xFFFFFFF0)  # just before the wrap: epoch 0, long committed
    assert not snap.sees(6) and snap.sees(8) and not snap.sees(9)


def _chunk(snap: str, rows: list[Row], watch: StreamWatch) -> list[Row] | None:
    return watch.fresh(T, XidSnapshot.parse(snap), rows, [0], None)


def test_rows_the_stream_overtook_are_dropped() -> None:
    watch = StreamWatch()
    watch.watch(T)
    watch.changed(T, 50, ("1",))  # seen by the chunk's snapshot: its row is current
    watch.committed(50)
    watch.changed(T, 60, ("2",))  # running while the chunk was read: row 2 is stale
    watch.committed(60)
    rows: list[Row] = [["1", "a"], ["2", "b"], ["3", "c"]]
    assert _chunk("55:61:60", rows, watch) == [["1", "a"], ["3", "c"]]
    # The next chunk's snapshot sees transaction 60: nothing is stale any more.
    assert _chunk("61:61:", rows, watch) == rows


def test_a_truncate_the_chunk_did_not_see_empties_it() -> None:
    watch = StreamWatch()
    watch.watch(T)
    watch.truncated(T, 70)
    assert _chunk("70:71:70", [["1", "a"]], watch) == []
    assert _chunk("71:71:", [["1", "a"]], watch) == [["1", "a"]]


def test_a_transaction_committed_before_the_watch_and_still_running_forces_a_reread() -> None:
    watch = StreamWatch()
    watch.committed(80)  # before the snapshot was requested: its keys were not noted
    watch.watch(T)
    assert _chunk("80:81:80", [["1", "a"]], watch) is None
    assert _chunk("81:81:", [["1", "a"]], watch) == [["1", "a"]]


def test_keyless_rows_the_stream_inserted_are_not_published_twice() -> None:
    watch = StreamWatch()
    watch.watch(T)
    watch.inserted(T, 90)
    watch.committed(90)
    rows: list[Row] = [["x"], ["y"]]
    assert watch.fresh(T, XidSnapshot.parse("91:91:"), rows, [], [12, 90]) == [["x"]]


def test_rows_the_stream_inserted_and_the_chunk_saw_are_not_published_twice() -> None:
    watch = StreamWatch()
    watch.watch(T)
    watch.changed(T, 40, ("1",), insert=True)
    watch.committed(40)
    watch.changed(T, 41, ("2",))  # an update: its row may lack TOASTed values
    watch.committed(41)
    rows: list[Row] = [["1", "a"], ["2", "b"]]
    assert _chunk("42:42:", rows, watch) == [["2", "b"]]
    assert _chunk("43:43:", rows, watch) == [["2", "b"]]  # still known in later chunks


def test_recent_commits_are_numbered_in_order_and_the_oldest_forgotten() -> None:
    recent = RecentCommits(3)
    for xid in (500, 0xF400_0000, 1, 9):
        recent.add(xid)
    assert recent.count == 4
    # 500 was the first of four in a ring of three: forgotten, although on a little-endian
    # machine its four bytes still appear across 0xF4000000 and 1; the rest keep their numbers.
    assert recent.numbers([500, 0xF400_0000, 1, 9, 11]) == {0xF400_0000: 2, 1: 3, 9: 4}
    recent.add(500)  # wraps again
    assert recent.numbers([500, 1, 0xF400_0000]) == {500: 5, 1: 3}


def test_a_commit_older_than_the_memory_no_longer_forces_a_reread() -> None:
    watch = StreamWatch(recent=2)
    watch.committed(80)
    watch.watch(T)
    assert _chunk("80:81:80", [["1", "a"]], watch) is None
    watch.committed(81)
    watch.committed(82)  # 80 is forgotten: its snapshot is long gone by then
    assert _chunk("80:83:80", [["1", "a"]], watch) == [["1", "a"]]
