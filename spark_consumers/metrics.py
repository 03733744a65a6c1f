"""The consumer's Prometheus metrics and health, read from its ``Status``.

The job already keeps one account of its progress (``status.py``: the status file, the
log); the metrics are that account as Prometheus sees it, collected at scrape time, so
there is no second set of counters to keep in step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from spark_consumers.status import Status

# The poll loop rewrites the status every few seconds; this long without it, the driver
# is stuck (a batch in progress does not stop the loop).
STALE_AFTER_S = 120.0


class StatusCollector(Collector):
    def __init__(self, status: Status) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        status = self.status
        batches = CounterMetricFamily(
            "slotbridge_consumer_batches", "micro-batches applied by this run"
        )
        batches.add_metric([], status.batches)
        yield batches
        applied = CounterMetricFamily(
            "slotbridge_consumer_records_applied",
            "change records applied to the Delta tables",
            labels=["table"],
        )
        quarantined = CounterMetricFamily(
            "slotbridge_consumer_records_quarantined",
            "change records set aside in the dead-letter table",
            labels=["table"],
        )
        stopped = GaugeMetricFamily(
            "slotbridge_consumer_table_stopped",
            "1 while a table is stopped by an error of its own",
            labels=["table"],
        )
        for table, counts in sorted(status.tables.items()):
            applied.add_metric([table], counts.applied)
            quarantined.add_metric([table], counts.quarantined)
            stopped.add_metric([table], 1 if counts.stopped else 0)
        yield from (applied, quarantined, stopped)
        lag = GaugeMetricFamily(
            "slotbridge_consumer_lag_records", "records in Kafka not yet consumed", labels=["topic"]
        )
        for topic, behind in sorted(status.lag.items()):
            lag.add_metric([topic], behind)
        yield lag
        if status.last_batch_seconds is not None:
            yield GaugeMetricFamily(
                "slotbridge_consumer_last_batch_seconds",
                "wall seconds of the last micro-batch",
                value=status.last_batch_seconds,
            )
        if status.housekeeping is not None:
            yield GaugeMetricFamily(
                "slotbridge_consumer_housekeeping_seconds",
                "wall seconds of the last housekeeping run",
                value=status.housekeeping.seconds,
            )
            yield GaugeMetricFamily(
                "slotbridge_consumer_housekeeping_timestamp_seconds",
                "when the last housekeeping run ended",
                value=status.housekeeping.finished_at,
            )


def registry_for(status: Status) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(StatusCollector(status))
    return registry


def liveness(status: Status) -> tuple[bool, str]:
    """Alive unless the job failed or its driver loop stopped updating the status."""
    if status.state == "failed":
        return False, f"failed: {status.error}"
    age = time.time() - status.updated_at
    if age > STALE_AFTER_S:
        return False, f"status not updated for {age:.0f}s"
    return True, status.state


def readiness(status: Status) -> tuple[bool, str]:
    return status.state == "running", status.state
