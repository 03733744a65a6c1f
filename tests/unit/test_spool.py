"""Spools: a transaction's raw messages in memory up to a limit, the rest on disk, read
back in arrival order; discarded without a trace."""

from __future__ import annotations

import importlib.util
import os
import random
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from services.bridge.assemble import spool as spool_module
from services.bridge.assemble.spool import Spool, SpoolError, SpoolStats, prepare_spool_dir

Splitter = Callable[[bytes, int], tuple[list[tuple[int, bytes]], int]]
SPLITTERS: dict[str, Splitter] = {"python": spool_module._split_python}
if importlib.util.find_spec("services.bridge.assemble._spoolread") is not None:
    from services.bridge.assemble._spoolread import split

    SPLITTERS["compiled"] = split


@pytest.fixture(params=sorted(SPLITTERS))
def splitter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spool files read back with each way of splitting them into records."""
    monkeypatch.setattr(spool_module, "_split", SPLITTERS[request.param])


def test_messages_come_back_in_order_across_memory_and_disk(tmp_path: Path, splitter: None) -> None:
    stats = SpoolStats()
    spool = Spool(tmp_path, "txn-7", 100, stats)
    sent = [(lsn, bytes([lsn % 256]) * 40) for lsn in range(1, 6)]  # two fit in memory
    for lsn, payload in sent:
        spool.append(lsn, payload)
    assert spool.count == 5
    assert (stats.memory_bytes, stats.disk_bytes) == (80, 3 * (12 + 40))
    assert spool.size == stats.memory_bytes + stats.disk_bytes
    assert list(spool) == sent
    assert list(spool) == sent  # read again, as a retried publish does


def test_once_on_disk_later_messages_stay_behind_it(tmp_path: Path, splitter: None) -> None:
    """A small message after a large one must not jump the queue into memory."""
    spool = Spool(tmp_path, "txn-7", 100, SpoolStats())
    spool.append(1, b"a" * 200)
    spool.append(2, b"b")
    assert list(spool) == [(1, b"a" * 200), (2, b"b")]


def test_a_message_larger_than_the_read_chunk_survives(tmp_path: Path, splitter: None) -> None:
    spool = Spool(tmp_path, "txn-7", 0, SpoolStats())
    big = os.urandom(3 << 20)
    spool.append(1, b"x")
    spool.append(2, big)
    spool.append(3, b"y")
    assert list(spool) == [(1, b"x"), (2, big), (3, b"y")]


@pytest.mark.parametrize("cut", [1, 12 + 5, 12 + 10 + 3])  # inside a header, a payload
def test_a_truncated_spool_file_is_an_error_not_an_end(
    tmp_path: Path, cut: int, splitter: None
) -> None:
    spool = Spool(tmp_path, "txn-7", 0, SpoolStats())
    spool.append(1, b"x" * 10)
    spool.append(2, b"y" * 10)
    assert spool._file is not None
    spool._file.flush()
    path = tmp_path / "txn-7.spool"
    os.truncate(path, path.stat().st_size - cut)
    with pytest.raises(SpoolError, match="spool file truncated"):
        list(spool)


def test_the_compiled_splitter_splits_as_the_python_one() -> None:
    # CI installs with a C compiler; the Python loop is the reference the splitter is held to.
    assert "compiled" in SPLITTERS
    rng = random.Random(7)
    records = [
        (rng.getrandbits(64), rng.randbytes(rng.choice((0, 1, 11, 12, 300)))) for _ in range(50)
    ]
    whole = b"".join(spool_module._HEADER.pack(lsn, len(p)) + p for lsn, p in records)
    for cut in (0, 1, 11, 12, 13, 100, len(whole) // 2, len(whole) - 1, len(whole)):
        for pos in (0, 12 + len(records[0][1])):
            buf = whole[:cut]
            if pos > len(buf):
                continue
            assert SPLITTERS["compiled"](buf, pos) == SPLITTERS["python"](buf, pos)
    assert SPLITTERS["compiled"](whole, 0) == (records, len(whole))


def test_the_file_is_private_and_discard_removes_it(tmp_path: Path) -> None:
    stats = SpoolStats()
    spool = Spool(tmp_path, "txn-7", 0, stats)
    spool.append(1, b"row data")
    path = tmp_path / "txn-7.spool"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    spool.discard()
    assert not path.exists()
    assert (stats.memory_bytes, stats.disk_bytes, spool.size) == (0, 0, 0)
    assert list(spool) == []


def test_the_spool_never_writes_through_a_planted_symlink(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    (tmp_path / "txn-7.spool").symlink_to(target)
    spool = Spool(tmp_path, "txn-7", 0, SpoolStats())
    with pytest.raises(SpoolError, match="check spool_dir"):
        spool.append(1, b"row data")
    assert target.read_bytes() == b"keep"


def test_the_slot_folder_is_private_and_emptied_of_old_spools(tmp_path: Path) -> None:
    configured = tmp_path / "spool"
    first = prepare_spool_dir(configured, "s1")
    (first / "txn-1.spool").write_bytes(b"left by a crash")
    first.chmod(0o755)
    again = prepare_spool_dir(configured, "s1")
    assert again == configured / "s1"
    assert list(again.iterdir()) == []
    assert stat.S_IMODE(again.stat().st_mode) == 0o700


def test_a_folder_others_may_write_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(SpoolError, match="writable by other users"):
        prepare_spool_dir(shared, "s1")


def test_stats_read_while_spools_come_and_go(tmp_path: Path) -> None:
    """The receive thread tracks a spool per transaction and the publisher discards it,
    with no lock: a metrics read meanwhile still sums the live spools (copied whole, again
    if one came or went during the copy), and never fails."""
    stats = SpoolStats()
    kept = Spool(tmp_path, "kept", 1 << 20, stats)
    kept.append(1, bytes(1000))
    done = threading.Event()

    def churn() -> None:
        n = 0
        while not done.is_set():
            spool = Spool(tmp_path, f"t{n}", 1 << 20, stats)
            spool.append(n, bytes(10))
            spool.discard()
            n += 1

    thread = threading.Thread(target=churn)
    thread.start()
    try:
        # Each read sees the kept spool and at most the one in flight.
        readings = {stats.memory_bytes for _ in range(20_000)}
    finally:
        done.set()
        thread.join()
    assert readings <= {1000, 1010}
    assert (stats.memory_bytes, stats.disk_bytes) == (1000, 0)
