"""Where a batch's time went: wall seconds and Spark jobs per phase, Delta's own metrics
per MERGE.

A slow batch is explained by this breakdown (in the "batch applied" log line and the
status file), not by guessing: reading and parsing the Kafka records (the survey is the
first action on them), typing each table's rows, each MERGE with Delta's
``operationMetrics`` of its commit (execution, source materialization, scan, rewrite).
The jobs are counted because each costs Spark's fixed scheduling and planning time
whatever its rows: on a small table they, not the rows, decide the phase's seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from delta.tables import DeltaTable
from pyspark import SparkContext

# The operationMetrics of a MERGE commit worth a line: time and what was written.
_MERGE_METRICS = (
    "executionTimeMs",
    "materializeSourceTimeMs",
    "scanTimeMs",
    "rewriteTimeMs",
    "numSourceRows",
    "numTargetRowsInserted",
    "numTargetRowsUpdated",
    "numTargetRowsDeleted",
    "numTargetRowsCopied",
    "numTargetFilesAdded",
    "numTargetFilesRemoved",
    "numTargetDeletionVectorsAdded",
)


@dataclass
class BatchTimings:
    phases: dict[str, float] = field(default_factory=dict)
    merges: dict[str, dict[str, int]] = field(default_factory=dict)
    jobs: dict[str, int] = field(default_factory=dict)
    # Where the jobs are counted; without it (a batch not run by Spark) they are not.
    context: SparkContext | None = field(default=None, repr=False, compare=False)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        before = self._job_ids()
        try:
            yield
        finally:
            seconds = time.monotonic() - started
            self.phases[name] = round(self.phases.get(name, 0.0) + seconds, 3)
            if self.context is not None:
                self.jobs[name] = self.jobs.get(name, 0) + len(self._job_ids() - before)

    def _job_ids(self) -> set[int]:
        """The jobs run so far in this thread's job group (the streaming query's, whose
        jobs are the batch's: the status tracker keeps the last ``spark.ui.retainedJobs``)."""
        if self.context is None:
            return set()
        group = self.context.getLocalProperty("spark.jobGroup.id")
        return set(self.context.statusTracker().getJobIdsForGroup(group))

    def merged(self, name: str, table: DeltaTable) -> None:
        """Keep the metrics Delta recorded for the MERGE just committed to ``table``."""
        commit = table.history(1).select("operation", "operationMetrics").first()
        if commit is not None and commit["operation"] == "MERGE":
            metrics = commit["operationMetrics"] or {}
            self.merges[name] = {k: int(metrics[k]) for k in _MERGE_METRICS if k in metrics}
