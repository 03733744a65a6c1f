"""Per-transaction buffers of raw pgoutput messages that spill to local disk.

A transaction's changes must be held until its fate is known (commit, stream abort,
rollback prepared). Holding them decoded in memory would make the bridge's footprint grow
with the largest transaction, so a spool keeps raw payloads - the cheapest form, decoded
once when published - in memory up to a limit, then appends the rest to a file.

File format: a run of records ``<u64 lsn><u32 length><payload>``, big-endian.

Spool files hold row data in the clear, so they live in a folder only the bridge's user
can enter (0700, files 0600), and a configured folder other users may write to is refused:
they could plant a symlink where the next spool file goes, or delete spools under us.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
from collections.abc import Callable, Iterator
from itertools import chain
from pathlib import Path
from typing import BinaryIO

from services.common.errors import SlotbridgeError

_HEADER = struct.Struct("!QI")
_READ_CHUNK = 1 << 20


class SpoolError(SlotbridgeError):
    """The spool folder is unsafe or unusable; the message names it and what to do."""

    retryable = False  # the folder or its volume needs the operator


def _failed(directory: Path, exc: OSError) -> SpoolError:
    hint = (
        "free space there or point spool_dir at a larger volume"
        if exc.errno in (28, 122)
        else "check spool_dir"
    )  # ENOSPC, EDQUOT
    return SpoolError(f"spool_dir {directory}: {exc.strerror or exc}; {hint}")


class SpoolStats:
    """Bytes currently held by all spools (exported as metrics), and in memory by the
    stream's reader for a transaction it has not sealed yet (``count_unsealed``).

    Summed over the live spools when read: a total kept up to date per row change took
    the receive thread a lock per row, a sixth of its time. No lock per spool either (one
    to track and one to untrack were a lock per source transaction on each of two
    threads): adding to and discarding from a set are single operations on it (the GIL;
    the set's own lock in a free-threaded build), and the rare reader copies the set in
    one call, again if a spool came or went during the copy."""

    def __init__(self) -> None:
        self._spools: set[Spool] = set()
        self._unsealed: Callable[[], int] | None = None

    def track(self, spool: Spool) -> None:
        self._spools.add(spool)

    def untrack(self, spool: Spool) -> None:
        self._spools.discard(spool)

    def count_unsealed(self, held: Callable[[], int] | None) -> None:
        """Count ``held()`` too: the bytes of the transaction the session's reader holds
        before it has a spool (``TransactionReader.unsealed_bytes``); None when the session
        ends. Those bytes go into the transaction's spool when it is sealed."""
        self._unsealed = held

    def _live(self) -> tuple[Spool, ...]:
        while True:
            try:
                return tuple(self._spools)
            except RuntimeError:  # "Set changed size during iteration"
                continue

    @property
    def memory_bytes(self) -> int:
        unsealed = self._unsealed
        held = 0 if unsealed is None else unsealed()
        return held + sum(spool.memory for spool in self._live())

    @property
    def disk_bytes(self) -> int:
        return sum(spool.disk for spool in self._live())


class Spool:
    """The messages of one transaction, in arrival order, memory first then disk."""

    def __init__(self, directory: Path, name: str, memory_limit: int, stats: SpoolStats) -> None:
        # The file's path is made only when the spool spills: most transactions never do,
        # and a Path per transaction was a tenth of a small transaction's cost.
        self._directory = directory
        self._name = name
        self._memory_limit = memory_limit
        self._stats = stats
        self._entries: list[tuple[int, bytes]] = []
        self._memory = 0
        self._file: BinaryIO | None = None
        self._disk = 0
        self.count = 0
        stats.track(self)

    @property
    def _path(self) -> Path:
        return self._directory / f"{self._name}.spool"

    @property
    def memory(self) -> int:
        return self._memory

    @property
    def disk(self) -> int:
        return self._disk

    @property
    def size(self) -> int:
        return self._memory + self._disk

    def append(self, lsn: int, payload: bytes) -> None:
        self.count += 1
        if self._file is None and self._memory + len(payload) <= self._memory_limit:
            self._entries.append((lsn, payload))
            self._memory += len(payload)
            return
        try:
            if self._file is None:
                # 0600, and never through a symlink someone left at our path.
                fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                self._file = open(fd, "w+b")  # noqa: SIM115 - lives as long as the spool
            # One call, and no joined copy of a payload that may be hundreds of MB.
            self._file.writelines((_HEADER.pack(lsn, len(payload)), payload))
        except OSError as exc:
            raise _failed(self._directory, exc) from None
        self._disk += _HEADER.size + len(payload)

    def hold(self, entries: list[tuple[int, bytes]], memory: int) -> None:
        """Take the messages of a transaction read whole (``decode._runs``) into an empty
        spool: ``memory``, their payloads' bytes, is within its memory limit."""
        assert not self.count and memory <= self._memory_limit
        self._entries = entries
        self._memory = memory
        self.count = len(entries)

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        # Iterators in C, not a generator: the event builder pulls every message through
        # here, and a Python frame resumed per message (two, for the file's) cost about a
        # twentieth of the publisher thread's time (bench/profile_publisher.py --spill).
        if self._file is None:
            return iter(self._entries)
        return chain(self._entries, chain.from_iterable(self._file_batches()))

    def _file_batches(self) -> Iterator[list[tuple[int, bytes]]]:
        assert self._file is not None
        try:
            self._file.flush()
            with open(self._path, "rb") as reader:
                yield from _read_batches(reader)
        except OSError as exc:
            raise _failed(self._directory, exc) from None

    def discard(self) -> None:
        """Free memory and delete the file; the spool is empty afterwards."""
        self._stats.untrack(self)
        self._entries = []
        self._memory = self._disk = 0
        if self._file is not None:
            # Closing flushes what is buffered, which fails again on a full disk: the file
            # is deleted either way.
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)


