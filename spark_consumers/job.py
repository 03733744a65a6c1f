"""Job wiring: the Spark session, the streaming query, the poll loop and a clean stop.

The query reads every change topic as one stream and hands each micro-batch to
``BatchProcessor``. SIGTERM/SIGINT ask for a stop: the driver waits for the running batch
to finish (so the checkpoint and the tables agree and the next start does not redo work),
then stops the query and the session. A SIGKILL is survived by replay: see merge.py.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from pyspark.sql import SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from services.common.failpoints import failpoint
from services.common.httpserver import HealthServer
from services.common.logs import log_event
from spark_consumers.batch import BatchProcessor
from spark_consumers.errors import error_line
from spark_consumers.kafka import change_stream
from spark_consumers.metrics import liveness, readiness, registry_for
from spark_consumers.settings import ConsumerSettings
from spark_consumers.status import Status

log = logging.getLogger("slotbridge.consume")
_POLL_S = 2


def _artifact(jar: str) -> str:
    """``kafka-clients-3.9.0.jar`` -> ``kafka-clients``: the name without the version."""
    return os.path.basename(jar).rsplit("-", 1)[0]


def extra_jars(jars_dir: Path) -> list[str]:
    """The cached jars Spark's own distribution does not already ship.

    The Maven resolution also brings e.g. snappy-java or lz4-java; a second, different
    version of a class Spark already has only invites clashes.
    """
    import pyspark

    shipped = {
        _artifact(j)
        for j in glob.glob(os.path.join(os.path.dirname(pyspark.__file__), "jars", "*.jar"))
    }
    jars = sorted(glob.glob(str(jars_dir / "*.jar")))
    if not jars:
        raise FileNotFoundError(
            f"no jars in {jars_dir}: jars_dir must hold the Kafka source and Delta jars"
        )
    return [j for j in jars if _artifact(j) not in shipped]


# Generated classes one table's batch needs cached (typing, the look for stored versions,
# the appends and MERGEs, Delta's own queries), with room for the rarer write paths
# (truncates, the exact history MERGE): the four pgbench tables fit in 1,000 (see below).
_GENERATED_CLASSES_PER_TABLE = 150


def codegen_cache_entries(settings: ConsumerSettings) -> int:
    """Spark's cache of generated classes, sized so one batch of every table fits.

    Spark keeps 100 by default, fewer than one batch of the four pgbench tables runs, so
    each batch evicted the previous one's: Janino compiled them again and the driver JVM
    loaded them anew for the JIT to compile again (763-854 classes a steady batch in
    ``bench/spark_freshness_bench.py``; 17-134 with 1,000 entries, what is left being
    mostly code holding a batch's own LSNs and keys). Each entry holds a compiled class in
    the JVM's metaspace, so the size follows the tables named rather than being large for
    all; with every change topic (``tables`` unset) it is 2,000 (13 tables' worth). A job
    whose batches still load hundreds of classes (``jvm`` in the "batch applied" line)
    sets a larger one in ``spark_conf``.
    """
    if settings.tables is None:
        return 2000
    return max(1000, _GENERATED_CLASSES_PER_TABLE * len(settings.tables))


# The JVM's collector: Parallel, not G1 (the JVM's choice on a machine of 2 cores or more).
# G1 marks the old generation concurrently with threads of its own, which on a small
# machine take cores from the tasks and the JIT; a micro-batch job wants throughput, and
# Parallel collects only in pauses, which a batch of seconds does not notice.
_JAVA_OPTIONS = "-XX:+UseParallelGC"


def session_conf(settings: ConsumerSettings) -> dict[str, str]:
    """Spark settings of the job: the same for ``slotbridge consume`` and spark-submit."""
    return {
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.session.timeZone": "UTC",
        # Local mode runs the tasks in the driver's JVM, a cluster in the executors'.
        "spark.driver.extraJavaOptions": _JAVA_OPTIONS,
        "spark.executor.extraJavaOptions": _JAVA_OPTIONS,
        **(
            {}
            if settings.shuffle_partitions is None
            else partition_conf(settings.shuffle_partitions)
        ),
        # Adaptive query execution runs every query stage as a Spark job of its own, and a
        # job costs its fixed scheduling time whatever its rows: on a table's small
        # per-batch MERGEs (Delta runs them in this session, not in the micro-batch's,
        # where Spark turns it off) that was 6-8 of a MERGE's 13-19 jobs. Without it a
        # write has as many files as its last shuffle has partitions (shuffle_partitions).
        "spark.sql.adaptive.enabled": "false",
        "spark.sql.codegen.cache.maxEntries": str(codegen_cache_entries(settings)),
        # The optimizer's constraint propagation grows exponentially with the aliased
        # predicates of a wide table's TOAST fill-in (merge.resolve_toast): a batch of two
        # rows with unchanged TOAST values in 24 text columns ran the driver out of memory
        # while it was planned. Off, Spark infers no extra filters from a plan's
        # predicates (such as IsNotNull on join keys); the narrow benches ran as fast.
        "spark.sql.constraintPropagation.enabled": "false",
        # A MERGE copies whole files, and writes what it copied in one file per partition
        # of its join: unbounded, a 10M-row current state became two files of 5M rows at
        # its first MERGE of random updates, and a later batch of 4 updates copied all 10M
        # rows (5.4 s). With files of at most 1M rows that batch copied 3M (2.5-2.7 s;
        # spark_merge_bench --shapes update, docs/spark-performance.md).
        "spark.sql.files.maxRecordsPerFile": str(settings.max_rows_per_file),
        # Housekeeping's OPTIMIZE rewrites every file under this size, binned up to 1 GB,
        # and keeps to the bound above: with Delta's default (1 GB) each run rewrote a
        # table's full files into the same files again (a second run over 3M rows in files
        # of 1M removed and added 4 files). Files of 8 MB or more are left alone: a full file
        # of any but the narrowest rows (8 bytes a row in Parquet; five columns took 18),
        # while the batches' small files are still compacted.
        "spark.databricks.delta.optimize.minFileSize": str(8 * 1024 * 1024),
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        # Every MERGE first copies its source (ours is never a plain Delta scan), by default
        # to disk only; kept in memory, spilling when it must, the copy is cheaper to write
        # and to read back in the MERGE's two passes.
        "spark.databricks.delta.merge.materializeSource.rddStorageLevel": "MEMORY_AND_DISK",
        # Delta refuses a VACUUM retention under 168 hours unless this check is off; the
        # job vacuums only with the operator's explicit vacuum_retention_hours.
        "spark.databricks.delta.retentionDurationCheck.enabled": "false",
        "spark.sql.streaming.stopGracefullyOnShutdown": "false",
        # Spark's default INT96 holds only 1677-2262 for readers that map it to
        # nanoseconds (delta-rs, pandas): one timestamptz of 0001-01-01 or 9999-12-31 made
        # a whole table unreadable to them. Microseconds are PostgreSQL's own precision.
        "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
        # PostgreSQL's calendar is proleptic Gregorian, as Spark's: old dates and
        # timestamps are written as they are, never rebased to the Julian calendar.
        "spark.sql.parquet.datetimeRebaseModeInWrite": "CORRECTED",
        "spark.sql.parquet.datetimeRebaseModeInRead": "CORRECTED",
        **settings.spark_conf,
    }


def partition_conf(partitions: int) -> dict[str, str]:
    """The settings that take the job's number of partitions (``shuffle_partitions``).

    Without adaptive execution a write has as many files as its last shuffle has
    partitions. As many as Spark has cores: on local[2], 2 partitions against 4 (twice
    the cores, the earlier default) took 8% less time and JVM CPU on batches of 5,000
    changes and 4% less on batches of 200,000 (``spark_merge_bench``, alternated runs,
    docs/spark-performance.md)."""
    value = str(partitions)
    return {
        "spark.sql.shuffle.partitions": value,
        # Delta rebuilds table state with this many tasks (default 50): far too many for
        # the small transaction logs of per-table CDC targets.
        "spark.databricks.delta.snapshotPartitions": value,
        # File listings (VACUUM's among them) run as one task per this many paths;
        # Spark's 10,000 made a VACUUM of a small table take a minute on two cores.
        "spark.sql.sources.parallelPartitionDiscovery.parallelism": value,
    }


def _jars(settings: ConsumerSettings) -> list[str]:
    """The jars to add: those in ``jars_dir``; none without it, as under spark-submit,
    whose ``--jars`` / ``--packages`` bring them (``slotbridge consume`` refuses local
    mode without ``jars_dir``: see ``spark_consumers.cli``)."""
    return extra_jars(settings.jars_dir) if settings.jars_dir is not None else []


def build_session(
    settings: ConsumerSettings,
    app_name: str = "slotbridge-consume",
) -> SparkSession:
    """A session with Delta, the Kafka source and UTC as the session time zone.

    UTC makes ``timestamp with time zone`` values show the instant the source stored,
    whatever the machine's zone.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if settings.spark_master is not None:
        builder = builder.master(settings.spark_master)
    jars = _jars(settings)
    if jars:
        builder = builder.config("spark.jars", ",".join(jars))
    for key, value in session_conf(settings).items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    if settings.shuffle_partitions is None:
        # Known once the session runs (on a cluster, after the scheduler's wait for its
        # executors to register); a value the launch gave (spark_conf, spark-submit's
        # --conf) stays.
        launched = spark.sparkContext.getConf()
        for key, value in partition_conf(spark.sparkContext.defaultParallelism).items():
            if not launched.contains(key):
                spark.conf.set(key, value)
    spark.sparkContext.setLogLevel("WARN")
    # A failed query is reported once, in one line, by run(); Spark's own report of it
    # is the whole stack trace again.
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(
        "org.apache.spark.sql.execution.streaming.MicroBatchExecution",
        jvm.org.apache.logging.log4j.Level.OFF,
    )
    return spark


def spark_submit_command(
    settings: ConsumerSettings, config: Path | None, once: bool = False
) -> list[str]:
    """The spark-submit command running this job as ``slotbridge consume`` would.

    The driver imports ``spark_consumers`` and ``services``, so it runs this Python (where
    slotbridge is installed) with the repository on its path; executors need only PySpark.
    """
    import pyspark

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    # spark-submit runs main.py as a script: the driver finds the packages through
    # PYTHONPATH, which it passes on to the driver's Python.
    root = Path(__file__).resolve().parents[1]
    command = [
        "env",
        f"PYTHONPATH={root}",
        str(submit),
        "--name",
        "slotbridge-consume",
        "--conf",
        f"spark.pyspark.python={sys.executable}",
        "--conf",
        f"spark.pyspark.driver.python={sys.executable}",
    ]
    if settings.spark_master is not None:
        command += ["--master", settings.spark_master]
    # The jars ship with the submission (spark-submit uploads them to a cluster); without
    # jars_dir the user adds --packages or --jars.
    jars = _jars(settings)
    if jars:
        command += ["--jars", ",".join(jars)]
    for key, value in session_conf(settings).items():
        command += ["--conf", f"{key}={value}"]
    command.append(str(Path(__file__).resolve().parent / "main.py"))
    if config is not None:
        command.append(str(config.resolve()))
    return command + (["--once"] if once else [])


def start_query(
    spark: SparkSession, settings: ConsumerSettings, status: Status, once: bool = False
) -> StreamingQuery:
    """Start the stream; ``once`` consumes what is in Kafka now and then ends."""
    writer = (
        change_stream(spark, settings)
        .writeStream.queryName("slotbridge-consume")
        .option("checkpointLocation", settings.checkpoint_dir)
        .foreachBatch(BatchProcessor(spark, settings, status))
    )
    if once:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=f"{settings.trigger_interval_s} seconds")
    return writer.start()


QUARANTINED_EXIT = 3


def run(settings: ConsumerSettings, once: bool = False, fail_on_quarantine: bool = False) -> int:
    """Run until the query ends (``once``), fails, or a signal asks for a stop.

    Returns the process exit code: 0 for a clean end, 1 when the query failed,
    ``QUARANTINED_EXIT`` after a clean end that quarantined records when
    ``fail_on_quarantine`` asks for it (a scheduled ``--once`` that must not pass quietly).
    """
    stop = threading.Event()

    def ask_stop(signum: int, frame: FrameType | None) -> None:
        log_event(log, logging.INFO, "stop requested", signal=signal.Signals(signum).name)
        stop.set()

    # py4j logs the traceback of a foreachBatch call that raised; the same error ends the
    # query and run() reports it in one line.
    logging.getLogger("py4j").setLevel(logging.CRITICAL)
    signal.signal(signal.SIGTERM, ask_stop)
    signal.signal(signal.SIGINT, ask_stop)
    status = Status()
    server = None
    if settings.http_port:
        server = HealthServer(
            settings.http_host,
            settings.http_port,
            lambda: liveness(status),
            lambda: readiness(status),
            registry_for(status),
        ).start()
        log_event(log, logging.INFO, "serving /healthz /readyz /metrics", port=server.port)
    spark = build_session(settings)
    try:
        code = _follow(spark, settings, status, once, stop)
        if code == 0 and fail_on_quarantine and status.quarantined:
            log_event(
                log,
                logging.ERROR,
                "records quarantined in this run; see the dead-letter table",
                count=status.quarantined,
                tables={t: c.quarantined for t, c in status.tables.items() if c.quarantined},
            )
            return QUARANTINED_EXIT
        return code
    except Exception as exc:
        # Whatever ends the job - the query's own failure, which awaitTermination raises,
        # or the driver's - the status file and the log say so in one line.
        status.state, status.error = "failed", error_line(exc)
        status.write(settings.status_path)
        log_event(log, logging.ERROR, "consumer failed", error=status.error)
        return 1
    finally:
        spark.stop()
        if server is not None:
            server.stop()


def _follow(
    spark: SparkSession,
    settings: ConsumerSettings,
    status: Status,
    once: bool,
    stop: threading.Event,
) -> int:
    """Start the query and keep the status file current until it ends; raises its error."""
    query = start_query(spark, settings, status, once)
    status.state = "running"
    status.write(settings.status_path)
    log_event(
        log,
        logging.INFO,
        "consumer started",
        query_id=str(query.id),
        checkpoint=settings.checkpoint_dir,
        warehouse=settings.warehouse,
        topics=settings.change_topics() or settings.change_topic_pattern(),
    )
    while query.isActive and not stop.is_set():
        query.awaitTermination(_POLL_S)
        status.record_lag(_progress(query))
        status.write(settings.status_path)
        failpoint("consume_after_status")
    if query.isActive:
        _stop_between_batches(query, settings.stop_grace_s)
    error = query.exception()
    if error is not None:
        raise error
    # The last batch may have ended after the loop last read the progress (the query ends
    # between that read and the isActive check): the lag it leaves is the stopped state's.
    status.record_lag(_progress(query))
    status.state = "stopped"
    status.write(settings.status_path)
    log_event(log, logging.INFO, "consumer stopped", batches=status.batches)
    return 0


def _progress(query: StreamingQuery) -> dict[str, object] | None:
    progress = query.lastProgress
    if progress is None:
        return None
    # PySpark 4 returns a StreamingQueryProgress object; older versions a plain dict.
    json_value = getattr(progress, "jsonValue", None)
    return dict(json_value()) if callable(json_value) else dict(progress)


def _stop_between_batches(query: StreamingQuery, grace_s: float) -> None:
    """Stop once no batch is running, so a batch is not cut in the middle without need;
    after ``grace_s`` the running batch is abandoned (its writes are idempotent and the
    next start replays it), so the stop fits the pod's termination grace period."""
    deadline = time.monotonic() + grace_s
    while query.status.get("isTriggerActive") and time.monotonic() < deadline:
        time.sleep(0.2)
    abandoned = bool(query.status.get("isTriggerActive"))
    query.stop()
    log_event(
        log,
        logging.WARNING if abandoned else logging.INFO,
        "batch abandoned after the stop grace; the next start replays it"
        if abandoned
        else "stopped between batches",
        stop_grace_s=grace_s,
    )
