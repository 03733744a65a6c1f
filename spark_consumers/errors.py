"""One line out of a Spark failure, for the log and the status file.

A failed streaming query's text is the whole story: the query's description, a Java
stack trace per cause and, when our foreachBatch function raised, the Python traceback
wrapped inside (1,445 lines for an unwritable warehouse). The operator needs the one line
that names the problem: the Python exception when the batch function raised, else the
innermost Java cause.
"""

from __future__ import annotations

import re

_PY_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)):? ?(.*)$")
_PY4J = "py4j.protocol.Py4JJavaError"
_JAVA_CAUSE = re.compile(r"^\s*Caused by: (.*)$")
_MAX = 400


def error_line(exc: BaseException | str) -> str:
    """The line naming what went wrong, at most ``_MAX`` characters."""
    text = str(exc)
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    line = (
        _python_error(lines)
        or _innermost_cause(lines)
        or (lines[0] if lines else type(exc).__name__)
    )
    line = line.strip()
    return line if len(line) <= _MAX else line[: _MAX - 3] + "..."


def _python_error(lines: list[str]) -> str | None:
    """The exception line that ends the last Python traceback in ``lines``."""
    starts = [i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line]
    if not starts:
        return None
    rest = lines[starts[-1] + 1 :]
    for n, line in enumerate(rest):
        if not line.startswith((" ", "\t")) and _PY_ERROR.match(line):
            if line.startswith(_PY4J) and n + 1 < len(rest) and rest[n + 1].startswith(": "):
                # "An error occurred while calling o512.execute." names no problem; the
                # Java exception on the next line does.
                return rest[n + 1][2:]
            # PySpark's captured errors repeat the JVM's text after the first line.
            return line
    return None


def _innermost_cause(lines: list[str]) -> str | None:
    causes = [m.group(1) for m in map(_JAVA_CAUSE.match, lines) if m]
    return causes[-1] if causes else None
