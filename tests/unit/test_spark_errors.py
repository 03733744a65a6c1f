"""The one line a Spark failure is reduced to (spark_consumers/errors.py)."""

from __future__ import annotations

from spark_consumers.errors import error_line

_BATCH_FUNCTION_RAISED = """[STREAM_FAILED] Query [id = 1, runId = 2] terminated with exception: \
An exception was raised by the Python Proxy. Return Message: Traceback (most recent call last):
  File "/venv/pyspark/sql/utils.py", line 120, in call
    raise e
  File "/repo/spark_consumers/merge.py", line 300, in apply
    self._merge_history(changes, table, facts)
pyspark.errors.exceptions.captured.AnalysisException: [DELTA_INVALID_CHARACTERS_IN_COLUMN_NAMES] \
Found invalid character(s) among ' ,;{}()\\n\\t=' in the column names of your schema.
JVM stacktrace:
org.apache.spark.sql.delta.DeltaAnalysisException: [DELTA_INVALID_CHARACTERS_IN_COLUMN_NAMES]
\tat org.apache.spark.sql.delta.DeltaErrors$.foundInvalidCharsInColumnNames(DeltaErrors.scala:1)

=== Streaming Query ===
Identifier: slotbridge-consume
"""

_JAVA_ONLY = """[STREAM_FAILED] Query terminated with exception: Job aborted.
\tat org.apache.spark.SparkContext.runJob(SparkContext.scala:1)
Caused by: org.apache.spark.SparkException: Task failed
\tat org.apache.spark.scheduler.Task.run(Task.scala:1)
Caused by: java.nio.file.AccessDeniedException: /warehouse/history/public.t/_delta_log
\tat sun.nio.fs.UnixException.translateToIOException(UnixException.java:90)
"""


def test_python_error_inside_a_query_failure() -> None:
    assert error_line(_BATCH_FUNCTION_RAISED).startswith(
        "pyspark.errors.exceptions.captured.AnalysisException: "
        "[DELTA_INVALID_CHARACTERS_IN_COLUMN_NAMES] Found invalid character(s)"
    )


def test_innermost_java_cause() -> None:
    assert error_line(_JAVA_ONLY) == (
        "java.nio.file.AccessDeniedException: /warehouse/history/public.t/_delta_log"
    )


def test_plain_and_long_errors() -> None:
    assert error_line(ValueError("bad value\nmore")) == "bad value"
    assert error_line(RuntimeError()) == "RuntimeError"
    assert len(error_line("x" * 1000)) == 400


def test_java_error_behind_py4j() -> None:
    text = """Traceback (most recent call last):
  File "/repo/spark_consumers/tables.py", line 117, in ensure_table
    builder.execute()
py4j.protocol.Py4JJavaError: An error occurred while calling o512.execute.
: org.apache.spark.sql.delta.DeltaIOException: [DELTA_CANNOT_CREATE_LOG_PATH] Cannot create \
file:/w/history/public.t/_delta_log
\tat org.apache.spark.sql.delta.DeltaErrorsBase.cannotCreateLogPathException(DeltaErrors.scala:1)
"""
    assert error_line(text) == (
        "org.apache.spark.sql.delta.DeltaIOException: [DELTA_CANNOT_CREATE_LOG_PATH] Cannot "
        "create file:/w/history/public.t/_delta_log"
    )
