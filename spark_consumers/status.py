"""Progress of the job: counters per table, Kafka lag, a log line and a JSON status file.

The status file is what ``slotbridge consume --status`` prints and what a readiness probe
or a test reads; it is rewritten atomically (write + rename) so a reader never sees half.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.common.logs import log_event
from spark_consumers.timings import BatchTimings

log = logging.getLogger("slotbridge.consume")


@dataclass
class TableCounts:
    applied: int = 0
    quarantined: int = 0
    stopped: str | None = None  # why the table's records are all set aside


@dataclass
class Upkeep:
    """What one housekeeping run did, for the log and the status file."""

    finished_at: float = 0.0
    seconds: float = 0.0
    files_compacted: int = 0
    files_vacuumed: int = 0
    tombstones_trimmed: int = 0
    history_ends_folded: int = 0
    tables: list[str] = field(default_factory=list)


@dataclass
class Status:
    """Everything reported; mutated by the batch function and the driver's poll loop.

    Readers on other threads (the poll loop's file writes, the metrics server) iterate its
    collections without a lock: each is replaced whole, never changed in place. Only the
    file's write and rename are serialised (``_writing``)."""

    state: str = "starting"
    error: str | None = None  # one line: why the job failed
    batches: int = 0
    last_batch_id: int | None = None
    last_batch_seconds: float | None = None
    last_batch_timings: BatchTimings = field(default_factory=BatchTimings)
    tables: dict[str, TableCounts] = field(default_factory=dict)
    lag: dict[str, int] = field(default_factory=dict)
    housekeeping: Upkeep | None = None
    # Every gap the bridge recorded (GapRecord fields), as in the ``_gaps`` table.
    gaps: list[dict[str, Any]] = field(default_factory=list)
    updated_at: float = field(default_factory=time.time)
    # The batch function (on Spark's callback thread) and the driver's poll loop both write
    # the file, through one temporary name: unserialised, one writer's rename took the
    # other's temporary file, whose own rename then failed and failed the job.
    _writing: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_batch(
        self,
        batch_id: int,
        counts: dict[str, TableCounts],
        seconds: float,
        timings: BatchTimings | None = None,
    ) -> None:
        self.batches += 1
        self.last_batch_id = batch_id
        self.last_batch_seconds = round(seconds, 3)
        self.last_batch_timings = timings or BatchTimings()
        # The poll loop and the metrics server iterate ``tables`` on their own threads: a new
        # dict replaces the old instead of a key being added to the one they may be reading
        # (which raised "dictionary changed size during iteration" in them).
        tables = dict(self.tables)
        for table, batch in counts.items():
            total = tables.get(table, TableCounts())
            tables[table] = TableCounts(
                applied=total.applied + batch.applied,
                quarantined=total.quarantined + batch.quarantined,
                stopped=batch.stopped or total.stopped,
            )
        self.tables = tables
        self.updated_at = time.time()
        log_event(
            log,
            logging.INFO,
            "batch applied",
            batch_id=batch_id,
            seconds=self.last_batch_seconds,
            tables={t: _counts(c) for t, c in counts.items()},
            phases=self.last_batch_timings.phases,
            merges=self.last_batch_timings.merges,
            jobs=self.last_batch_timings.jobs,
            jvm=self.last_batch_timings.jvm,
        )

    @property
    def quarantined(self) -> int:
        """Records this run sent to the dead-letter table, every table together."""
        return sum(c.quarantined for c in self.tables.values())

    def record_lag(self, progress: dict[str, Any] | None) -> None:
        """Offsets not yet consumed, per topic, from the query's last progress report.

        Called by the driver's poll loop every few seconds, so ``updated_at`` also says
        the loop is alive (the liveness probe reads it)."""
        self.updated_at = time.time()
        if progress:
            self.lag = lag_from_progress(progress)

    def as_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "error": self.error,
            "batches": self.batches,
            "last_batch_id": self.last_batch_id,
            "last_batch_seconds": self.last_batch_seconds,
            "last_batch_phases": self.last_batch_timings.phases,
            "last_batch_merges": self.last_batch_timings.merges,
            "last_batch_jobs": self.last_batch_timings.jobs,
            "last_batch_jvm": self.last_batch_timings.jvm,
            "tables": {t: _counts(c) for t, c in sorted(self.tables.items())},
            "stopped_tables": sorted(t for t, c in self.tables.items() if c.stopped),
            "quarantined": self.quarantined,
            "lag": dict(sorted(self.lag.items())),
            "total_lag": sum(self.lag.values()),
            "housekeeping": None if self.housekeeping is None else asdict(self.housekeeping),
            "gaps": self.gaps,
            "updated_at": self.updated_at,
        }

    def write(self, path: Path | None) -> None:
        if path is None:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_name(path.name + ".tmp")
        with self._writing:
            temp.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
            os.replace(temp, path)


def _counts(counts: TableCounts) -> dict[str, Any]:
    shown: dict[str, Any] = {"applied": counts.applied, "quarantined": counts.quarantined}
    if counts.stopped:
        shown["stopped"] = counts.stopped
    return shown


def _offsets(value: Any) -> dict[str, dict[str, int]]:
    """A source offset as Spark reports it (JSON text or already a dict) -> topic -> part.

    An offset Spark does not know is reported as null, or by PySpark as the text "None"
    (a batch replayed after a crash, a pattern no topic matches yet): no offsets then.
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    if not isinstance(value, dict):
        return {}
    return {
        topic: {str(p): int(o) for p, o in parts.items()}
        for topic, parts in value.items()
        if isinstance(parts, dict)
    }


def lag_from_progress(progress: dict[str, Any]) -> dict[str, int]:
    """Per topic: latest offset minus the end offset of the last batch, over partitions."""
    lag: dict[str, int] = {}
    for source in progress.get("sources", []):
        end = _offsets(source.get("endOffset"))
        latest = _offsets(source.get("latestOffset"))
        for topic, parts in latest.items():
            done = end.get(topic, {})
            lag[topic] = sum(max(0, offset - done.get(part, 0)) for part, offset in parts.items())
    return lag
