"""Where a batch's time went: wall seconds and Spark jobs per phase, Delta's own metrics
per MERGE.

A slow batch is explained by this breakdown (in the "batch applied" log line and the
status file), not by guessing: reading and parsing the Kafka records (the survey is the
first action on them), typing each table's rows, each MERGE with the rows it inserted,
updated and deleted (what the MERGE returns: reading its commit's ``operationMetrics``
back would cost a Spark job per MERGE; ``bench/spark_merge_bench.py`` reads them once
the run is over).
The jobs are counted because each costs Spark's fixed scheduling and planning time
whatever its rows: on a small table they, not the rows, decide the phase's seconds. They
are the jobs the query started during the phase: with tables applied side by side, the
other tables' jobs of that time are in it too.

Per batch, the driver JVM's classes loaded, JIT compilation and garbage collection
milliseconds (Java's own management beans): a warm JVM running the same plans again loads
few classes; hundreds per batch mean Spark compiles its generated code again every batch
(its codegen cache is too small for the job's tables: ``spark.sql.codegen.cache.maxEntries``).
The JIT's milliseconds are the compiler threads' elapsed time added up, not CPU time: on a
busy machine they include waiting for a core.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from py4j.protocol import Py4JError
from pyspark import SparkContext
from pyspark.sql import DataFrame


@dataclass
class BatchTimings:
    phases: dict[str, float] = field(default_factory=dict)
    merges: dict[str, dict[str, int]] = field(default_factory=dict)
    jobs: dict[str, int] = field(default_factory=dict)
    # The driver JVM's work during the batch (``finish``): classes_loaded, jit_ms, gc_ms.
    jvm: dict[str, int] = field(default_factory=dict)
    # Where the jobs are counted; without it (a batch not run by Spark) they are not.
    context: SparkContext | None = field(default=None, repr=False, compare=False)
    _jvm_at_start: dict[str, int] = field(default_factory=dict, repr=False, compare=False)
    _group_jobs: Callable[[str | None], set[int]] | None = field(
        default=None, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.context is not None:
            self._jvm_at_start = _jvm_counters(self.context)
            self._group_jobs = _group_job_ids(self.context)

    def finish(self) -> None:
        """The batch is over: what the driver JVM did during it, into ``jvm``."""
        if self.context is not None:
            now = _jvm_counters(self.context)
            self.jvm = {k: v - self._jvm_at_start.get(k, 0) for k, v in now.items()}

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
        if self._group_jobs is None:
            return set()
        assert self.context is not None
        return self._group_jobs(self.context.getLocalProperty("spark.jobGroup.id"))

    def merged(self, name: str, result: DataFrame) -> None:
        """Keep the row counts of the MERGE that returned ``result`` (num_inserted_rows...).

        The MERGE has run: ``result`` is its command's output, held by the driver, so
        reading it starts no job."""
        row = result.first()
        if row is not None:
            self.merges[name] = {k: int(v) for k, v in row.asDict().items() if v is not None}


def _group_job_ids(context: SparkContext) -> Callable[[str | None], set[int]]:
    """A function giving the ids of a job group's known jobs, one round trip to the JVM a
    call.

    PySpark's ``statusTracker().getJobIdsForGroup`` hands the Java array over one element
    per round trip, and a long-running query's group holds up to ``spark.ui.retainedJobs``
    (1,000) ids: at two calls per phase and about 25 phases a batch of four tables, counting
    the jobs cost up to 50,000 round trips a batch. The same array read as one string
    (``java.util.Arrays.toString``) is one round trip.
    """
    jvm = context._jvm
    assert jvm is not None  # a classic SparkContext: the job runs on one
    tracker = jvm.org.apache.spark.SparkContext.getOrCreate().statusTracker()
    as_text = jvm.java.util.Arrays.toString

    def ids(group: str | None) -> set[int]:
        text = as_text(tracker.getJobIdsForGroup(group))
        return {int(i) for i in text.strip("[]").split(",") if i.strip()}

    return ids


def _jvm_counters(context: SparkContext) -> dict[str, int]:
    """The driver JVM's totals so far, from ``java.lang.management``: classes loaded, JIT
    compilation ms (absent when the JVM has no JIT) and collection ms of every collector.

    PySpark reaches the driver's JVM only through its Py4J gateway (``_jvm``, which the job
    already uses for its log levels). These figures explain a batch; they must never fail
    one: a context without the gateway (Spark Connect) or a gateway error gives none.
    """
    jvm = getattr(context, "_jvm", None)
    if jvm is None:
        return {}
    try:
        beans = jvm.java.lang.management.ManagementFactory
        collectors = beans.getGarbageCollectorMXBeans()
        counters = {
            "classes_loaded": int(beans.getClassLoadingMXBean().getTotalLoadedClassCount()),
            # -1: a collector that does not keep the figure.
            "gc_ms": sum(max(0, int(b.getCollectionTime())) for b in collectors),
        }
        jit = beans.getCompilationMXBean()
        if jit is not None and jit.isCompilationTimeMonitoringSupported():
            counters["jit_ms"] = int(jit.getTotalCompilationTime())
    except Py4JError:
        return {}
    return counters
