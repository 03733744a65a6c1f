"""PostgreSQL connections with errors an operator can act on, and DSNs safe to print."""

from __future__ import annotations

import re

import psycopg
from psycopg import conninfo


class SourceError(Exception):
    """A problem with a PostgreSQL server or its setup; the message says what to do."""


_SECRET_KEYS = ("password", "sslpassword", "sslkey")


def with_password(dsn: str, password: str | None) -> str:
    """Add a password to a DSN without the caller building strings by hand."""
    if not password:
        return dsn
    return conninfo.make_conninfo(dsn, password=password)


def redact_dsn(dsn: str) -> str:
    """The DSN with secrets replaced, for logs and error messages."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return re.sub(r"(password=)\S+", r"\1***", dsn)
    for key in _SECRET_KEYS:
        if key in params:
            params[key] = "***"
    return conninfo.make_conninfo(**{k: str(v) for k, v in params.items()})


def explain_connect_error(exc: psycopg.Error, dsn: str) -> str:
    """One line: what failed and the likely fix, never the password."""
    # libpq's messages span lines (the cause first, its own hint after): fold them.
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) \
        or type(exc).__name__
    where = redact_dsn(dsn)
    lowered = text.lower()
    if "password authentication failed" in lowered:
        hint = "check the user name and password"
    elif "connection refused" in lowered or "could not translate host" in lowered \
            or "timeout" in lowered or "no route" in lowered:
        hint = "is the server running and reachable at that host and port?"
    elif "does not exist" in lowered:
        hint = "check the database and role names"
    elif "no pg_hba.conf entry" in lowered:
        hint = "add a pg_hba.conf entry for this client (replication entries for the bridge)"
    elif "must have the replication" in lowered or "permission denied" in lowered:
        hint = "grant the role REPLICATION (ALTER ROLE ... REPLICATION)"
    else:
        hint = "see the server log"
    return f"cannot connect to PostgreSQL ({where}): {text}; {hint}"


def connect(dsn: str, *, autocommit: bool = True, connect_timeout: int = 10,
            **kwargs: str) -> psycopg.Connection[tuple[object, ...]]:
    """A plain SQL connection; raises SourceError with a one-line reason on failure."""
    full = conninfo.make_conninfo(dsn, **kwargs)
    if "connect_timeout" not in full:
        full = conninfo.make_conninfo(full, connect_timeout=str(connect_timeout))
    try:
        return psycopg.connect(full, autocommit=autocommit)
    except psycopg.Error as exc:
        raise SourceError(explain_connect_error(exc, full)) from None
