"""Snapshots: tables' rows as of a consistent point, as ``op: "r"`` records.

The initial snapshot reads every published table inside the snapshot the slot exported
when it was created (``SET TRANSACTION SNAPSHOT``): exactly the state at the slot's
consistent point, and the stream that follows starts right after it: no gap, no overlap.
It is ONE Kafka transaction, ended by a progress record at the consistent point. Killed
half-way, it leaves nothing a ``read_committed`` consumer can see; the next start finds a
slot with no progress, drops it and snapshots again from a fresh point.

A table added to the publication later is read the same way inside the snapshot of a
temporary slot (``snapshot_tables``); ``coverage.py`` says which of the stream's changes
that snapshot already holds.

Values are read as the raw text the types' output functions produce: byte for byte what
pgoutput sends, so one set of converters serves both paths. A table is read in ctid
ranges (TID range scans), each through a server-side cursor: memory stays flat however
large the table, and pages done out of the heap's size give progress even for a table
never analysed. Ranges do not make a snapshot resumable, though: no exported snapshot
outlives its session, so an interrupted snapshot starts over.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.string import TextLoader

from services.bridge import messages as m
from services.bridge.coverage import TableName
from services.bridge.events import EventBuilder
from services.bridge.sink import KafkaSink
from services.bridge.source import PublishedTable, published_tables
from services.bridge.stream import SESSION_OPTIONS, ReplicationConnection, now_pg_us
from services.common.logs import log_event
from services.common.lsn import format_lsn
from services.common.pg import SourceError, connect

log = logging.getLogger(__name__)

_FETCH = 5_000
_RANGE_PAGES = 1_024  # 8 MB of heap per ctid range
_PROGRESS_EVERY_S = 5.0

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
       c.oid::int, c.relreplident, c.reltuples::bigint,
       pg_relation_size(c.oid) / current_setting('block_size')::int
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE n.nspname = %s AND c.relname = %s AND a.attname = ANY(%s)
ORDER BY a.attnum
"""


