"""Taking the slot over from a predecessor without waiting for ``wal_sender_timeout``.

A bridge starts by registering the slot's Kafka transactional id, which fences every earlier
producer of that id: from then on a predecessor can commit nothing to Kafka, and so can
confirm nothing to PostgreSQL that Kafka does not hold (a bridge confirms only published
positions). Its walsender may still hold the slot, though: a paused process (SIGSTOP, a
frozen VM), or one whose connection stays half-open after its node was lost, keeps it until
the server's ``wal_sender_timeout`` ends it. The predecessor can do no harm any more, so the
successor ends that walsender itself, but only

- a walsender that is a bridge's: its ``application_name`` is that of the successor's own
  replication connection (the same settings give the same name; a foreign consumer of the
  slot is waited for and then refused, as before), and
- where the server lets the successor's role signal it (the same role, or a member of
  ``pg_signal_backend``; the server decides, its refusal is the SQLSTATE
  ``insufficient_privilege``): otherwise the successor waits as before and says why.

A predecessor that runs again finds its stream ended, asks Kafka with its old producer
whether it was fenced (``Bridge._fenced``), and stops.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.bridge.source import Conn


@dataclass(frozen=True, slots=True)
class Holder:
    """The walsender holding a slot, as pg_stat_activity shows it."""

    pid: int
    application_name: str
    role: str

    def __str__(self) -> str:
        return f"process {self.pid} (role {self.role}, application_name {self.application_name!r})"


def slot_holder(sql: Conn, pid: int) -> Holder | None:
    """The walsender ``pid``, or None once it is gone."""
    with sql.cursor() as cur:
        cur.execute(
            "SELECT application_name, usename FROM pg_stat_activity "
            "WHERE pid = %s AND backend_type = 'walsender'",
            (pid,),
        )
        row = cur.fetchone()
    return None if row is None else Holder(pid, str(row[0] or ""), str(row[1] or ""))


def end_walsender(sql: Conn, holder: Holder, wait_s: float) -> bool:
    """Terminate the walsender and wait for it to exit (which releases the slot); True once
    it is gone. ``psycopg.errors.InsufficientPrivilege`` when this role may not signal it."""
    with sql.cursor() as cur:
        cur.execute("SELECT pg_terminate_backend(%s, %s)", (holder.pid, int(wait_s * 1000)))
        row = cur.fetchone()
    return bool(row and row[0])
