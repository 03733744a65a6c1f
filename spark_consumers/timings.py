"""Where a batch's time went: wall seconds per phase and Delta's own metrics per MERGE.

A slow batch is explained by this breakdown (in the "batch applied" log line and the
status file), not by guessing: reading and parsing the Kafka records (the survey is the
first action on them), typing each table's rows, each MERGE with Delta's
``operationMetrics`` of its commit (execution, source materialization, scan, rewrite).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from delta.tables import DeltaTable

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

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            seconds = time.monotonic() - started
            self.phases[name] = round(self.phases.get(name, 0.0) + seconds, 3)

    def merged(self, name: str, table: DeltaTable) -> None:
        """Keep the metrics Delta recorded for the MERGE just committed to ``table``."""
        commit = table.history(1).select("operation", "operationMetrics").first()
        if commit is not None and commit["operation"] == "MERGE":
            metrics = commit["operationMetrics"] or {}
            self.merges[name] = {k: int(metrics[k]) for k in _MERGE_METRICS if k in metrics}
