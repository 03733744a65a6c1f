"""Reconciling snapshot chunks with the stream, by transaction visibility (DBLog's idea).

A chunk is read in a transaction of its own: its rows are the table as of that
transaction's snapshot S. The same transaction then writes a watermark into the WAL (a
transactional logical message), so the watermark reaches the publisher in commit order,
and the chunk's rows are published at exactly that place in the stream:

- a transaction committed after the watermark started after S was taken, or was still
  running then: S does not see it, and its changes follow the rows, as they must;
- a transaction before the watermark that S sees is in the rows already;
- a transaction before the watermark that S does not see (still running when S was
  taken) changed the table after the rows were read: a row with a key it changed would be
  older than what the stream already published, so the row is dropped; the stream holds
  that key's newer state.

Visibility is PostgreSQL's own (S's xmin, xmax and in-progress list, from
``pg_current_snapshot()``), not WAL order: a commit record is written before its
transaction becomes visible, so in the narrow window between the two a position alone
would be wrong. The stream's changes are watched per table from the moment its snapshot
is requested; a transaction that committed just before that and that S still saw running
is caught by a short memory of recent commits (``RECENT``): the chunk is then read again.

Rows the stream inserted while their table was watched, and the chunk also saw, are
not published again: the insert carried the whole row. A row the stream only updated is
published again (an update leaves unchanged TOASTed values out).

A table without a primary key under REPLICA IDENTITY FULL is keyed by its whole row, so
of two equal rows, one changed while its chunk was read, both are dropped from the chunk.

A table without a key (REPLICA IDENTITY NOTHING, or FULL without a primary key read
whole) has no key to match. Its rows carry their inserting transaction (``xmin``): a row
inserted by a transaction the stream already published is dropped. Rows of a
subtransaction carry the subtransaction's id, which the stream does not tell, so a row a
SAVEPOINT inserted while its table was being snapshotted may arrive twice.

Pure: no I/O; the publisher thread is its only user.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

TableName = tuple[str, str]  # (schema, table)
Key = tuple[str | None, ...]  # key columns' text, as PostgreSQL's output functions print it
Row = list[str | None]  # a row's values as text (or NULL), in the relation's column order

RECENT = 100_000  # commits remembered from before a table's snapshot was requested


@dataclass(frozen=True, slots=True)
class XidSnapshot:
    """``pg_current_snapshot()``: full 64-bit transaction ids."""

    xmin: int
    xmax: int
    xip: frozenset[int]

    @classmethod
    def parse(cls, text: str) -> XidSnapshot:
        xmin, xmax, xip = text.split(":")
        return cls(int(xmin), int(xmax), frozenset(int(x) for x in xip.split(",") if x))

    def full(self, xid: int) -> int:
        """The 64-bit id of a 32-bit one from the stream: the one nearest xmax (ids in use
        span less than 2^31, so there is exactly one)."""
        candidate = (self.xmax & ~0xFFFFFFFF) | xid
        if candidate > self.xmax + 0x7FFFFFFF:
            candidate -= 1 << 32
        elif candidate < self.xmax - 0x80000000:
            candidate += 1 << 32
        return candidate

    def sees(self, xid: int) -> bool:
        """Whether a committed transaction is visible in this snapshot."""
        full = self.full(xid)
        return full < self.xmin or (full < self.xmax and full not in self.xip)


class RecentCommits:
    """The ids of the last ``size`` commits the stream delivered, numbered in commit order.

    A ring of 32-bit ids (the stream's own width): 4 bytes a commit, allocated once. The
    mapping of id to number it replaces held 160-240 bytes a commit (tracemalloc), so a
    busy stream grew the daemon by 16-24 MB over its first 100,000 commits, which read as
    a leak in a soak."""

    def __init__(self, size: int) -> None:
        self._ring = array("I", bytes(array("I").itemsize * size))
        self._size = size
        self.count = 0  # commits delivered so far; the first is number 1

    def add(self, xid: int) -> None:
        self._ring[self.count % self._size] = xid
        self.count += 1

    def numbers(self, xids: Iterable[int]) -> dict[int, int]:
        """The commit number of each of ``xids`` still remembered; the others are left out.

        One copy of the ring and a byte search per id: 0.1-0.3 ms an id in a full ring of
        100,000 (a chunk asks for the ids its snapshot saw running, a few to a few dozen
        under OLTP), where a scan item by item costs milliseconds an id."""
        raw, width, found = self._ring.tobytes(), self._ring.itemsize, {}
        for xid in xids:
            needle = array("I", [xid]).tobytes()
            at = raw.find(needle)
            while at > 0 and at % width:  # a match across two ids' bytes
                at = raw.find(needle, at + 1)
            if at >= 0 and xid:  # 0 (InvalidTransactionId) marks slots never written
                slot = at // width
                found[xid] = self.count - (self.count - 1 - slot) % self._size
        return found


@dataclass(slots=True)
class _Watch:
    since: int  # commits counted when watching began: later ones count higher
    keys: dict[Key, list[int]] = field(default_factory=dict)  # key -> xids that changed it
    truncated_by: list[int] = field(default_factory=list)
    inserted_by: set[int] = field(default_factory=set)  # keyless tables: xids with inserts
    # Keys whose first watched change was an insert (its xid): the stream carried their whole
    # row, so a chunk that sees the insert need not publish it again.
    born: dict[Key, int] = field(default_factory=dict)


class StreamWatch:
    """What the stream changed in the tables being snapshotted, and which chunk rows that
    makes stale."""

    def __init__(self, recent: int = RECENT) -> None:
        self._tables: dict[TableName, _Watch] = {}
        self._recent = RecentCommits(recent)

    def __bool__(self) -> bool:
        return bool(self._tables)

    def __contains__(self, table: TableName) -> bool:
        return table in self._tables

    def tables(self) -> list[TableName]:
        return list(self._tables)

    def watch(self, table: TableName) -> None:
        if table not in self._tables:
            self._tables[table] = _Watch(self._recent.count)

    def unwatch(self, table: TableName) -> None:
        self._tables.pop(table, None)

    def committed(self, xid: int) -> None:
        """A transaction the stream delivered, in commit order (changes noted before)."""
        self._recent.add(xid)

    def changed(self, table: TableName, xid: int, key: Key, insert: bool = False) -> None:
        watch = self._tables[table]
        if insert and key not in watch.keys and key not in watch.born:
            watch.born[key] = xid
        watch.keys.setdefault(key, []).append(xid)

    def inserted(self, table: TableName, xid: int) -> None:
        self._tables[table].inserted_by.add(xid)

    def truncated(self, table: TableName, xid: int) -> None:
        self._tables[table].truncated_by.append(xid)

    def fresh(
        self,
        table: TableName,
        snap: XidSnapshot,
        rows: Sequence[Row],
        key_at: Sequence[int],
        xmins: Sequence[int] | None,
    ) -> list[Row] | None:
        """The rows of a chunk read in ``snap`` that the stream has not overtaken, or None
        if the chunk must be read again. Call it at the chunk's watermark.

        ``key_at``: positions of the key columns in a row (none: no key); ``xmins``: each
        row's inserting transaction, for chunks read by heap pages."""
        watch = self._tables[table]
        if snap.xip and any(
            number <= watch.since
            for number in self._recent.numbers(x & 0xFFFFFFFF for x in snap.xip).values()
        ):
            # A transaction that committed before the watch began was running when the
            # chunk was read: its changes were published unwatched.
            return None
        if any(not snap.sees(xid) for xid in watch.truncated_by):
            return []  # every row read is gone since; the stream said so already
        stale = {k for k, xids in watch.keys.items() if any(not snap.sees(x) for x in xids)}
        if xmins is None:
            # A row the stream inserted and the chunk saw is whole in Kafka already: not
            # twice. (Heap-page chunks go by xmin instead: a table without a key may hold
            # equal rows, which one key would stand for.)
            stale.update(k for k, xid in watch.born.items() if snap.sees(xid))
        if not key_at:
            stale.clear()
        inserted = watch.inserted_by if xmins is not None else set()
        if xmins is None:
            watch.inserted_by.clear()  # chunks follow the key: inserts are matched by key
        if not stale and not inserted:
            kept = list(rows)
        else:
            kept = [
                row
                for i, row in enumerate(rows)
                if not (stale and tuple(row[j] for j in key_at) in stale)
                and not (inserted and xmins is not None and xmins[i] in inserted)
            ]
        self._forget(watch, snap)
        return kept

    @staticmethod
    def _forget(watch: _Watch, snap: XidSnapshot) -> None:
        """Drop what every later chunk's snapshot sees too: later snapshots see all this
        one does, so such changes can make no later row stale. Inserting transactions stay:
        their rows may lie in chunks still to come."""
        watch.keys = {
            k: xids for k, xids in watch.keys.items() if any(not snap.sees(xid) for xid in xids)
        }
        watch.truncated_by = [x for x in watch.truncated_by if not snap.sees(x)]
