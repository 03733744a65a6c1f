"""PostgreSQL connections with errors an operator can act on, and DSNs safe to print."""

from __future__ import annotations

import re

import psycopg
from psycopg import conninfo

from services.common.errors import SlotbridgeError


class SourceError(SlotbridgeError):
    """A problem with a PostgreSQL server or its setup; the message says what to do."""

    retryable = True  # a server down, restarting or being promoted comes back


class SourceRefused(SourceError):
    """A source problem no new session can get past (a missing GRANT, a dropped
    publication, a slot that is not ours): the daemon stops even after it streamed."""

    retryable = False


_SECRET_KEYS = ("password", "sslpassword", "sslkey")


def check_dsn(value: str) -> str:
    """Validator: a libpq connection string, refused without echoing it.

    libpq's parse errors quote the text around the fault ("missing '=' after 'S3cret'"),
    and a malformed DSN is most often one with a password in it: only the kind of error
    is kept.
    """
    try:
        conninfo.conninfo_to_dict(value)
    except psycopg.ProgrammingError as exc:
        raise ValueError(
            f"not a libpq connection string ({_parse_fault(exc)}); write "
            "key=value pairs separated by spaces, quote values with spaces "
            "in them ('...'), or use a postgresql:// URI"
        ) from None
    return value


def _parse_fault(exc: psycopg.Error) -> str:
    """What kind of parse error libpq reported, without the text it quotes."""
    text = str(exc)
    option = re.search(r'invalid connection option "(\w+)"', text)
    if option:  # a key name, never a value
        return f"unknown parameter {option.group(1)}"
    for kind in (
        'missing "="',
        "missing '='",
        "unterminated quoted string",
        "invalid URI",
        "invalid percent-encoded token",
        "unexpected spaces",
    ):
        if kind.lower() in text.lower():
            return kind.replace('"', "'")
    return type(exc).__name__


def with_password(dsn: str, password: str | None) -> str:
    """Add a password to a DSN without the caller building strings by hand."""
    if not password:
        return dsn
    return conninfo.make_conninfo(dsn, password=password)


def host_dsns(dsn: str) -> list[str]:
    """One DSN per server of a multi-host DSN (``host=a,b port=1,2``), in the DSN's order.

    libpq picks the first listed server that answers and matches ``target_session_attrs``;
    a caller with reasons of its own to refuse a server walks these instead. Each keeps
    every other parameter (``target_session_attrs`` too, checked per server). A one-server
    DSN comes back unchanged.
    """
    params = {k: str(v) for k, v in conninfo.conninfo_to_dict(dsn).items()}
    lists = {key: params[key].split(",") for key in ("host", "hostaddr", "port") if key in params}
    count = max((len(v) for v in lists.values()), default=1)
    if count == 1:
        return [dsn]
    for key, values in lists.items():
        if len(values) == 1:  # libpq's rule: one port (or host) serves every entry
            lists[key] = values * count
        elif len(values) != count:
            raise SourceError(
                f"source DSN lists {count} servers but {len(values)} {key} "
                f"values; give one {key} or one per server"
            )
    return [
        conninfo.make_conninfo(**(params | {k: v[i] for k, v in lists.items()}))
        for i in range(count)
    ]


def server_address(dsn: str) -> str:
    """``host:port`` of a one-server DSN, for logs (no secrets)."""
    params = conninfo.conninfo_to_dict(dsn)
    host = params.get("hostaddr") or params.get("host") or "localhost"
    return f"{host}:{params.get('port') or 5432}"


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
    """One line: what failed and the likely fix, never the password.

    The one place that reads an error's text: libpq reports a failed connection attempt by
    message only (no SQLSTATE reaches a client before its session exists), so the hint is
    picked from libpq's and the server's English words and is "see the server log" under
    another language. It only words the line: nothing is decided on it.
    """
    # libpq's messages span lines (the cause first, its own hint after): fold them.
    text = (
        " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        or type(exc).__name__
    )
    where = redact_dsn(dsn)
    lowered = text.lower()
    if "password authentication failed" in lowered:
        hint = "check the user name and password"
    elif (
        "connection refused" in lowered
        or "could not translate host" in lowered
        or "timeout" in lowered
        or "no route" in lowered
    ):
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


def connect(
    dsn: str, *, autocommit: bool = True, connect_timeout: int = 10, **kwargs: str
) -> psycopg.Connection[tuple[object, ...]]:
    """A plain SQL connection; raises SourceError with a one-line reason on failure."""
    full = complete_dsn(dsn, connect_timeout=connect_timeout, **kwargs)
    try:
        return psycopg.connect(full, autocommit=autocommit)
    except psycopg.Error as exc:
        raise SourceError(explain_connect_error(exc, full)) from None


def complete_dsn(dsn: str, *, connect_timeout: int = 10, **kwargs: str) -> str:
    """``dsn`` with ``kwargs`` set and a connect timeout unless it has one.

    Raises SourceError, never quoting the DSN, if it does not parse: settings validate
    their DSNs, but a password from ``source_password`` is merged in later.
    """
    try:
        full = conninfo.make_conninfo(dsn, **kwargs)
        if "connect_timeout" not in conninfo.conninfo_to_dict(full):
            full = conninfo.make_conninfo(full, connect_timeout=str(connect_timeout))
    except psycopg.ProgrammingError as exc:
        raise SourceError(
            f"the PostgreSQL connection string is not valid ({_parse_fault(exc)}); fix source_dsn"
        ) from None
    return full
