"""The replication origin: the bridge's last published commit, kept in PostgreSQL.

The fast half of the high-water mark (``highwater``): it is WAL-logged, so a promoted
standby carries it; the publisher advances it right after each Kafka commit.
"""

from __future__ import annotations

import logging

import psycopg

from services.common.logs import log_event
from services.common.lsn import format_lsn, parse_lsn
from services.common.pg import SourceRefused

log = logging.getLogger(__name__)


class OriginStore:
    """The replication origin that records the last published commit, over plain SQL.

    Its functions are superuser-only by default; a role without the GRANT gets one line
    naming the function and the GRANT to run, and the daemon stops (``SourceRefused``).
    """

    def __init__(self, conn: psycopg.Connection[tuple[object, ...]], name: str) -> None:
        self._conn = conn
        self.name = name

    def exists(self) -> bool:
        with self._conn.cursor() as cur:
            cur.execute("SELECT 1 FROM pg_replication_origin WHERE roname = %s", (self.name,))
            return cur.fetchone() is not None

    def ensure(self) -> None:
        if self.exists():
            return
        try:
            self._call("pg_replication_origin_create", "text", "%s", (self.name,))
        except psycopg.errors.UniqueViolation:
            return  # another bridge starting on the slot created it since we looked
        log_event(log, logging.INFO, "created replication origin", origin=self.name)

    def progress(self) -> int:
        """The recorded position; 0 while the origin does not exist."""
        if not self.exists():
            return 0
        value = self._call(
            "pg_replication_origin_progress", "text, boolean", "%s, true", (self.name,)
        )
        return parse_lsn(str(value)) if value else 0

    def advance(self, lsn: int) -> None:
        self._call(
            "pg_replication_origin_advance",
            "text, pg_lsn",
            "%s, %s::pg_lsn",
            (self.name, format_lsn(lsn)),
        )

    def _call(self, function: str, signature: str, args: str, params: tuple[object, ...]) -> object:
        try:
            with self._conn.cursor() as cur:
                cur.execute(f"SELECT {function}({args})", params)
                row = cur.fetchone()
        except psycopg.errors.InsufficientPrivilege:
            raise SourceRefused(
                f"the bridge's role may not call {function}; as a superuser run GRANT EXECUTE "
                f"ON FUNCTION {function}({signature}) TO {self._conn.info.user}"
            ) from None
        return row[0] if row else None