class SnapshotProgress:
    """Rows done per table of the snapshots this process took: for ``/snapshot`` and status.

    Written by whichever thread snapshots, read by the HTTP server's threads.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[str, dict[str, Any]] = {}

    def table(self, name: str, lsn: int, estimate: int | None) -> None:
        with self._lock:
            self._tables[name] = {"state": "reading", "lsn": format_lsn(lsn), "rows_done": 0,
                                  "rows_estimated": estimate, "started_at": time.time()}

    def rows(self, name: str, done: int, estimate: int | None,
             finished: bool = False) -> None:
        with self._lock:
            entry = self._tables[name]
            entry["rows_done"] = done
            entry["rows_estimated"] = estimate
            if finished:
                entry["state"] = "read"

    def published(self, names: Collection[str]) -> None:
        with self._lock:
            for name in names:
                self._tables[name]["state"] = "published"

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {"tables": {name: dict(entry) for name, entry in self._tables.items()}}


def take_snapshot(dsn: str, snapshot_name: str, publication: str, consistent_point: int,
                  builder: EventBuilder, sink: KafkaSink, progress: SnapshotProgress,
                  only: Collection[TableName] | None = None) -> list[TableName]:
    """Publish the rows of the published tables (or of ``only`` those) into the open Kafka
    transaction, as of the exported snapshot; returns the tables read."""
    total = 0
    started = time.monotonic()
    # Records sort before every change the stream carries from the consistent point on,
    # a commit exactly at it included (consumers order by commit LSN).
    position = consistent_point - 1
    with connect(dsn, autocommit=False, options=SESSION_OPTIONS) as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
        # Publication membership as of the snapshot: a table removed since is not read.
        tables = [t for t in published_tables(conn, publication) if only is None or t.name in only]
        for table in tables:
            relation, heap = _relation(conn, table)
            progress.table(".".join(table.name), consistent_point, heap.rows)
            for topic, key, value in builder.transaction(
                    0, position, now_pg_us(), _rows(conn, relation, heap, table.row_filter,
                                                    progress),
                    snapshot="true"):
                if topic == builder.transaction_topic:
                    continue  # a snapshot is not a source transaction
                if topic not in sink.known_topics:
                    sink.ensure_topics({topic: topic == builder.schema_topic})
                sink.produce(topic, key, value)
                total += topic != builder.schema_topic
        conn.rollback()
    seconds = time.monotonic() - started
    log_event(log, logging.INFO, "snapshot read", tables=len(tables), rows=total,
              seconds=round(seconds, 1), rows_per_s=round(total / seconds) if seconds else None)
    return [t.name for t in tables]


class AddedTableSnapshots:
    """Snapshots of tables added to the publication while the bridge streams.

    Each is read inside the snapshot a temporary slot exports: the slot's consistent
    point tells exactly which of the stream's changes the snapshot already holds.
    Creating the slot waits for the transactions open at that moment to end, prepared
    ones included, so a long transaction delays the snapshot (and the stream behind it).
    """

    def __init__(self, dsn: str, slot_name: str, publication: str, builder: EventBuilder,
                 sink: KafkaSink, progress: SnapshotProgress) -> None:
        self._dsn = dsn
        self._slot = f"{slot_name[:57]}_snap"
        self._publication = publication
        self._builder = builder
        self._sink = sink
        self._progress = progress
        self._creating: ReplicationConnection | None = None

    def cancel(self) -> None:
        """Cancel a temporary slot creation that is waiting for transactions to end."""
        repl = self._creating
        if repl is not None:
            repl.cancel()

    def take(self, tables: Sequence[TableName]) -> tuple[int, list[TableName]]:
        with connect(self._dsn) as conn:
            published = {t.name for t in published_tables(conn, self._publication)}
        tables = [t for t in tables if t in published]
        if not tables:
            # Not worth a temporary slot, which waits for every open transaction.
            return 0, []
        repl = ReplicationConnection(self._dsn)
        try:
            log_event(log, logging.INFO, "snapshot of added tables starting",
                      tables=[f"{s}.{t}" for s, t in tables])
            self._creating = repl
            try:
                created = repl.export_snapshot(self._slot)
            finally:
                self._creating = None
            assert created.snapshot_name is not None
            read = take_snapshot(self._dsn, created.snapshot_name, self._publication,
                                 created.consistent_point, self._builder, self._sink,
                                 self._progress, only=tables)
        finally:
            repl.close()  # drops the temporary slot
        return created.consistent_point, read

    def published(self, tables: Sequence[TableName]) -> None:
        self._progress.published([f"{s}.{t}" for s, t in tables])


@dataclass(frozen=True, slots=True)
class _Heap:
    pages: int  # 0 for a partitioned table: its rows live in its partitions
    rows: int | None  # the planner's estimate; None until first vacuumed or analysed


def _relation(conn: psycopg.Connection[tuple[object, ...]],
              published: PublishedTable) -> tuple[m.Relation, _Heap]:
    schema, table = published.name
    with conn.cursor() as cur:
        cur.execute(_COLUMNS_SQL, (schema, table, published.columns))
        rows = cur.fetchall()
    columns = tuple(m.Column(str(name), int(str(oid)), int(str(mod)), bool(key))
                    for name, oid, mod, key, *_ in rows)
    rel_oid, ident, estimate, pages = (int(str(rows[0][4])), str(rows[0][5]),
                                       int(str(rows[0][6])), int(str(rows[0][7])))
    return (m.Relation(None, rel_oid, schema, table, ident, columns),
            _Heap(pages, estimate if estimate >= 0 else None))


def _ranges(pages: int, row_filter: str | None) -> list[sql.Composable]:
    """WHERE clauses covering the heap in ctid ranges, each with the publication's row
    filter. The heap is read after the snapshot was taken, so pages added since hold no
    row it sees; the last range is open all the same, which costs nothing."""
    # The server's own deparsed expression, from the catalogue: SQL already.
    keep = [sql.SQL(f"({row_filter})")] if row_filter is not None else []
    if pages == 0:
        return [sql.SQL(" WHERE {}").format(keep[0]) if keep else sql.SQL("")]
    out: list[sql.Composable] = []
    for start in range(0, pages, _RANGE_PAGES):
        terms = [sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({start},0)"))]
        if start + _RANGE_PAGES < pages:
            terms.append(sql.SQL("ctid < {}::tid").format(
                sql.Literal(f"({start + _RANGE_PAGES},0)")))
        out.append(sql.SQL(" WHERE ") + sql.SQL(" AND ").join(terms + keep))
    return out


def _rows(conn: psycopg.Connection[tuple[object, ...]], relation: m.Relation, heap: _Heap,
          row_filter: str | None, progress: SnapshotProgress) -> Iterator[tuple[int, m.Message]]:
    yield 0, relation
    name = f"{relation.namespace}.{relation.name}"
    # Raw text output of every column (what pgoutput sends): not a ::text cast, which
    # differs for some types (bool gives 'true', bpchar drops its padding).
    for column in relation.columns:
        conn.adapters.register_loader(column.type_oid, TextLoader)
    columns = sql.SQL(", ").join(sql.Identifier(c.name) for c in relation.columns)
    select = sql.SQL("SELECT {} FROM {}").format(
        columns, sql.Identifier(relation.namespace, relation.name))
    ranges = _ranges(heap.pages, row_filter)
    estimate = heap.rows
    done = 0
    started = last_report = time.monotonic()
    try:
        for n, where in enumerate(ranges, 1):
            # A named (server-side) cursor streams the range in batches: memory stays flat.
            with conn.cursor(name=f"snap_{relation.oid}") as cur:
                cur.itersize = _FETCH
                cur.execute(select + where)
                for row in cur:
                    done += 1
                    yield 0, m.Insert(None, relation.oid, list(row))  # type: ignore[arg-type]
                    if done % 1000 == 0 and time.monotonic() - last_report >= _PROGRESS_EVERY_S:
                        last_report = time.monotonic()
                        progress.rows(name, done, estimate)
                        rate = done / (last_report - started)
                        log_event(log, logging.INFO, "snapshot progress", table=name,
                                  rows_done=done, rows_estimated=estimate,
                                  ranges_done=f"{n - 1}/{len(ranges)}", rows_per_s=round(rate),
                                  eta_s=round((estimate - done) / rate)
                                  if estimate is not None and estimate > done else None)
            if heap.rows is None and n < len(ranges):
                # Never analysed: extrapolate from the share of the heap read so far.
                estimate = round(done * len(ranges) / n)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise SourceError(f"cannot read table {name} for the snapshot: "
                          f"{exc.diag.message_primary}; GRANT SELECT ON {name} TO the bridge's "
                          "role, or remove the table from the publication") from None
    progress.rows(name, done, done, finished=True)
    log_event(log, logging.INFO, "snapshot table read", table=name, rows=done)
