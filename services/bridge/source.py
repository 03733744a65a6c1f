"""The source database: preflight checks, publication and slot setup, catalogue facts.

Everything here runs over a plain SQL connection before streaming starts (or when a new
relation shows up), and every refusal is one line that names the problem and the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import cast

import psycopg
from psycopg import sql

from services.bridge.records.catalog import ColumnFacts, TableFacts
from services.bridge.records.masking import Masking, MaskingRefused, PublishedColumn
from services.bridge.records.routing import Routing, RoutingRefused, TableShape
from services.bridge.settings import BridgeSettings
from services.common.logs import log_event
from services.common.pg import SourceError, SourceRefused

log = logging.getLogger(__name__)

Conn = psycopg.Connection[tuple[object, ...]]


@dataclass(frozen=True, slots=True)
class SlotState:
    plugin: str
    failover: bool
    two_phase: bool
    active_pid: int | None
    confirmed_flush: str | None
    invalidation_reason: str | None


def preflight(conn: Conn, settings: BridgeSettings) -> None:
    """Refuse a source that cannot work: wal_level, role, publication tables."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT current_setting('wal_level'),"
            " current_setting('server_version_num')::int, rolreplication OR rolsuper"
            " FROM pg_roles WHERE rolname = current_user"
        )
        row = cur.fetchone()
    assert row is not None
    wal_level, version, can_replicate = row
    if int(str(version)) < 170000:
        raise SourceError(
            f"the source runs PostgreSQL {int(str(version)) // 10000}; slotbridge "
            "needs 17 or newer (failover slots)"
        )
    if wal_level != "logical":
        raise SourceError(
            f"wal_level is '{wal_level}' on the source; set wal_level = logical "
            "(ALTER SYSTEM SET wal_level = logical) and restart PostgreSQL"
        )
    if not can_replicate:
        raise SourceError(
            "the bridge's role lacks the REPLICATION attribute; run "
            "ALTER ROLE <role> REPLICATION (a superuser is not needed)"
        )
    if settings.tables:
        missing = _missing_tables(conn, settings.tables)
        if missing:
            raise SourceError(
                f"configured table(s) not found on the source: {', '.join(missing)};"
                " fix 'tables' in the settings or create them"
            )


def _missing_tables(conn: Conn, tables: list[str]) -> list[str]:
    missing = []
    with conn.cursor() as cur:
        for name in tables:
            schema, table = name.split(".")
            cur.execute(
                "SELECT 1 FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
                " WHERE n.nspname = %s AND c.relname = %s AND c.relkind IN ('r','p')",
                (schema, table),
            )
            if cur.fetchone() is None:
                missing.append(name)
    return missing


def ensure_publication(conn: Conn, settings: BridgeSettings, slot_is_new: bool) -> None:
    """Check the publication covers ``tables``; create it only together with the slot.

    pgoutput looks a publication up in the catalogue as it was at each change's WAL
    position, so one that vanished under an existing slot cannot be brought back by
    creating it again: the changes in between fail to decode (``publication_dropped``).
    """
    name = settings.publication_name
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,))
        exists = cur.fetchone() is not None
        if exists:
            _check_coverage(conn, settings)
            return
        if not slot_is_new:
            raise publication_dropped(settings)
        if not settings.create_publication:
            raise SourceRefused(
                f"publication {name} does not exist on the source; create it "
                "(CREATE PUBLICATION ...) or set create_publication: true"
            )
        if settings.tables:
            targets = sql.SQL(", ").join(sql.Identifier(*t.split(".")) for t in settings.tables)
            stmt = sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                sql.Identifier(name), targets
            )
            who = "the tables' owner"
        else:
            stmt = sql.SQL("CREATE PUBLICATION {} FOR ALL TABLES").format(sql.Identifier(name))
            who = "a superuser"
        try:
            cur.execute(stmt)
        except (psycopg.errors.DuplicateObject, psycopg.errors.UniqueViolation):
            return  # another bridge starting on the slot created it since we looked
        except psycopg.errors.InsufficientPrivilege as exc:
            raise SourceRefused(
                f"cannot create publication {name}: {exc.diag.message_primary};"
                f" have {who} run {stmt.as_string(conn)} before starting the "
                "bridge"
            ) from None
    log_event(
        log, logging.INFO, "created publication", publication=name, tables=settings.tables or "ALL"
    )


