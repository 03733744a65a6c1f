"""Which server of ``source_dsn`` a session streams from.

libpq walks a multi-host DSN by itself, but it only knows "answers" and
``target_session_attrs``, and a writable old primary that came back after a failover
passes both. So the bridge tries the listed servers one by one, in the DSN's order, and
skips one that cannot be where the published progress came from (``check_identity``)
with a WARNING naming it, its timeline and the published one.

Invariants: a session's SQL and replication connections (and the snapshots' extra ones,
through ``Server.dsn``) all reach the same server; a server is judged before anything is
written to it; a one-server DSN fails with that server's own error, as before.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass

import psycopg

from services.bridge.progress.highwater import IdentityError, ServerIdentity, check_identity
from services.bridge.receive.stream import ReplicationConnection, StreamError, SystemInfo
from services.common.logs import log_event, one_line
from services.common.pg import SourceError, connect, host_dsns, server_address
from services.contract.records import ProgressRecord

log = logging.getLogger(__name__)


@dataclass
class Server:
    """One server of ``source_dsn``, with the session's two connections to it."""

    dsn: str  # this server alone
    address: str  # host:port, for logs
    sql: psycopg.Connection[tuple[object, ...]]
    repl: ReplicationConnection
    system: SystemInfo

    @property
    def identity(self) -> ServerIdentity:
        return ServerIdentity(self.system.system_identifier, self.system.timeline)

    def close(self) -> None:
        self.repl.close()
        self.sql.close()


def _connect(dsn: str) -> Server:
    with ExitStack() as opened:  # closes what was opened if a later step fails
        sql = connect(dsn)  # first: its errors carry the likely fix (SourceError)
        opened.callback(sql.close)
        repl = ReplicationConnection(dsn)
        opened.callback(repl.close)
        system = repl.identify_system()
        opened.pop_all()
    return Server(dsn, server_address(dsn), sql, repl, system)


def open_server(source_dsn: str, published: ProgressRecord | None, slot: str) -> Server:
    """The first server of ``source_dsn`` that answers and may continue ``published``.

    Raises the server's own error for a one-server DSN; otherwise, when no server will
    do, a SourceError listing why each was passed over.
    """
    dsns = host_dsns(source_dsn)
    passed_over: list[str] = []
    for dsn in dsns:
        try:
            server = _connect(dsn)
        except (SourceError, StreamError) as exc:
            if len(dsns) == 1:
                raise
            # A down or read-only server is what a multi-host DSN is for: no warning.
            log_event(
                log,
                logging.INFO,
                "source_dsn: server not used",
                server=server_address(dsn),
                reason=one_line(exc),
            )
            passed_over.append(f"{server_address(dsn)}: {one_line(exc)}")
            continue
        try:
            check_identity(server.identity, published, slot)
        except IdentityError as exc:
            server.close()
            if len(dsns) == 1:
                raise
            log_event(
                log,
                logging.WARNING,
                f"source_dsn: skipping {server.address}: {exc.problem}",
                server=server.address,
                system=exc.server.system_identifier,
                timeline=exc.server.timeline,
                published_system=exc.published.system_identifier,
                published_timeline=exc.published.timeline,
            )
            passed_over.append(f"{server.address}: {exc.problem}")
            continue
        return server
    raise SourceError(
        f"no server in source_dsn can be used ({'; '.join(passed_over)}); "
        "start the current primary or point source_dsn at it"
    )
