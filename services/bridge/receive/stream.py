"""The streaming replication protocol over libpq (``psycopg.pq``), nothing more.

psycopg 3 has no high-level replication API, so this module speaks the walsender
protocol directly: a ``replication=database`` connection, replication commands, then a
COPY_BOTH stream of XLogData ('w') and keepalive ('k') messages in, standby status
updates ('r') out. It knows nothing of pgoutput; payloads go to the caller as bytes.
"""

from __future__ import annotations

import select
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import conninfo, pq

from services.common.errors import SlotbridgeError
from services.common.lsn import PG_EPOCH_UNIX_US, format_lsn, parse_lsn
from services.common.pg import complete_dsn, redact_dsn

_XLOGDATA = struct.Struct("!QQQ")  # dataStart, walEnd, sendTime
_KEEPALIVE = struct.Struct("!QQB")  # walEnd, sendTime, replyRequested
_STATUS = struct.Struct("!cQQQQB")
# Session settings that make text output canonical for the value converters (money's
# output follows lc_monetary: C prints '-$1,234.56' whatever the database's locale).
APPLICATION_NAME = "slotbridge"
SESSION_OPTIONS = (
    "-c DateStyle=ISO -c IntervalStyle=iso_8601 -c TimeZone=UTC -c extra_float_digits=3"
    " -c lc_monetary=C"
)


class StreamError(SlotbridgeError):
    """The replication connection failed or was refused; the message says why, and
    ``sqlstate`` (the server's error code, None for a client-side failure) is what callers
    decide on: messages follow the server's lc_messages."""

    retryable = True

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def _failed(what: str, res: pq.abc.PGresult) -> StreamError:
    """The error of a command's result, with its SQLSTATE."""
    code = res.error_field(pq.DiagnosticField.SQLSTATE)
    return StreamError(
        f"{what}: {(res.error_message or b'').decode(errors='replace').strip()}",
        code.decode() if code else None,
    )


@dataclass(frozen=True, slots=True)
class SystemInfo:
    system_identifier: str
    timeline: int
    xlogpos: int
    dbname: str


@dataclass(frozen=True, slots=True)
class SlotCreated:
    name: str
    consistent_point: int
    snapshot_name: str | None


def now_pg_us() -> int:
    """Now, as pgoutput and standby status messages count time."""
    return int(time.time() * 1_000_000) - PG_EPOCH_UNIX_US