def publication_dropped(settings: BridgeSettings) -> SourceRefused:
    name, slot = settings.publication_name, settings.slot_name
    return SourceRefused(
        f"publication {name} was dropped while slot {slot} streamed it; recreating it cannot "
        "help (pgoutput reads it as of each change's WAL position): drop the slot (SELECT "
        f"pg_drop_replication_slot('{slot}')) and restart the bridge to start over with a "
        "new slot and snapshot"
    )


def _check_coverage(conn: Conn, settings: BridgeSettings) -> None:
    """Refuse an existing publication that leaves out a configured table.

    Tables it publishes beyond ``tables`` are fine: ALTER PUBLICATION ... ADD TABLE is how
    an operator adds one while the bridge runs. A partition counts as published through
    its published ancestor, a table through its published schema.
    """
    name = settings.publication_name
    if not settings.tables:
        return
    with conn.cursor() as cur:
        cur.execute(
            "SELECT t.name FROM unnest(%s::text[]) AS t(name)"
            " CROSS JOIN pg_publication p"
            " CROSS JOIN LATERAL (SELECT c.oid FROM pg_class c JOIN pg_namespace n"
            "   ON n.oid = c.relnamespace WHERE n.nspname = split_part(t.name, '.', 1)"
            "   AND c.relname = split_part(t.name, '.', 2)) rel"
            " WHERE p.pubname = %s AND NOT p.puballtables AND NOT EXISTS ("
            "   SELECT 1 FROM (SELECT rel.oid AS relid UNION"  # ancestors leave out the table
            "                  SELECT relid FROM pg_partition_ancestors(rel.oid)) a"
            "   JOIN pg_class ac ON ac.oid = a.relid"
            "   WHERE EXISTS (SELECT 1 FROM pg_publication_rel r"
            "                 WHERE r.prpubid = p.oid AND r.prrelid = a.relid)"
            "      OR EXISTS (SELECT 1 FROM pg_publication_namespace pn"
            "                 WHERE pn.pnpubid = p.oid AND pn.pnnspid = ac.relnamespace))"
            " ORDER BY 1",
            (settings.tables, name),
        )
        missing = [str(r[0]) for r in cur.fetchall()]
    if missing:
        raise SourceRefused(
            f"publication {name} exists but does not publish {', '.join(missing)} listed in "
            f"'tables'; run ALTER PUBLICATION {name} ADD TABLE {', '.join(missing)} (as the "
            "tables' owner) or fix 'tables'"
        )


def warn_keyless_tables(conn: Conn, publication: str) -> list[str]:
    """Published tables that cannot key their updates/deletes; warn, do not refuse.

    Such a table's UPDATE and DELETE fail *at the source* while it is published without a
    replica identity, so the operator must hear about it now, not from their application.
    """
    with conn.cursor() as cur:
        cur.execute(
            "SELECT p.schemaname || '.' || p.tablename, c.relreplident FROM pg_publication_tables p"
            " JOIN pg_namespace n ON n.nspname = p.schemaname"
            " JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = p.tablename"
            " WHERE p.pubname = %s AND c.relreplident IN ('d', 'n')"
            " AND NOT EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid"
            "                 AND (i.indisprimary OR (c.relreplident = 'i' AND i.indisreplident)))",
            (publication,),
        )
        rows = cur.fetchall()
    keyless = [str(r[0]) for r in rows]
    for table in keyless:
        log_event(
            log,
            logging.WARNING,
            f"table {table} has no primary key or replica identity: its inserts are "
            "published with a null key, and UPDATE/DELETE on it fail at the source; "
            f"add a primary key or ALTER TABLE {table} REPLICA IDENTITY FULL",
            table=table,
        )
    return keyless


@dataclass(frozen=True, slots=True)
class PublishedTable:
    """What a publication sends of one table, as pgoutput applies it: its columns (the
    column list; generated columns only if publish_generated_columns says so) and rows."""

    name: tuple[str, str]  # (schema, table)
    columns: list[str]
    row_filter: str | None  # the WHERE expression, as the server deparses it


