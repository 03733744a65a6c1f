"""Which published tables already have their rows in Kafka, and where the stream takes over.

A table's rows reach Kafka once, by a snapshot; after that only its changes flow. The
initial snapshot covers every table published when the slot was made. A table added to
the publication later is snapshotted on its own, at the consistent point ``lsn`` of a
temporary slot: the stream's changes to it that committed before ``lsn`` are already in
those rows and must be dropped, the later ones published after them. Dropping lasts only
until the published position passes ``lsn`` (transactions arrive in commit order), so
the progress record carries the pending points across a restart and nothing more.

Covered tables are known by name from the schema topic: a table gets its first schema
record from its snapshot, before any change of it is published. Pure bookkeeping, no I/O;
the publisher thread updates it, the socket loop asks it which tables are missing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from services.bridge.records import PendingSnapshot

TableName = tuple[str, str]  # (schema, table)


class SnapshotCoverage:
    def __init__(self, covered: Iterable[TableName], pending: Iterable[PendingSnapshot],
                 high_water: int) -> None:
        self._lock = threading.Lock()
        self._covered = set(covered)
        self._pending: dict[TableName, int] = {}
        for snap in pending:
            self._covered.add((snap.schema_, snap.table))
            if snap.lsn > high_water:
                self._pending[(snap.schema_, snap.table)] = snap.lsn

    def missing(self, tables: Iterable[TableName]) -> list[TableName]:
        with self._lock:
            return [t for t in tables if t not in self._covered]

    def covers(self, table: TableName) -> bool:
        with self._lock:
            return table in self._covered

    def add(self, tables: Iterable[TableName], lsn: int) -> None:
        with self._lock:
            for table in tables:
                self._covered.add(table)
                self._pending[table] = lsn

    @property
    def dropping(self) -> bool:
        """Whether any table's older changes are still being dropped (the rare case)."""
        return bool(self._pending)

    def drops(self, table: TableName, commit_lsn: int) -> bool:
        """Whether a change of ``table`` committed at ``commit_lsn`` is in its snapshot."""
        return self._pending.get(table, 0) > commit_lsn

    def settle(self, high_water: int) -> None:
        """Forget points the published position has passed: no later change predates them."""
        with self._lock:
            self._pending = {t: lsn for t, lsn in self._pending.items() if lsn > high_water}

    def pending(self) -> list[PendingSnapshot]:
        with self._lock:
            return [PendingSnapshot(schema=s, table=t, lsn=lsn)
                    for (s, t), lsn in sorted(self._pending.items())]
