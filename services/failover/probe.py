"""Gathering facts: read-only SQL against every node, turned into ``facts`` values.

A node that does not answer is a fact too (``reachable=False`` with the one-line reason),
never an exception: the readiness report must still be printed when the standby is down,
because that is when it matters most.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from psycopg import conninfo

from services.common.logs import one_line
from services.common.lsn import parse_lsn
from services.common.pg import SourceError, connect
from services.failover.facts import (
    ClusterFacts,
    Sender,
    Server,
    Slot,
    SubscriberFacts,
    Subscription,
)
from services.failover.settings import FailoverSettings, Node

Conn = psycopg.Connection[tuple[Any, ...]]

# Settings the checks judge (pg_settings simply has no row for one an older server lacks).
_SETTINGS = (
    "wal_level",
    "synchronized_standby_slots",
    "sync_replication_slots",
    "hot_standby_feedback",
    "primary_slot_name",
    "default_transaction_read_only",
)

_SERVER_SQL = """
SELECT pg_is_in_recovery(),
       (SELECT system_identifier FROM pg_control_system()),
       CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()::text
            ELSE pg_current_wal_lsn()::text END,
       -- The insert timeline of a primary is in its current WAL file name; a standby's is
       -- the one its receiver follows (the checkpoint's timeline lags a promotion).
       CASE WHEN pg_is_in_recovery()
            THEN coalesce((SELECT received_tli FROM pg_stat_wal_receiver),
                          (SELECT timeline_id FROM pg_control_checkpoint()))
            ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int
       END,
       current_setting('primary_conninfo', true),
       (SELECT status FROM pg_stat_wal_receiver)
"""

_SLOTS_SQL = """
SELECT slot_name, slot_type, active, temporary, failover, synced, invalidation_reason,
       confirmed_flush_lsn::text, restart_lsn::text
FROM pg_replication_slots ORDER BY slot_name
"""

_SENDERS_SQL = """
SELECT a.pid, a.application_name, s.slot_name, s.slot_type, a.wait_event
FROM pg_stat_activity a
LEFT JOIN pg_replication_slots s ON s.active_pid = a.pid
WHERE a.backend_type = 'walsender'
"""

_SUBSCRIPTIONS_SQL = """
SELECT s.oid, s.subname, d.datname, s.subenabled, s.subfailover, s.subslotname, s.subconninfo,
       w.pid, w.received_lsn::text,
       coalesce((SELECT array_agg(format('pg_%s_sync_%s_%s', r.srsubid, r.srrelid,
                                         c.system_identifier) ORDER BY r.srrelid)
                 FROM pg_subscription_rel r, pg_control_system() c
                 WHERE r.srsubid = s.oid AND r.srsubstate = 'f'), '{}')
FROM pg_subscription s
JOIN pg_database d ON d.oid = s.subdbid
LEFT JOIN pg_stat_subscription w ON w.subid = s.oid AND w.worker_type = 'apply'
ORDER BY s.subname
"""

# Under synchronized_standby_slots a logical walsender waits for the standby on every
# commit, so a busy one is often caught in that wait. The walsenders are sampled until none
# has been waiting all along, or for a window in which a live standby surely confirms WAL
# (it replies on every flush) and the slots show it.
SENDER_WINDOW_S = 2.5
SENDER_SAMPLE_GAP_S = 0.25


def _lsn(text: str | None) -> int | None:
    return None if text is None else parse_lsn(text)


def public_conninfo(dsn: str) -> dict[str, str]:
    """A conninfo as a dict without secrets: what facts and reports may carry."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return {}
    return {k: str(v) for k, v in params.items() if k not in ("password", "sslpassword")}


def open_node(node: Node, timeout: int = 5) -> Conn:
    """An autocommit connection; SourceError with a one-line reason when it fails."""
    return connect(node.conninfo(), connect_timeout=timeout)


def read_slots(conn: Conn) -> tuple[Slot, ...]:
    return tuple(
        Slot(
            name=r[0],
            slot_type=r[1],
            active=bool(r[2]),
            temporary=bool(r[3]),
            failover=bool(r[4]),
            synced=bool(r[5]),
            invalidation_reason=r[6],
            confirmed_flush_lsn=_lsn(r[7]),
            restart_lsn=_lsn(r[8]),
        )
        for r in conn.execute(_SLOTS_SQL).fetchall()
    )


def read_senders(conn: Conn, window_s: float = SENDER_WINDOW_S) -> tuple[tuple[Sender, ...], float]:
    """Walsenders with their wait event in each sample, and the seconds sampled.

    Sampling stops early once no logical walsender has waited on the standby in every
    sample so far: the window could not change the verdict. Walsenders gone midway are
    dropped.
    """
    started = time.monotonic()
    seen: dict[int, list[Any]] = {}
    waits: dict[int, list[str | None]] = {}
    samples = 0
    while True:
        samples += 1
        for row in conn.execute(_SENDERS_SQL).fetchall():
            seen[row[0]] = list(row)
            waits.setdefault(row[0], []).append(row[4])
        senders = tuple(
            Sender(
                pid=pid,
                application_name=row[1] or "",
                slot_name=row[2],
                slot_type=row[3],
                wait_events=tuple(waits[pid]),
            )
            for pid, row in sorted(seen.items())
            if len(waits[pid]) == samples
        )
        elapsed = time.monotonic() - started
        if elapsed >= window_s or not any(
            s.slot_type == "logical" and s.always_waiting_for_standby for s in senders
        ):
            return senders, elapsed
        time.sleep(SENDER_SAMPLE_GAP_S)


def probe_server(name: str, node: Node, *, senders: bool = False) -> Server:
    """Everything the checks need from one primary or standby."""
    try:
        with open_node(node) as conn:
            row = conn.execute(_SERVER_SQL).fetchone()
            assert row is not None
            settings: dict[str, str] = dict(
                conn.execute(
                    "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", (list(_SETTINGS),)
                ).fetchall()
            )
            watch = senders and not row[0]
            slots = read_slots(conn)
            seen, window = read_senders(conn) if watch else ((), 0.0)
            slots_after = read_slots(conn) if watch else ()
            return Server(
                name=name,
                reachable=True,
                in_recovery=bool(row[0]),
                system_identifier=int(row[1]),
                wal_lsn=_lsn(row[2]),
                timeline=row[3],
                settings=settings,
                primary_conninfo_dbname=public_conninfo(row[4] or "").get("dbname"),
                wal_receiver_status=row[5],
                slots=slots,
                senders=seen,
                slots_after=slots_after,
                senders_window_s=window,
            )
    except (SourceError, psycopg.Error) as exc:
        return Server(name=name, reachable=False, error=one_line(exc))


def read_subscriptions(conn: Conn) -> tuple[Subscription, ...]:
    return tuple(
        Subscription(
            oid=int(r[0]),
            name=r[1],
            database=r[2],
            enabled=bool(r[3]),
            failover=bool(r[4]),
            slot_name=r[5],
            publisher=public_conninfo(r[6]),
            worker_pid=r[7],
            received_lsn=_lsn(r[8]),
            sync_slots=tuple(r[9]),
        )
        for r in conn.execute(_SUBSCRIPTIONS_SQL).fetchall()
    )


def probe_subscriber(name: str, node: Node) -> SubscriberFacts:
    try:
        with open_node(node) as conn:
            return SubscriberFacts(
                name=name, reachable=True, subscriptions=read_subscriptions(conn)
            )
    except (SourceError, psycopg.Error) as exc:
        return SubscriberFacts(name=name, reachable=False, error=one_line(exc))


def probe_cluster(settings: FailoverSettings) -> ClusterFacts:
    """One round of facts from every configured node."""
    return ClusterFacts(
        primary=probe_server("primary", settings.primary, senders=True),
        standbys=tuple(probe_server(n, s) for n, s in settings.standbys.items()),
        subscribers=tuple(probe_subscriber(n, s) for n, s in settings.subscribers.items()),
        bridge_slots=tuple(settings.bridge_slots),
        managed_subscriptions={
            n: None if s.subscriptions is None else tuple(s.subscriptions)
            for n, s in settings.subscribers.items()
        },
    )
