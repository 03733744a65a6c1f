"""The bridge's Prometheus metrics (one registry per daemon, served on /metrics)."""

from __future__ import annotations

import threading
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterator, Sequence
from itertools import pairwise
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from services.bridge.assemble.spool import SpoolStats
from services.bridge.sink.broker_stats import BrokerLatency

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
        self.commit_to_visible = DelayHistogram(
            "slotbridge_commit_to_visible_seconds",
            "Per source transaction: end of the Kafka commit that published it minus its "
            "commit time on the source server (includes the clock difference between the "
            "server and the bridge; negative differences count as 0)",
            slot,
            COMMIT_TO_VISIBLE_BUCKETS,
        )
        r.register(self.commit_to_visible)
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
        self._broker_rtt = Gauge(
            "slotbridge_kafka_broker_rtt_seconds",
            "Round trip of the producer's requests to each broker over librdkafka's last "
            "statistics interval (5 s) with requests: p50 and p99 (a Kafka commit is several "
            "round trips in a row)",
            ["slot", "broker", "quantile"],
            registry=r,
        )
        self._broker_queue = Gauge(
            "slotbridge_kafka_producer_queue_seconds",
            "p99 of how long records waited in the producer before being sent to each broker "
            "(linger.ms included), over the same interval",
            ["slot", "broker"],
            registry=r,
        )
        self._slot = slot
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

    def broker_latencies(self, latencies: list[BrokerLatency]) -> None:
        """The sink's ``on_latencies``."""
        for b in latencies:
            self._broker_rtt.labels(self._slot, b.broker, "0.5").set(b.rtt_p50_s)
            self._broker_rtt.labels(self._slot, b.broker, "0.99").set(b.rtt_p99_s)
            self._broker_queue.labels(self._slot, b.broker).set(b.queue_p99_s)


class DelayHistogram(Collector):
    """A histogram of delays that arrive a batch at a time, all ending at one moment: each
    source transaction of a Kafka commit is visible when the commit ends. prometheus_client's
    ``Histogram`` takes one value a call, each under a lock and its bucket found by a loop in
    Python: per source transaction, that was 5% of the publisher's samples in an OLTP
    backlog (py-spy, 2026-11-25). Here a batch costs one lock, a value one bisection."""

    def __init__(self, name: str, documentation: str, slot: str, bounds: Sequence[float]):
        self._name = name
        self._documentation = documentation
        self._slot = slot
        self._bounds = tuple(bounds)
        self._bounds_us = [bound * 1_000_000 for bound in self._bounds]
        self._counts = [0] * (len(self._bounds) + 1)  # the last: above every bound
        self._sum_us = 0
        self._lock = threading.Lock()  # the publisher observes, the HTTP thread collects

    def observe_until(self, end_us: int, starts_us: Sequence[int]) -> None:
        """One delay per start: ``end_us`` minus it (µs; negative counted as 0).

        Counted a bound at a time over the sorted starts (a delay is within a bound when
        its start is at or after ``end_us`` less the bound): a Kafka commit of an OLTP
        backlog holds thousands of starts, and a bisection per start was a Python loop."""
        starts = sorted(starts_us)
        n = len(starts)
        within = [n - bisect_left(starts, end_us - bound) for bound in self._bounds_us]
        counts = [within[0], *(b - a for a, b in pairwise(within)), n - within[-1]]
        ended = bisect_right(starts, end_us)  # the starts not after the end
        total = end_us * ended - sum(starts[:ended])
        with self._lock:
            self._counts = [held + new for held, new in zip(self._counts, counts, strict=True)]
            self._sum_us += total

    def collect(self) -> Iterator[HistogramMetricFamily]:
        with self._lock:
            counts, sum_us = list(self._counts), self._sum_us
        family = HistogramMetricFamily(self._name, self._documentation, labels=["slot"])
        cumulative, buckets = 0, []
        for bound, count in zip((*map(str, self._bounds), "+Inf"), counts, strict=True):
            cumulative += count
            buckets.append((bound, float(cumulative)))
        family.add_metric([self._slot], buckets, sum_us / 1_000_000)
        yield family


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
