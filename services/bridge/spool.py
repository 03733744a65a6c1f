"""Per-transaction buffers of raw pgoutput messages that spill to local disk.

A transaction's changes must be held until its fate is known (commit, stream abort,
rollback prepared). Holding them decoded in memory would make the bridge's footprint grow
with the largest transaction, so a spool keeps raw payloads - the cheapest form, decoded
once when published - in memory up to a limit, then appends the rest to a file.

File format: a run of records ``<u64 lsn><u32 length><payload>``, big-endian.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_HEADER = struct.Struct("!QI")
_READ_CHUNK = 1 << 20


class SpoolStats:
    """Bytes currently held by all spools (exported as metrics)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.memory_bytes = 0
        self.disk_bytes = 0

    def add(self, memory: int = 0, disk: int = 0) -> None:
        with self._lock:
            self.memory_bytes += memory
            self.disk_bytes += disk


class Spool:
    """The messages of one transaction, in arrival order, memory first then disk."""

    def __init__(self, directory: Path, name: str, memory_limit: int, stats: SpoolStats) -> None:
        self._path = directory / f"{name}.spool"
        self._memory_limit = memory_limit
        self._stats = stats
        self._entries: list[tuple[int, bytes]] = []
        self._memory = 0
        self._file: BinaryIO | None = None
        self._disk = 0
        self.count = 0

    @property
    def size(self) -> int:
        return self._memory + self._disk

    def append(self, lsn: int, payload: bytes) -> None:
        self.count += 1
        if self._file is None and self._memory + len(payload) <= self._memory_limit:
            self._entries.append((lsn, payload))
            self._memory += len(payload)
            self._stats.add(memory=len(payload))
            return
        if self._file is None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self._path, "w+b")  # noqa: SIM115 - lives as long as the spool
        self._file.write(_HEADER.pack(lsn, len(payload)))
        self._file.write(payload)
        written = _HEADER.size + len(payload)
        self._disk += written
        self._stats.add(disk=written)

    def __iter__(self) -> Iterator[tuple[int, bytes]]:
        yield from self._entries
        if self._file is None:
            return
        self._file.flush()
        with open(self._path, "rb") as reader:
            yield from _read_records(reader)

    def discard(self) -> None:
        """Free memory and delete the file; the spool is empty afterwards."""
        self._stats.add(memory=-self._memory, disk=-self._disk)
        self._entries = []
        self._memory = self._disk = 0
        if self._file is not None:
            self._file.close()
            self._file = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)


def _read_records(reader: BinaryIO) -> Iterator[tuple[int, bytes]]:
    buf = b""
    pos = 0
    while True:
        if len(buf) - pos < _HEADER.size:
            more = reader.read(_READ_CHUNK)
            if not more:
                return
            buf = buf[pos:] + more
            pos = 0
            continue
        lsn, length = _HEADER.unpack_from(buf, pos)
        end = pos + _HEADER.size + length
        if end > len(buf):
            more = reader.read(max(_READ_CHUNK, end - len(buf)))
            if not more:
                raise OSError("spool file truncated")
            buf = buf[pos:] + more
            pos = 0
            continue
        yield lsn, buf[pos + _HEADER.size:end]
        pos = end


def clear_spool_dir(directory: Path) -> None:
    """Remove spools left by a previous run: the slot replays their transactions anyway."""
    if directory.is_dir():
        for leftover in directory.glob("*.spool"):
            leftover.unlink()
