"""The initial snapshot: every published table as of the slot's consistent point.

The slot is created with an exported snapshot; the tables are read inside it (``SET
TRANSACTION SNAPSHOT``), so the rows are exactly the state at the consistent point and the
stream that follows starts right after it: no gap, no overlap.

The whole snapshot is ONE Kafka transaction, ended by a progress record at the consistent
point. Killed half-way, it leaves nothing a ``read_committed`` consumer can see; the next
start finds a slot with no progress, drops it and snapshots again from a fresh point.

Values are read as the raw text the types' output functions produce: byte for byte what
pgoutput sends, so one set of converters serves both paths.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import psycopg
from psycopg import sql
from psycopg.types.string import TextLoader

from services.bridge import messages as m
from services.bridge.events import EventBuilder
from services.bridge.sink import KafkaSink
from services.bridge.stream import SESSION_OPTIONS
from services.common.logs import log_event
from services.common.pg import SourceError, connect

log = logging.getLogger(__name__)

_FETCH = 5_000
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
       c.oid::int, c.relreplident, c.reltuples::bigint
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
WHERE n.nspname = %s AND c.relname = %s
ORDER BY a.attnum
"""


def published_tables(conn: psycopg.Connection[tuple[object, ...]],
                     publication: str) -> list[tuple[str, str]]:
    with conn.cursor() as cur:
        cur.execute("SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s"
                    " ORDER BY 1, 2", (publication,))
        return [(str(s), str(t)) for s, t in cur.fetchall()]


def take_snapshot(dsn: str, snapshot_name: str, publication: str, consistent_point: int,
                  builder: EventBuilder, sink: KafkaSink) -> int:
    """Publish every published table's rows into the open Kafka transaction; returns rows."""
    total = 0
    started = time.monotonic()
    with connect(dsn, autocommit=False, options=SESSION_OPTIONS) as conn:
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
        for schema, table in published_tables(conn, publication):
            relation, estimate = _relation(conn, schema, table)
            done = 0
            for topic, key, value in builder.transaction(
                    0, consistent_point, _now_pg_us(),
                    _rows(conn, relation, estimate), snapshot="true"):
                if topic == builder.transaction_topic:
                    continue  # a snapshot is not a source transaction
                if topic not in sink.known_topics:
                    sink.ensure_topics({topic: topic == builder.schema_topic})
                sink.produce(topic, key, value)
                done += 1
            total += done
        conn.rollback()
    seconds = time.monotonic() - started
    log_event(log, logging.INFO, "snapshot read", rows=total, seconds=round(seconds, 1),
              rows_per_s=round(total / seconds) if seconds else None)
    return total


def _relation(conn: psycopg.Connection[tuple[object, ...]], schema: str,
              table: str) -> tuple[m.Relation, int]:
    with conn.cursor() as cur:
        cur.execute(_COLUMNS_SQL, (schema, table))
        rows = cur.fetchall()
    columns = tuple(m.Column(str(name), int(str(oid)), int(str(mod)), bool(key))
                    for name, oid, mod, key, *_ in rows)
    rel_oid, ident, estimate = int(str(rows[0][4])), str(rows[0][5]), int(str(rows[0][6]))
    return m.Relation(None, rel_oid, schema, table, ident, columns), max(estimate, 0)


def _rows(conn: psycopg.Connection[tuple[object, ...]], relation: m.Relation,
          estimate: int) -> Iterator[tuple[int, m.Message]]:
    yield 0, relation
    name = f"{relation.namespace}.{relation.name}"
    # Raw text output of every column (what pgoutput sends): not a ::text cast, which
    # differs for some types (bool gives 'true', bpchar drops its padding).
    for column in relation.columns:
        conn.adapters.register_loader(column.type_oid, TextLoader)
    columns = sql.SQL(", ").join(sql.Identifier(c.name) for c in relation.columns)
    query = sql.SQL("SELECT {} FROM {}").format(
        columns, sql.Identifier(relation.namespace, relation.name))
    done = 0
    last_report = time.monotonic()
    try:
        # A named (server-side) cursor streams the table in batches: memory stays flat.
        with conn.cursor(name=f"snap_{relation.oid}") as cur:
            cur.itersize = _FETCH
            cur.execute(query)
            for row in cur:
                done += 1
                yield 0, m.Insert(None, relation.oid, list(row))  # type: ignore[arg-type]
                if time.monotonic() - last_report >= _PROGRESS_EVERY_S:
                    last_report = time.monotonic()
                    log_event(log, logging.INFO, "snapshot progress", table=name,
                              rows_done=done, rows_estimated=estimate)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise SourceError(f"cannot read table {name} for the snapshot: "
                          f"{exc.diag.message_primary}; GRANT SELECT ON {name} TO the bridge's "
                          "role, or remove the table from the publication") from None
    log_event(log, logging.INFO, "snapshot table done", table=name, rows=done)


def _now_pg_us() -> int:
    return int(time.time() * 1_000_000) - 946_684_800_000_000