def _split_python(buf: bytes, pos: int) -> tuple[list[tuple[int, bytes]], int]:
    """The (lsn, payload) of every whole record in ``buf`` from ``pos``, and where the first
    record not wholly in it starts (``_spoolread.split``, where that is not compiled)."""
    unpack, size = _HEADER.unpack_from, _HEADER.size
    held = len(buf)
    records = []
    while pos + size <= held:
        lsn, length = unpack(buf, pos)
        end = pos + size + length
        if end > held:
            break
        records.append((lsn, buf[pos + size : end]))
        pos = end
    return records, pos


try:
    from services.bridge.assemble._spoolread import split as _split
except ImportError:  # installed where no C compiler was at hand
    _split = _split_python


def _read_batches(reader: BinaryIO) -> Iterator[list[tuple[int, bytes]]]:
    """The file's records, a read's worth at a time."""
    size = _HEADER.size
    buf = b""
    pos = 0
    while True:
        # Every whole record in the buffer, then more of the file: at least what the next
        # record needs (its header, or all of it once the header is in).
        records, pos = _split(buf, pos)
        if records:
            yield records
        held = len(buf)
        need = size
        if pos + size <= held:
            need += _HEADER.unpack_from(buf, pos)[1]
        more = reader.read(max(_READ_CHUNK, pos + need - held))
        if not more:
            if pos < held:
                raise OSError("spool file truncated")
            return
        buf = buf[pos:] + more
        pos = 0


def prepare_spool_dir(configured: Path, slot: str) -> Path:
    """The slot's spool folder under ``configured``: private, and emptied of spools left by a
    previous run (the slot replays their transactions anyway).

    ``configured`` is created 0700 if missing, and refused if it is not ours or others may
    write to it. The slot's own folder inside it is made (or tightened to) 0700.
    """
    try:
        configured.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = configured.stat()
        if info.st_uid != os.getuid():
            raise SpoolError(
                f"spool_dir {configured} belongs to uid {info.st_uid}, not to the "
                f"bridge's user (uid {os.getuid()}); spool files hold row data: "
                "point spool_dir at a folder of the bridge's own (created 0700 "
                "if missing)"
            )
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise SpoolError(
                f"spool_dir {configured} is writable by other users (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); spool files hold row data: "
                f"chmod 700 {configured}, or point spool_dir at a folder only "
                "the bridge's user can write (created 0700 if missing)"
            )
        directory = configured / slot
        directory.mkdir(mode=0o700, exist_ok=True)
        if directory.is_symlink() or not directory.is_dir():
            raise SpoolError(f"spool folder {directory} is not a plain folder; remove it")
        directory.chmod(0o700)  # older versions made it 0755
        for leftover in directory.glob("*.spool"):
            leftover.unlink()
    except OSError as exc:
        raise _failed(configured, exc) from None
    return directory