def published_tables(conn: Conn, publication: str) -> list[PublishedTable]:
    """Every table the publication covers, as the connection (or its snapshot) sees it."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT schemaname, tablename, attnames, rowfilter FROM pg_publication_tables"
            " WHERE pubname = %s ORDER BY 1, 2",
            (publication,),
        )
        rows = cur.fetchall()
    return [
        PublishedTable(
            (str(schema), str(table)),
            [str(c) for c in cast(list[str], columns)],
            str(row_filter) if row_filter is not None else None,
        )
        for schema, table, columns, row_filter in rows
    ]


# The unique indexes of a relation that can key its records: NOT NULL columns only (NULLs
# are never equal, so such an index lets duplicates through), no expression, no predicate;
# each as a JSON array of its column names in index order.
_UNIQUE_KEYS = (
    "(SELECT json_agg(ARRAY(SELECT a.attname::text FROM unnest(i.indkey::int2[])"
    " WITH ORDINALITY k(attnum, n) JOIN pg_attribute a ON a.attrelid = i.indrelid"
    " AND a.attnum = k.attnum ORDER BY k.n)) FROM pg_index i WHERE i.indrelid = {relation}"
    " AND i.indisunique AND i.indexprs IS NULL AND i.indpred IS NULL AND NOT EXISTS"
    " (SELECT FROM pg_attribute a WHERE a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
    " AND NOT a.attnotnull))"
)


def _unique_keys(found: object) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(columns) for columns in cast(list[list[str]], found or []))


def published_shapes(conn: Conn, publication: str) -> list[TableShape]:
    """Each published table as the record builder will see it: its published columns and
    their types, replica identity, the key its records get by default (the catalogue's
    rule: the replica identity's columns, the primary key under REPLICA IDENTITY FULL, or
    every column of a FULL table without one) and its unique keys."""
    with conn.cursor() as cur:
        cur.execute(
            "SELECT p.schemaname, p.tablename, c.relreplident,"
            " array_agg(a.attname::text ORDER BY a.attnum),"
            " array_agg(format_type(a.atttypid, a.atttypmod) ORDER BY a.attnum),"
            " (SELECT array_agg(k.attname::text ORDER BY array_position(i.indkey::int2[],"
            "   k.attnum)) FROM pg_index i JOIN pg_attribute k ON k.attrelid = i.indrelid"
            "   AND k.attnum = ANY(i.indkey) WHERE i.indrelid = c.oid AND CASE c.relreplident"
            "   WHEN 'i' THEN i.indisreplident WHEN 'n' THEN false ELSE i.indisprimary END)"
            f", {_UNIQUE_KEYS.format(relation='c.oid')}"
            " FROM pg_publication_tables p"
            " JOIN pg_class c ON c.oid = format('%%I.%%I', p.schemaname, p.tablename)::regclass"
            " JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = ANY(p.attnames)"
            " WHERE p.pubname = %s GROUP BY 1, 2, 3, c.oid ORDER BY 1, 2",
            (publication,),
        )
        rows = cur.fetchall()
    shapes = []
    for schema, table, identity, names, types, key, unique in rows:
        columns = tuple(cast(list[str], names))
        if identity == "f" and not key:
            key = columns  # pgoutput flags every column of a FULL table as its key
        shapes.append(
            TableShape(
                str(schema),
                str(table),
                columns,
                str(identity),
                tuple(cast(list[str], key or [])),
                _unique_keys(unique),
                tuple(cast(list[str], types)),
            )
        )
    return shapes


def check_published(
    conn: Conn, publication: str, masking: Masking | None, routing: Routing | None
) -> list[str]:
    """Refuse, in one line, transforms, routes and keys that do not fit the published
    tables, as the record builder would refuse them at their first change: a name that is
    not published, a transform that does not fit its column (or its record key), a PII
    column without one, a key that could lose rows, tables sharing a topic with different
    keys. Returns what they do to each table they touch, a line each, for the log."""
    if masking is None and routing is None:
        return []
    shapes = published_shapes(conn, publication)
    problem = routing.check(shapes) if routing is not None else None
    if problem is not None:
        raise RoutingRefused(problem)
    if masking is not None:
        _check_masking(shapes, masking, routing)
    return [line for shape in shapes if (line := _shaped(shape, masking, routing))]


def _shaped(shape: TableShape, masking: Masking | None, routing: Routing | None) -> str:
    """What the settings do to a table's records (names only, never a value), or ""."""
    parts = []
    if masking is not None:
        masks = [(c, masking.mask(shape.schema, shape.table, c)) for c in shape.columns]
        parts += [f"{c} {mask.kind}" for c, mask in masks if mask is not None]
    if routing is not None:
        if (topic := routing.topic(shape.schema, shape.table)) is not None:
            parts.append(f"topic {topic}")
        if (key := routing.key(shape.schema, shape.table)) is not None:
            parts.append(f"key ({', '.join(key)})")
    return f"{shape.name}: {', '.join(parts)}" if parts else ""


