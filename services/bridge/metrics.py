"""The bridge's Prometheus metrics (one registry per daemon, served on /metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.bridge.assemble.spool import SpoolStats

# From a quiet stream's few milliseconds to a backlog's seconds.
COMMIT_TO_VISIBLE_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)


class BridgeMetrics:
    def __init__(self, slot: str, spool: SpoolStats) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events = Counter(
            "slotbridge_events_total", "Change records published", ["slot"], registry=r
        ).labels(slot)
        self.transactions = Counter(
            "slotbridge_transactions_total", "Source transactions published", ["slot"], registry=r
        ).labels(slot)
        self.skipped = Counter(
            "slotbridge_transactions_skipped_total",
            "Replayed source transactions skipped (already in Kafka)",
            ["slot"],
            registry=r,
        ).labels(slot)
        self.untied_messages = Counter(
            "slotbridge_untied_messages_total",
            "Non-transactional logical messages seen and not published",
            ["slot"],
            registry=r,
        ).labels(slot)
        self.kafka_commit = Histogram(
            "slotbridge_kafka_transaction_seconds",
            "Time to flush and commit one Kafka transaction",
            ["slot"],
            registry=r,
        ).labels(slot)
        self.commit_to_visible = Histogram(
            "slotbridge_commit_to_visible_seconds",
            "Per source transaction: end of the Kafka commit that published it minus its "
            "commit time on the source server (includes the clock difference between the "
            "server and the bridge; negative differences count as 0)",
            ["slot"],
            registry=r,
            buckets=COMMIT_TO_VISIBLE_BUCKETS,
        ).labels(slot)
        self.lag_bytes = Gauge(
            "slotbridge_lag_bytes",
            "Source WAL end minus the last LSN published to Kafka",
            ["slot"],
            registry=r,
        ).labels(slot)
        self.lag_seconds = Gauge(
            "slotbridge_lag_seconds",
            "Now minus the commit time of the last published transaction",
            ["slot"],
            registry=r,
        ).labels(slot)
        self.published_lsn = Gauge(
            "slotbridge_published_lsn",
            "End LSN of the last transaction committed to Kafka",
            ["slot"],
            registry=r,
        ).labels(slot)
        self.confirmed_lsn = Gauge(
            "slotbridge_confirmed_lsn", "LSN last confirmed to the slot", ["slot"], registry=r
        ).labels(slot)
        self.streaming = Gauge(
            "slotbridge_streaming", "1 while the replication stream is open", ["slot"], registry=r
        ).labels(slot)
        self.kafka_wait = Gauge(
            "slotbridge_kafka_write_wait_seconds",
            "How long records of the open Kafka transaction have waited for the brokers' "
            "acknowledgement (NOT_ENOUGH_REPLICAS, a full log dir, a slow broker); 0: none",
            ["slot"],
            registry=r,
        ).labels(slot)
        self.reconnects = Counter(
            "slotbridge_reconnects_total", "Sessions restarted after an error", ["slot"], registry=r
        ).labels(slot)
        spooled = Gauge(
            "slotbridge_spooled_bytes",
            "Bytes of buffered transactions",
            ["slot", "where"],
            registry=r,
        )
        spooled.labels(slot, "memory").set_function(lambda: spool.memory_bytes)
        spooled.labels(slot, "disk").set_function(lambda: spool.disk_bytes)
        self.wal_status = Gauge(
            "slotbridge_slot_wal_status",
            "1 for the slot's pg_replication_slots.wal_status (reserved, extended: safe; "
            "unreserved: WAL it needs is past max_slot_wal_keep_size and goes at the next "
            "checkpoint; lost: invalidated), 0 for the others",
            ["slot", "status"],
            registry=r,
        )
        self.safe_wal_bytes = Gauge(
            "slotbridge_slot_safe_wal_bytes",
            "pg_replication_slots.safe_wal_size: WAL that can still be written before the slot "
            "is invalidated (+Inf without max_slot_wal_keep_size)",
            ["slot"],
            registry=r,
        ).labels(slot)
        self.slot_stats = Gauge(
            "slotbridge_slot_stat",
            "pg_stat_replication_slots counters of the bridge's slot",
            ["slot", "stat"],
            registry=r,
        )


class SnapshotCollector(Collector):
    """Per-table snapshot figures, read from the running session's book at each scrape."""

    _FIELDS = (
        ("chunks_done", "Snapshot chunks published"),
        ("rows_done", "Snapshot rows published"),
        ("rows_estimated", "Rows the planner expects in the table"),
        ("rows_per_s", "Snapshot rows published per second since it (re)started"),
        ("eta_s", "Seconds left at that rate"),
    )

    def __init__(self, slot: str, report: Callable[[], dict[str, Any]]) -> None:
        self._slot = slot
        self._report = report

    def collect(self) -> Iterator[GaugeMetricFamily]:
        tables = self._report()["tables"]
        for field, text in self._FIELDS:
            family = GaugeMetricFamily(
                f"slotbridge_snapshot_{field}", text, labels=["slot", "table", "state"]
            )
            for table, entry in tables.items():
                if entry.get(field) is not None:
                    family.add_metric([self._slot, table, entry["state"]], float(entry[field]))
            yield family
