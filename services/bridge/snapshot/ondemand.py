"""``slotbridge snapshot``: ask the running bridge to snapshot a table again, or stop that.

The request travels through the stream (a logical message of its own transaction), so
the bridge acts on it at its place in stream order, after every change committed before
it, and a bridge that is down meanwhile finds it when it streams again. Progress is read
back from the bridge's progress record in Kafka: what it says is published.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable

import psycopg
from psycopg import sql

from services.bridge.progress.kafka_reader import read_kafka_progress
from services.bridge.settings import BridgeSettings
from services.bridge.sink.kafka import kafka_client_config
from services.bridge.snapshot.reader import SIGNAL
from services.bridge.source import published_tables
from services.common.lsn import parse_lsn
from services.common.pg import SourceRefused, connect, with_password
from services.contract.records import EndedSnapshot, ProgressRecord, TableSnapshot


def _dsn(settings: BridgeSettings) -> str:
    password = settings.source_password.get_secret_value() if settings.source_password else None
    return with_password(settings.source_dsn, password)


def _table(name: str) -> tuple[str, str]:
    schema, dot, table = name.partition(".")
    return (schema, table) if dot else ("public", name)


def request_snapshot(settings: BridgeSettings, table: str, where: str | None) -> tuple[str, int]:
    """Check the request, send it; returns its id and its place in the WAL."""
    name = _table(table)
    with connect(_dsn(settings)) as conn:
        if name not in {p.name for p in published_tables(conn, settings.publication_name)}:
            raise SourceRefused(
                f"table {name[0]}.{name[1]} is not in publication "
                f"{settings.publication_name}; add it there first"
            )
        if where is not None:
            try:
                conn.execute(
                    sql.SQL("EXPLAIN SELECT 1 FROM {} WHERE ({})").format(
                        sql.Identifier(*name), sql.SQL(where)
                    )
                )
            except psycopg.Error as exc:
                raise SourceRefused(
                    f"--where {where!r} does not work on {name[0]}.{name[1]}: "
                    f"{exc.diag.message_primary}"
                ) from None
        progress = read_kafka_progress(
            kafka_client_config(settings), settings.progress_topic, settings.slot_name
        )
        busy = (
            next((e for e in progress.snapshots if (e.schema_, e.table) == name), None)
            if progress is not None
            else None
        )
        if busy is not None:
            raise SourceRefused(
                f"table {name[0]}.{name[1]} is being snapshotted already "
                f"(request {busy.id}, {busy.rows:,} rows so far); wait for it "
                f"or cancel it with --cancel {busy.id}"
            )
        request = uuid.uuid4().hex[:12]
        lsn = _signal(
            conn,
            settings,
            {"snapshot": {"table": f"{name[0]}.{name[1]}", "where": where, "id": request}},
        )
    return request, lsn


def cancel_snapshot(settings: BridgeSettings, what: str) -> None:
    """Cancel the snapshots of a request id or of a table (``schema.table``)."""
    with connect(_dsn(settings)) as conn:
        _signal(conn, settings, {"cancel": what})


def _signal(
    conn: psycopg.Connection[tuple[object, ...]], settings: BridgeSettings, body: dict[str, object]
) -> int:
    try:
        row = conn.execute(
            "SELECT pg_logical_emit_message(true, %s, %s)::text",
            (SIGNAL, json.dumps({"slot": settings.slot_name, **body})),
        ).fetchone()
        assert row is not None
        return parse_lsn(str(row[0]))
    except psycopg.errors.InsufficientPrivilege:
        raise SourceRefused(
            f"role {conn.info.user} may not call pg_logical_emit_message; use the bridge's role"
        ) from None


def wait_for(
    settings: BridgeSettings,
    request: str,
    lsn: int,
    timeout_s: float,
    report: Callable[[TableSnapshot | None], None],
    poll_s: float = 2.0,
) -> ProgressRecord | None:
    """Until Kafka holds the request's last chunk: the published progress that says so,
    whose ``ended`` has what the request published (``ended_entry``); None once
    ``timeout_s`` passed (0 waits for ever). The request was acted on once the published
    position passed ``lsn``; it ended once its entry left ``snapshots``. ``report`` gets
    the entry on every poll (None until the bridge reached the request)."""
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else float("inf")
    while True:
        progress = read_kafka_progress(
            kafka_client_config(settings), settings.progress_topic, settings.slot_name
        )
        reached = progress is not None and progress.end_lsn >= lsn
        entry = (
            next((e for e in progress.snapshots if e.id == request), None)
            if progress is not None
            else None
        )
        if reached and entry is None:
            return progress
        report(entry)
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)


def ended_entry(progress: ProgressRecord, request: str) -> EndedSnapshot | None:
    """The request's outcome as published; None if 16 other snapshots ended since, or the
    bridge's release predates ``ended``."""
    return next((e for e in reversed(progress.ended) if e.id == request), None)
