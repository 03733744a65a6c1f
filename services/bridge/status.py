"""What ``slotbridge status`` reports: the slot, the origin, Kafka's progress record, and
the snapshot progress the running daemon serves on its HTTP port."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from services.bridge.progress.kafka_reader import TopicReadError, read_kafka_progress
from services.bridge.settings import BridgeSettings
from services.bridge.sink.kafka import kafka_client_config
from services.common.lsn import format_lsn
from services.common.pg import connect, with_password

_SLOT_SQL = """
SELECT s.plugin, s.failover, s.two_phase, s.active, s.confirmed_flush_lsn::text,
       s.restart_lsn::text, s.invalidation_reason,
       pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint,
       st.spill_txns, st.spill_bytes, st.stream_txns, st.stream_bytes, st.total_txns,
       st.total_bytes
FROM pg_replication_slots s LEFT JOIN pg_stat_replication_slots st USING (slot_name)
WHERE s.slot_name = %s
"""


def collect(settings: BridgeSettings) -> dict[str, Any]:
    password = settings.source_password.get_secret_value() if settings.source_password else None
    report: dict[str, Any] = {"slot": settings.slot_name}
    with connect(with_password(settings.source_dsn, password)) as conn, conn.cursor() as cur:
        cur.execute(_SLOT_SQL, (settings.slot_name,))
        row = cur.fetchone()
        if row is None:
            report["exists"] = False
        else:
            (plugin, failover, two_phase, active, confirmed, restart, invalid, lag, *stats) = row
            report.update(
                {
                    "exists": True,
                    "plugin": plugin,
                    "failover": failover,
                    "two_phase": two_phase,
                    "active": active,
                    "confirmed_flush_lsn": confirmed,
                    "restart_lsn": restart,
                    "invalidation_reason": invalid,
                    "lag_bytes": lag,
                    "decoding": dict(
                        zip(
                            (
                                "spill_txns",
                                "spill_bytes",
                                "stream_txns",
                                "stream_bytes",
                                "total_txns",
                                "total_bytes",
                            ),
                            stats,
                            strict=True,
                        )
                    ),
                }
            )
        cur.execute(
            "SELECT pg_replication_origin_progress(%s, true)::text "
            "FROM pg_replication_origin WHERE roname = %s",
            (settings.origin_name, settings.origin_name),
        )
        origin = cur.fetchone()
        report["origin_lsn"] = origin[0] if origin else None
    try:
        progress = read_kafka_progress(
            kafka_client_config(settings), settings.progress_topic, settings.slot_name, timeout_s=10
        )
    except TopicReadError as exc:
        report["kafka_progress"] = f"unavailable: {exc}"
    else:
        report["kafka_published_lsn"] = format_lsn(progress.end_lsn) if progress else None
        report["kafka_progress_timeline"] = progress.timeline if progress else None
        # What `slotbridge adopt-upgrade --from-system` names after a pg_upgrade.
        report["kafka_progress_system"] = progress.system_identifier if progress else None
        # As far as Kafka holds them: what a restart resumes from.
        report["snapshots_published"] = (
            {
                f"{p.schema_}.{p.table}": f"{p.rows:,} rows in {p.chunks} chunks ({p.id})"
                for p in progress.snapshots
            }
            if progress
            else {}
        )
    report["snapshot"] = _daemon_snapshot(settings)
    return report


def _daemon_snapshot(settings: BridgeSettings) -> dict[str, Any] | str:
    """Per-table snapshot progress of the daemon, if one runs with its HTTP server here."""
    if not settings.http_port:
        return "unknown: the daemon's HTTP server is off (http_port 0)"
    host = "127.0.0.1" if settings.http_host in ("0.0.0.0", "::", "") else settings.http_host
    url = f"http://{host}:{settings.http_port}/snapshot"
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            tables: dict[str, Any] = json.load(response)["tables"]
            return tables
    except (OSError, urllib.error.URLError, ValueError, KeyError) as exc:
        return f"unknown: no daemon answered at {url} ({exc})"