def _check_masking(shapes: list[TableShape], masking: Masking, routing: Routing | None) -> None:
    """The transform checks, each column a key column where the record key (chosen or the
    replica identity's) holds it."""
    tables = {
        (shape.schema, shape.table): [
            PublishedColumn(name, type_name, name in key)
            for name, type_name in zip(shape.columns, shape.types, strict=True)
        ]
        for shape in shapes
        for key in [routing.key_of(shape) if routing is not None else shape.identity_key]
    }
    problem = masking.unmatched(tables)
    for (schema, table), columns in tables.items():
        problem = problem or masking.refusal(schema, table, columns)
    if problem is not None:
        raise MaskingRefused(problem)


def publishes_all_tables(conn: Conn, publication: str) -> bool:
    with conn.cursor() as cur:
        cur.execute("SELECT puballtables FROM pg_publication WHERE pubname = %s", (publication,))
        row = cur.fetchone()
    return bool(row and row[0])


def slot_state(conn: Conn, slot: str) -> SlotState | None:
    with conn.cursor() as cur:
        cur.execute(
            "SELECT plugin, failover, two_phase, active_pid, confirmed_flush_lsn::text,"
            " invalidation_reason FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        )
        row = cur.fetchone()
    if row is None:
        return None
    plugin, failover, two_phase, pid, confirmed, reason = row
    return SlotState(
        str(plugin),
        bool(failover),
        bool(two_phase),
        int(str(pid)) if pid is not None else None,
        str(confirmed) if confirmed else None,
        str(reason) if reason else None,
    )


def check_slot(state: SlotState, settings: BridgeSettings, ours: bool) -> None:
    """Refuse a slot this bridge must not use, let alone drop.

    ``ours``: the bridge's replication origin or published progress exists for the slot.
    The bridge creates the origin before it creates the slot, and the origin travels to a
    standby through WAL ahead of the synced slot, so a slot of ours always has one.
    """
    slot = settings.slot_name
    drop = (
        f"choose another slot_name, or drop the slot (SELECT pg_drop_replication_slot"
        f"('{slot}')) if nothing uses it"
    )
    if state.plugin != "pgoutput":
        raise SourceRefused(
            f"slot {slot} exists with plugin {state.plugin}: slotbridge did not "
            f"create it (it uses pgoutput); {drop}"
        )
    if not ours:
        raise SourceRefused(
            f"slot {slot} (plugin pgoutput) exists but slotbridge did not create"
            f" it (no replication origin {settings.origin_name}, no published "
            f"progress); {drop}"
        )
    if state.invalidation_reason:
        raise SourceRefused(
            f"slot {slot} is invalidated ({state.invalidation_reason}): the source no longer "
            f"has the changes after {state.confirmed_flush or 'its last confirmed position'}, "
            "so Kafka misses every change since; to snapshot every published table again "
            "into the same topics, with the gap recorded, run `slotbridge resync` once "
            "with the bridge stopped, then start it"
        )


def table_facts(conn: Conn, relation_oid: int) -> TableFacts | None:
    """Type names, nullability and primary key of a relation, as the catalogue has them now."""
    with conn.cursor() as cur:
        # An enum's labels in their order, for an array of enums its element's: the Debezium
        # format names them in the column's schema.
        cur.execute(
            "SELECT a.attname, format_type(a.atttypid, a.atttypmod), NOT a.attnotnull,"
            " (SELECT array_agg(e.enumlabel::text ORDER BY e.enumsortorder) FROM pg_enum e"
            "  WHERE e.enumtypid = CASE WHEN t.typcategory = 'A' THEN t.typelem ELSE t.oid END),"
            " t.typcategory = 'A', a.attndims"
            " FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid"
            " WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped",
            (relation_oid,),
        )
        columns = {
            str(n): ColumnFacts(
                str(t),
                bool(nullable),
                None if labels is None else tuple(cast(list[str], labels)),
                bool(array) and labels is not None,
                cast(int, dims),
            )
            for n, t, nullable, labels, array, dims in cur
        }
        cur.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid"
            " AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s AND i.indisprimary"
            " ORDER BY array_position(i.indkey::int2[], a.attnum)",
            (relation_oid,),
        )
        primary_key = tuple(str(r[0]) for r in cur)
        cur.execute(f"SELECT {_UNIQUE_KEYS.format(relation='%s')}", (relation_oid,))
        unique = cur.fetchone()
    if not columns:
        return None
    return TableFacts(columns, primary_key, _unique_keys(unique[0] if unique else None))