class ReplicationConnection:
    """One walsender session: replication commands, then the COPY_BOTH stream."""

    def __init__(self, dsn: str) -> None:
        user_options = str(conninfo.conninfo_to_dict(dsn).get("options") or "")
        full = complete_dsn(
            dsn,
            replication="database",
            client_encoding="UTF8",
            options=f"{user_options} {SESSION_OPTIONS}".strip(),
            # Marks the walsender as a bridge's for a successor (``takeover``) unless the
            # DSN names one (synchronous_standby_names may depend on it).
            fallback_application_name=APPLICATION_NAME,
        )
        self._redacted = redact_dsn(full)
        self.conn = pq.PGconn.connect(full.encode())
        if self.conn.status != pq.ConnStatus.OK:
            # libpq's message is the cause, then its hint on a line of its own: keep both.
            message = " ".join(
                line.strip() for line in self.conn.get_error_message().splitlines() if line.strip()
            )
            self.conn.finish()
            raise StreamError(
                f"cannot open a replication connection ({self._redacted}): "
                f"{message or 'unknown error'}"
            )
        self._streaming = False

    def command(self, sql: str) -> list[tuple[str | None, ...]]:
        """Run a replication command or simple query; rows as text."""
        res = self.conn.exec_(sql.encode())
        status = pq.ExecStatus(res.status)
        if status not in (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK):
            raise _failed(f"{sql.split()[0]} failed", res)
        rows = []
        for r in range(res.ntuples):
            row = []
            for c in range(res.nfields):
                value = res.get_value(r, c)
                row.append(None if value is None else bytes(value).decode())
            rows.append(tuple(row))
        return rows

    def application_name(self) -> str:
        """The session's application_name, as the server reported it."""
        value = self.conn.parameter_status(b"application_name")
        return value.decode() if value else ""

    def identify_system(self) -> SystemInfo:
        ((sysid, timeline, xlogpos, dbname),) = self.command("IDENTIFY_SYSTEM")
        assert sysid is not None and timeline is not None and xlogpos is not None
        return SystemInfo(sysid, int(timeline), parse_lsn(xlogpos), dbname or "")

    def create_slot(self, name: str, *, two_phase: bool) -> SlotCreated:
        """CREATE_REPLICATION_SLOT ... LOGICAL pgoutput with failover (PostgreSQL 17+)."""
        rows = self.command(
            f"CREATE_REPLICATION_SLOT {name} LOGICAL pgoutput "
            f"(FAILOVER true, TWO_PHASE {str(two_phase).lower()}, SNAPSHOT 'nothing')"
        )
        return _created(rows)

    def start(self, slot: str, lsn: int, options: dict[str, str]) -> None:
        opts = ", ".join(f"{k} '{v}'" for k, v in options.items())
        sql = f"START_REPLICATION SLOT {slot} LOGICAL {format_lsn(lsn)} ({opts})"
        res = self.conn.exec_(sql.encode())
        if pq.ExecStatus(res.status) != pq.ExecStatus.COPY_BOTH:
            raise _failed("START_REPLICATION failed", res)
        self.conn.nonblocking = 1
        self._streaming = True

    def next_message(self) -> tuple[str, int, int, bytes | bool] | None:
        """The next message libpq holds: ``('w', data_start, wal_end, payload)`` or
        ``('k', wal_end, 0, reply)``; None when it holds no whole one (``wait`` for more)."""
        while True:
            nbytes, data = self.conn.get_copy_data(1)
            if nbytes == 0:
                return None
            if nbytes < 0:
                raise self.stream_ended()
            # One copy, of the payload only: a single message may be hundreds of MB (one
            # huge row), and each extra copy of it is that much more peak memory.
            raw = memoryview(data)
            kind = raw[0]
            if kind == 0x77:  # 'w'
                start, end, _ = _XLOGDATA.unpack_from(raw, 1)
                return "w", start, end, raw[25:].tobytes()
            if kind == 0x6B:  # 'k'
                end, _, reply = _KEEPALIVE.unpack_from(raw, 1)
                return "k", end, 0, bool(reply)

    def wait(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the server to send more, and take it in; False
        when nothing came."""
        ready, _, _ = select.select([self.conn.socket], [], [], timeout_s)
        if not ready:
            return False
        try:
            self.conn.consume_input()
        except psycopg.OperationalError as exc:  # the connection broke
            raise StreamError(f"replication stream ended: {exc}") from None
        return True

    @property
    def copy_data(self) -> Callable[[int], tuple[int, memoryview | bytes]]:
        """psycopg's ``PGconn.get_copy_data`` of this stream, for a compiled reader of the
        messages libpq holds (``decode._runs``), which frames them as ``next_message``."""
        return self.conn.get_copy_data

    def send_status(self, written: int, flushed: int, reply: bool = False) -> None:
        msg = _STATUS.pack(b"r", written, flushed, flushed, now_pg_us(), 1 if reply else 0)
        if self.conn.put_copy_data(msg) != 1:
            raise StreamError(f"cannot send status update: {self._error()}")
        deadline = time.monotonic() + 10
        while self.conn.flush() == 1:  # nonblocking: 1 means not everything went out
            if time.monotonic() > deadline:
                raise StreamError("cannot send status update: socket stuck for 10 s")
            select.select([], [self.conn.socket], [], 1.0)

    def close(self) -> None:
        if self._streaming:
            try:
                self.conn.put_copy_end()
                self.conn.flush()
            except Exception:
                pass
        self.conn.finish()

    def _error(self) -> str:
        return self.conn.get_error_message().strip() or "connection lost"

    def stream_ended(self) -> StreamError:
        """The error that ends the stream once the server closed the COPY."""
        res = self.conn.get_result()
        if res is not None and res.error_message:
            return _failed("replication stream ended", res)
        return StreamError("replication stream ended: " + self._error())


def drop_slot(dsn: str, name: str) -> None:
    """Drop slot ``name`` once no session holds it any more.

    A walsender releases its slot only when its backend exits, a moment after the client
    closes the stream, so the drop waits for that (DROP_REPLICATION_SLOT ... WAIT) rather
    than fail with "slot is active".
    """
    repl = ReplicationConnection(dsn)
    try:
        repl.command(f"DROP_REPLICATION_SLOT {name} WAIT")
    finally:
        repl.close()


def _created(rows: list[tuple[str | None, ...]]) -> SlotCreated:
    slot, point, snap, _plugin = rows[0]
    assert slot is not None and point is not None
    return SlotCreated(slot, parse_lsn(point), snap)
