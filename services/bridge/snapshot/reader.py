"""Snapshots: tables' rows as ``op: "r"`` records, read in chunks while the stream flows.

A table snapshot is a sequence of chunks, each read by a ``ChunkReader`` thread in a
transaction of its own and closed by a watermark written into the WAL in that same
transaction; the publisher meets the watermark in the stream, drops the rows the stream
has overtaken (``chunks.py``) and publishes the rest at that place, in the same Kafka
transaction as the progress record that says how far the table got. So a snapshot
resumes after a crash at its last published chunk, no Kafka timeout bounds a table, and
the stream never waits for a table to finish.

Chunks follow the table's key (keyset pages: ``WHERE key > last ORDER BY key LIMIT n``),
or, for a table without one, its heap in ranges of pages (TID range scans); such a
table's rows carry their inserting transaction so the stream's inserts are not doubled
(see ``chunks.py`` for what a keyless table cannot promise).

Each chunk locks its table in ACCESS SHARE mode before its snapshot is taken and reads
the columns the publication publishes inside that snapshot: a concurrent ALTER TABLE
either finished before (the chunk reads the new shape) or waits for the watermark (the
stream carries the change after the rows). Rows carry the schema version they were read
with.

Values are read as the raw text the types' output functions produce: byte for byte what
pgoutput sends, so one set of converters serves both paths, and a key read here equals
the same key in the stream.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import sql
from psycopg.rows import RowMaker
from psycopg.types.string import TextLoader

from services.bridge.decode import messages as m
from services.bridge.receive.stream import SESSION_OPTIONS
from services.bridge.snapshot.chunks import Row, TableName, XidSnapshot
from services.bridge.source import PublishedTable, published_tables
from services.common.failpoints import failpoint
from services.common.logs import log_event
from services.common.pg import SourceRefused, connect
from services.contract.records import EndedSnapshot, TableSnapshot

log = logging.getLogger(__name__)

WATERMARK = "slotbridge.watermark"
SIGNAL = "slotbridge.signal"
_FETCH = 2_000
_LOCK_TIMEOUT_MS = 5_000
# Ended snapshots the progress record keeps: `slotbridge snapshot` polls every 2 s, so a
# request's entry outlives its poll unless 16 others end meanwhile.
ENDED_KEPT = 16

_COLUMNS_SQL = """
SELECT a.attname, a.atttypid::int, a.atttypmod,
       CASE c.relreplident
         WHEN 'f' THEN true
         WHEN 'n' THEN false
         WHEN 'i' THEN EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid
                               AND i.indisreplident AND a.attnum = ANY(i.indkey))
         ELSE EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid
                      AND i.indisprimary AND a.attnum = ANY(i.indkey))
       END,
       EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid
               AND i.indisprimary AND a.attnum = ANY(i.indkey)),
       format_type(a.atttypid, a.atttypmod),
       c.oid::int, c.relreplident, c.relkind::text, c.reltuples::bigint,
       pg_relation_size(c.oid) / current_setting('block_size')::int,
       pg_current_snapshot()::text
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE n.nspname = %s AND c.relname = %s AND a.attname = ANY(%s)
ORDER BY a.attnum
"""


@dataclass(slots=True)
class Chunk:
    """Rows of one chunk as read, waiting for their watermark."""

    token: str
    table: TableName
    relation: m.Relation
    rows: list[Row]
    keyed: bool  # rows follow the key; else heap pages, with xmins
    xmins: list[int] | None
    snapshot: XidSnapshot
    start: list[str | None] | None  # the entry's cursor it was read from
    cursor: list[str | None]  # where the next chunk starts
    last: bool
    estimate: int | None


@dataclass(slots=True)
class _Entry:
    state: TableSnapshot
    # Where the next chunk is read from: the cursor of the last chunk read, which can be
    # ahead of the published one (``state.cursor``) by the chunks in flight.
    read_from: list[str | None] | None
    # Chunks read and not yet published, oldest first: their watermarks are in this order
    # in the WAL, since a table's chunks are read one after another.
    in_flight: list[str] = field(default_factory=list)
    read_all: bool = False  # its last chunk is in flight
    failed: str | None = None  # why it cannot go on; it ends where the stream says so
    estimate: int | None = None
    claimed: bool = False  # a reader works on it
    started: float = field(default_factory=time.monotonic)
    rows_at_start: int = 0

    @classmethod
    def of(cls, state: TableSnapshot) -> _Entry:
        return cls(state, read_from=state.cursor, rows_at_start=state.rows)


# Chunks a table may have in flight: one published while the next is read keeps both the
# publisher and the reader busy; more would only hold memory.
_AHEAD = 2


class SnapshotBook:
    """The table snapshots under way, shared by the chunk readers, the publisher and the
    HTTP server. The publisher alone moves an entry's cursor, so what the progress record
    says is always what Kafka holds.

    ``held``: how many chunks may wait for their watermark at once, over all tables; with
    the chunk a reader holds, memory stays under (``held`` + readers) chunks."""

    def __init__(
        self,
        states: Collection[TableSnapshot] = (),
        held: int = 2,
        ended: Collection[EndedSnapshot] = (),
    ) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._entries: dict[TableName, _Entry] = {}
        self._chunks: dict[str, Chunk] = {}
        self._held = held
        self._closed = False
        self._done: dict[str, dict[str, Any]] = {}
        self._ended = deque(ended, maxlen=ENDED_KEPT)
        self.last_progress = time.monotonic()
        for state in states:
            self._entries[(state.schema_, state.table)] = _Entry.of(state)

    # -- requests (publisher thread) -------------------------------------------------

    def add(self, table: TableName, request_id: str, where: str | None = None) -> str | None:
        """Start a table's snapshot; returns the request already under way for the table
        instead, if there is one (it is never cut short by another)."""
        with self._cond:
            entry = self._entries.get(table)
            if entry is not None:
                return entry.state.id
            self._entries[table] = _Entry.of(
                TableSnapshot(
                    schema=table[0],
                    table=table[1],
                    id=request_id,
                    where=where,
                    started_ms=int(time.time() * 1000),
                )
            )
            self._cond.notify_all()
            return None

    def cancel(self, request: str) -> list[TableName]:
        """End the snapshots of a request id or a ``schema.table``: cancelled, or failed
        for one a reader gave up on (``fail``)."""
        with self._cond:
            gone = [
                t for t, e in self._entries.items() if request in (e.state.id, f"{t[0]}.{t[1]}")
            ]
            for table in gone:
                reason = self._entries[table].failed
                self._finish(table, "failed" if reason else "cancelled", reason)
            return gone

    def covers(self, table: TableName) -> bool:
        with self._cond:
            return table in self._entries

    def tables(self) -> list[TableName]:
        with self._cond:
            return list(self._entries)

    def states(self) -> list[TableSnapshot]:
        """What the progress record carries of the snapshots under way."""
        with self._cond:
            return [e.state.model_copy() for e in self._entries.values()]

    def ended(self) -> list[EndedSnapshot]:
        """What the progress record carries of the last snapshots that ended."""
        with self._cond:
            return list(self._ended)

    # -- chunks ----------------------------------------------------------------------

    def claim(self, timeout: float) -> TableSnapshot | None:
        """A table for a reader, with ``cursor`` where its next chunk starts: one no other
        reader holds, until ``release`` (a table's chunks are read one after another)."""
        with self._cond:
            for _ in range(2):
                if len(self._chunks) < self._held:
                    for entry in self._entries.values():
                        if not (
                            entry.claimed
                            or entry.read_all
                            or entry.failed
                            or len(entry.in_flight) >= _AHEAD
                        ):
                            entry.claimed = True
                            return entry.state.model_copy(update={"cursor": entry.read_from})
                if self._closed:
                    return None
                self._cond.wait(timeout)
            return None

    def release(self, table: TableName) -> None:
        with self._cond:
            entry = self._entries.get(table)
            if entry is not None:
                entry.claimed = False
            self._cond.notify_all()

    def offer(self, chunk: Chunk) -> bool:
        """A chunk read, before its watermark commits; False if its table's snapshot
        ended, or went back to an earlier chunk, meanwhile."""
        with self._cond:
            entry = self._entries.get(chunk.table)
            if entry is None or entry.read_from != chunk.start or self._closed:
                return False
            entry.in_flight.append(chunk.token)
            entry.read_from, entry.read_all = chunk.cursor, chunk.last
            self.last_progress = time.monotonic()
            entry.estimate = chunk.estimate
            self._chunks[chunk.token] = chunk
            return True

    def withdraw(self, chunk: Chunk) -> None:
        """Its watermark did not commit."""
        self.again(chunk)

    def take(self, token: str) -> Chunk | None:
        """The chunk whose watermark the publisher met; None for a watermark of an earlier
        session, of a snapshot that ended since, or of a chunk read after one that must be
        read again."""
        with self._cond:
            chunk = self._chunks.pop(token, None)
            self._cond.notify_all()
            if chunk is None:
                return None
            entry = self._entries.get(chunk.table)
            ok = entry is not None and entry.in_flight[:1] == [token]
            return chunk if ok else None

    def again(self, chunk: Chunk) -> None:
        """The chunk must be read again, and so must every chunk of its table read after
        it: their rows are published after its own, or the stream's order breaks."""
        with self._cond:
            entry = self._entries.get(chunk.table)
            if entry is not None and chunk.token in entry.in_flight:
                for token in entry.in_flight:
                    self._chunks.pop(token, None)
                entry.in_flight.clear()
                entry.read_from, entry.read_all = chunk.start, False
            self._chunks.pop(chunk.token, None)
            self._cond.notify_all()

    def advance(self, chunk: Chunk, published: int) -> bool:
        """The chunk's rows are in the open Kafka transaction; True when the table is done."""
        with self._cond:
            entry = self._entries[chunk.table]
            state = entry.state
            state.cursor, state.chunks, state.rows = (
                chunk.cursor,
                state.chunks + 1,
                state.rows + published,
            )
            entry.in_flight.remove(chunk.token)
            self.last_progress = time.monotonic()
            if chunk.last:
                self._finish(chunk.table, "done")
            self._cond.notify_all()
            return chunk.last

    def fail(self, table: TableName, reason: str) -> None:
        """A snapshot that cannot go on (its condition fails, the table is gone): no more
        chunks; it ends when the publisher meets the reader's cancel in the stream, so
        the progress record that drops it is a published one."""
        with self._cond:
            entry = self._entries.get(table)
            if entry is not None:
                entry.failed = reason

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _finish(
        self,
        table: TableName,
        outcome: Literal["done", "cancelled", "failed"],
        reason: str | None = None,
    ) -> None:
        entry = self._entries.pop(table)
        self._ended.append(
            EndedSnapshot(
                **entry.state.model_dump(by_alias=True),
                outcome=outcome,
                reason=reason,
                ended_ms=int(time.time() * 1000),
            )
        )
        state = f"{outcome}: {reason}" if reason else outcome
        self._done[f"{table[0]}.{table[1]}"] = {**self._report(entry), "state": state}
        self._cond.notify_all()

    # -- reporting -------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """Per table: chunks and rows done, the estimate, rate and ETA (``/snapshot``)."""
        with self._cond:
            tables = dict(self._done)
            tables.update({f"{t[0]}.{t[1]}": self._report(e) for t, e in self._entries.items()})
            return {"tables": tables}

    @staticmethod
    def _report(entry: _Entry) -> dict[str, Any]:
        state = entry.state
        seconds = time.monotonic() - entry.started
        rate = (state.rows - entry.rows_at_start) / seconds if seconds > 0 else 0.0
        left = entry.estimate - state.rows if entry.estimate is not None else None
        return {
            "state": "reading",
            "request": state.id,
            "where": state.where,
            "chunks_done": state.chunks,
            "rows_done": state.rows,
            "rows_estimated": entry.estimate,
            "seconds": round(seconds, 1),
            "rows_per_s": round(rate),
            "eta_s": round(left / rate) if left is not None and left > 0 and rate else None,
        }


@dataclass(frozen=True, slots=True)
class _Shape:
    relation: m.Relation
    key_names: tuple[str, ...]  # chunk order; () for heap pages
    key_types: tuple[str, ...]
    partitioned: bool
    estimate: int | None
    pages: int
    snapshot: XidSnapshot


class ChunkReader(threading.Thread):
    """Reads chunks of the book's tables, one at a time, each closed by its watermark."""

    def __init__(
        self,
        name: str,
        dsn: str,
        slot: str,
        publication: str,
        book: SnapshotBook,
        chunk_rows: int,
        chunk_bytes: int,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self._dsn = dsn
        self._slot = slot
        self._publication = publication
        self._book = book
        self._chunk_rows = chunk_rows
        self._chunk_bytes = chunk_bytes
        self._session = uuid.uuid4().hex[:12]
        self._seq = 0
        self._stop_event = threading.Event()
        self._conn: psycopg.Connection[tuple[object, ...]] | None = None
        self.error: BaseException | None = None

    def stop(self) -> None:
        self._stop_event.set()
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                conn.cancel_safe(timeout=2)

    def run(self) -> None:
        try:
            with connect(self._dsn, autocommit=False, options=SESSION_OPTIONS) as conn:
                self._conn = conn
                conn.execute(f"SET lock_timeout = {_LOCK_TIMEOUT_MS}")
                conn.commit()
                while not self._stop_event.is_set():
                    state = self._book.claim(0.5)
                    if state is None:
                        continue
                    try:
                        self._one(conn, state)
                    finally:
                        self._book.release((state.schema_, state.table))
        except BaseException as exc:
            if not self._stop_event.is_set():
                self.error = exc
        finally:
            self._conn = None

    def _one(self, conn: psycopg.Connection[tuple[object, ...]], state: TableSnapshot) -> None:
        table = (state.schema_, state.table)
        name = f"{table[0]}.{table[1]}"
        try:
            chunk = self._read(conn, state)
        except psycopg.errors.LockNotAvailable:
            conn.rollback()
            log_event(
                log,
                logging.INFO,
                "snapshot chunk waits for a lock on its table (DDL running?)",
                table=name,
            )
            return
        except psycopg.errors.InsufficientPrivilege as exc:
            conn.rollback()
            raise SourceRefused(
                f"cannot read table {name} for the snapshot: "
                f"{exc.diag.message_primary}; GRANT SELECT ON {name} TO the "
                "bridge's role, or remove the table from the publication"
            ) from None
        except psycopg.Error as exc:
            # Checked by `slotbridge snapshot`, an on-demand condition can still fail on
            # some row (a division by zero): that request ends, the bridge goes on.
            conn.rollback()
            if state.where is None or isinstance(exc, psycopg.OperationalError):
                raise
            reason = f"its condition {state.where!r} fails: {exc.diag.message_primary or exc}"
            log_event(
                log, logging.ERROR, f"snapshot of {name} abandoned: {reason}", request=state.id
            )
            self._abandon(conn, table, reason)
            return
        if chunk is None:  # no longer published, or gone
            conn.rollback()
            self._abandon(conn, table, "the table is no longer published")
            return
        if not self._book.offer(chunk):
            conn.rollback()
            return
        try:
            failpoint("before_watermark")
            conn.execute(
                "SELECT pg_logical_emit_message(true, %s, %s)",
                (WATERMARK, json.dumps({"slot": self._slot, "chunk": chunk.token})),
            )
            conn.commit()
        except BaseException:
            self._book.withdraw(chunk)
            raise

    def _abandon(
        self, conn: psycopg.Connection[tuple[object, ...]], table: TableName, reason: str
    ) -> None:
        """Ends the table's snapshot in stream order, through the cancel a user would send:
        until a progress record drops it, a restart would resume it."""
        self._book.fail(table, reason)
        conn.execute(
            "SELECT pg_logical_emit_message(true, %s, %s)",
            (SIGNAL, json.dumps({"slot": self._slot, "cancel": f"{table[0]}.{table[1]}"})),
        )
        conn.commit()

    def _read(
        self, conn: psycopg.Connection[tuple[object, ...]], state: TableSnapshot
    ) -> Chunk | None:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        schema, table = state.schema_, state.table
        ident = sql.Identifier(schema, table)
        try:
            # Before the snapshot is taken (LOCK takes none): DDL committed before is seen,
            # DDL after waits for this transaction, which ends with the watermark.
            conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS SHARE MODE").format(ident))
        except psycopg.errors.UndefinedTable:
            return None
        published = next(
            (p for p in published_tables(conn, self._publication) if p.name == (schema, table)),
            None,
        )
        if published is None:
            return None
        shape = _shape(conn, published)
        for column in shape.relation.columns:
            conn.adapters.register_loader(column.type_oid, TextLoader)
        self._seq += 1
        token = f"{self._session}:{self._seq}"
        terms: list[sql.Composable] = []
        if published.row_filter is not None:
            # The server's own deparsed expression, from the catalogue: SQL already.
            terms.append(sql.SQL(_literal_percent(published.row_filter)))
        if state.where is not None:
            terms.append(sql.SQL(_literal_percent(state.where)))
        keyed = bool(shape.key_names)
        if keyed:
            query, params = _key_query(state, shape, terms, self._chunk_rows)
        else:
            start = int(state.cursor[0] or 0) if state.cursor is not None else 0
            pages = max(
                1,
                round(self._chunk_rows * shape.pages / shape.estimate) if shape.estimate else 1_024,
            )
            stop = start + pages
            query, params = _page_query(state, shape, terms, start, stop), []
            if not shape.partitioned:
                # A cut by bytes resumes at the next page, so pages must come in order: a
                # TID range scan returns them so, a (synchronised) seq scan may not.
                conn.execute("SET LOCAL enable_seqscan = off")
        with conn.cursor(name=f"chunk_{token.replace(':', '_')}", row_factory=_list_row) as cur:
            cur.itersize = _FETCH
            cur.execute(query, params)
            # A keyless partitioned table has no position to resume from (a ctid names a
            # row of one partition only): it is one chunk, however large.
            rows, cut = self._fetch(cur, bounded=keyed or not shape.partitioned)
            if cut and not keyed:
                stop = _finish_page(cur, rows) + 1
        xmins: list[int] | None = None
        if keyed:
            index = {c.name: i for i, c in enumerate(shape.relation.columns)}
            full = len(rows) >= self._chunk_rows or cut
            last = not full or not rows
            cursor = [rows[-1][index[n]] for n in shape.key_names] if rows else state.cursor or []
        else:
            xmins = [int(str(r[1])) for r in rows]
            rows = [r[2:] for r in rows]
            last = not cut and (shape.partitioned or stop >= shape.pages)
            cursor = [str(stop)]
        return Chunk(
            token,
            (schema, table),
            shape.relation,
            rows,
            keyed,
            xmins,
            shape.snapshot,
            state.cursor,
            cursor,
            last,
            shape.estimate,
        )

    def _fetch(
        self, cur: psycopg.ServerCursor[list[str | None]], bounded: bool
    ) -> tuple[list[list[str | None]], bool]:
        """The query's rows, up to ``chunk_bytes`` of values when ``bounded``; and whether
        that bound cut it."""
        rows: list[list[str | None]] = []  # text or NULL: nothing here is TOASTed-unchanged
        size = 0
        while not bounded or size < self._chunk_bytes:
            batch = cur.fetchmany(_FETCH)
            if not batch:
                break
            rows.extend(batch)
            size += sum(len(v) for row in batch for v in row if v is not None)
        return rows, bounded and size >= self._chunk_bytes


def _key_query(
    state: TableSnapshot, shape: _Shape, terms: list[sql.Composable], limit: int
) -> tuple[sql.Composed, list[object]]:
    """The next ``limit`` rows in key order after the entry's cursor, and its parameters."""
    params: list[object] = []
    if state.cursor is not None:
        terms.append(
            sql.SQL("({}) > ({})").format(
                sql.SQL(", ").join(sql.Identifier(n) for n in shape.key_names),
                sql.SQL(", ").join(
                    sql.SQL("CAST({} AS {})").format(sql.Placeholder(), sql.SQL(t))
                    for t in shape.key_types
                ),
            )
        )
        params.extend(state.cursor)
    query = sql.SQL("SELECT {} FROM {}{} ORDER BY {} LIMIT {}").format(
        _column_list(shape),
        sql.Identifier(state.schema_, state.table),
        _where(terms),
        sql.SQL(", ").join(sql.Identifier(n) for n in shape.key_names),
        sql.Literal(limit),
    )
    return query, params


def _page_query(
    state: TableSnapshot, shape: _Shape, terms: list[sql.Composable], start: int, stop: int
) -> sql.Composed:
    """A keyless table's rows on heap pages ``start`` to ``stop``, after their ctid and xmin
    (a partitioned table's all at once)."""
    if not shape.partitioned:
        terms.append(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({start},0)")))
        if stop < shape.pages:
            terms.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({stop},0)")))
    return sql.SQL("SELECT ctid::text, xmin::text, {} FROM {}{}").format(
        _column_list(shape), sql.Identifier(state.schema_, state.table), _where(terms)
    )


def _column_list(shape: _Shape) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(c.name) for c in shape.relation.columns)


def _finish_page(cur: psycopg.ServerCursor[list[str | None]], rows: list[list[str | None]]) -> int:
    """Reads on to the end of the heap page of the last row read, so the next chunk can
    start at the next page; returns the page. Rows are ``[ctid, xmin, ...]``."""
    page = _page(rows[-1][0])
    while batch := cur.fetchmany(_FETCH):
        for at, row in enumerate(batch):
            row_page = _page(row[0])
            if row_page < page:
                raise RuntimeError(
                    f"heap pages read out of order ({row_page} after {page}):"
                    " a snapshot chunk would skip rows"
                )
            if row_page > page:
                rows.extend(batch[:at])
                return page
        rows.extend(batch)
    return page


def _page(ctid: str | None) -> int:
    """The heap page of a ``ctid`` in its text form ``(page,item)``."""
    return int(str(ctid)[1:].partition(",")[0])


def _list_row(_cursor: object) -> RowMaker[list[str | None]]:
    """Rows as lists: what an Insert message holds, so publishing copies none."""
    return list


def _literal_percent(condition: str) -> str:
    """A condition as a term of a query with parameters, where % marks a placeholder."""
    return f"({condition.replace('%', '%%')})"


def _where(terms: list[sql.Composable]) -> sql.Composable:
    return sql.SQL(" WHERE ") + sql.SQL(" AND ").join(terms) if terms else sql.SQL("")


def _shape(conn: psycopg.Connection[tuple[object, ...]], published: PublishedTable) -> _Shape:
    """The table's published columns and chunk key, inside the chunk's snapshot (this query
    takes it)."""
    schema, table = published.name
    with conn.cursor() as cur:
        cur.execute(_COLUMNS_SQL, (schema, table, published.columns))
        rows = cur.fetchall()
    columns = tuple(
        m.Column(str(name), int(str(oid)), int(str(mod)), bool(key))
        for name, oid, mod, key, *_ in rows
    )
    first = rows[0]
    rel_oid, ident, kind = int(str(first[6])), str(first[7]), str(first[8])
    estimate, pages, snapshot = int(str(first[9])), int(str(first[10])), str(first[11])
    # The key records carry (the catalogue's rule in catalog.py): the replica identity's
    # columns, or the primary key under REPLICA IDENTITY FULL. Without one, heap pages.
    if ident == "f":
        key = [(str(r[0]), str(r[5])) for r in rows if r[4]]
    elif ident in ("d", "i"):
        key = [(str(r[0]), str(r[5])) for r in rows if r[3]]
    else:
        key = []
    return _Shape(
        m.Relation(None, rel_oid, schema, table, ident, columns),
        tuple(n for n, _ in key),
        tuple(t for _, t in key),
        kind == "p",
        estimate if estimate >= 0 else None,
        pages,
        XidSnapshot.parse(snapshot),
    )
