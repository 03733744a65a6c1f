"""Getting the slot for a session: created, taken over from a fenced predecessor, or
waited for while another walsender still holds it.

Kept apart from the daemon's session loop because every branch here is a decision about
someone else's process (a predecessor's walsender, a second bridge racing for the same slot,
a foreign consumer), and each decision is told to the operator in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import psycopg
from psycopg.errors import DuplicateObject, ObjectInUse

from services.bridge.progress.origin import OriginStore
from services.bridge.publish.publisher import HEARTBEAT_S
from services.bridge.receive.stream import ReplicationConnection, StreamError
from services.bridge.settings import BridgeSettings
from services.bridge.sink.errors import FencedError
from services.bridge.sink.kafka import KafkaSink
from services.bridge.source import check_slot, ensure_publication, slot_state
from services.bridge.takeover import end_walsender, slot_holder
from services.common.logs import log_event
from services.common.lsn import format_lsn
from services.common.pg import SourceError
from services.contract.records import ProgressRecord

log = logging.getLogger(__name__)

# How long a successor waits for the predecessor's walsender to exit once it ended it.
_TAKEOVER_WAIT_S = 10.0


class SlotBusy(SourceError):
    """The slot is in use by another walsender.

    Two bridges on a slot: the one that registered its Kafka transactional id last wins.
    Every session starts by fencing the producers before it and ends a fenced bridge's
    walsender itself (``takeover``); where it may not, the walsender in the way stops at its
    bridge's next Kafka call, within HEARTBEAT_S, or the server ends it after
    wal_sender_timeout. ``wait_s`` covers both; a slot still held after that is streamed by
    something else.
    """

    retryable = True  # and waited out even before a session streamed (``retry_session``)

    def __init__(self, slot: str, holder: str, wait_s: float) -> None:
        super().__init__(
            f"slot {slot} is in use by {holder}; waiting until it is released "
            f"(at most {wait_s:.0f}s)"
        )
        self.slot = slot
        self.holder = holder
        self.wait_s = wait_s


class SlotClaim:
    """How a session gets its slot; ``known_wait`` marks a wait the source imposes (slot
    creation waits for the transactions open at that moment) so health checks hold;
    ``fenced`` asks Kafka with a session's producer whether a successor fenced it (the
    daemon's ``Bridge._fenced``, which keeps asking while Kafka cannot answer)."""

    def __init__(
        self,
        settings: BridgeSettings,
        known_wait: Callable[[str], AbstractContextManager[None]],
        fenced: Callable[[KafkaSink], FencedError | None],
    ) -> None:
        self._settings = settings
        self._known_wait = known_wait
        self._fenced = fenced

    def ensure(
        self,
        sql: psycopg.Connection[tuple[object, ...]],
        repl: ReplicationConnection,
        sink: KafkaSink,
        origin: OriginStore,
        dbname: str,
        kafka_progress: ProgressRecord | None,
    ) -> None:
        """Create the slot (and the publication, and first the origin that marks the slot
        as ours) if needed. No snapshot is exported: snapshots are read in chunks while the
        slot streams."""
        s = self._settings
        state = slot_state(sql, s.slot_name)
        if state is not None:
            # Before anything else: is it ours at all?
            check_slot(state, s, ours=kafka_progress is not None or origin.exists())
        if state is not None and state.active_pid is not None:
            self._take_over(sql, repl, sink, state.active_pid)
            # The walsender ended may have been creating the slot: one not yet persisted
            # (still waiting for the transactions open when it began) went with it.
            state = slot_state(sql, s.slot_name)
        ensure_publication(sql, s, slot_is_new=state is None)
        if state is None:
            # The origin first: a crash between the two leaves an origin without a slot
            # (harmless), never a slot of ours without its mark.
            origin.ensure()
            with self._known_wait(
                f"creating slot {s.slot_name}: waits until the source's "
                "transactions open now have ended"
            ):
                created = repl.create_slot(s.slot_name, two_phase=s.two_phase)
            log_event(
                log,
                logging.INFO,
                "created failover slot",
                slot=s.slot_name,
                consistent_point=format_lsn(created.consistent_point),
                db=dbname,
            )
            return
        if not state.failover:
            repl.command(f"ALTER_REPLICATION_SLOT {s.slot_name} (FAILOVER true)")
            log_event(log, logging.INFO, "enabled failover on existing slot", slot=s.slot_name)

    def _take_over(
        self,
        sql: psycopg.Connection[tuple[object, ...]],
        repl: ReplicationConnection,
        sink: KafkaSink,
        pid: int,
    ) -> None:
        """End the walsender of a predecessor this session's producer has fenced (see
        ``takeover``); SlotBusy to wait for it where that is not allowed."""
        holder = slot_holder(sql, pid)
        if holder is None:
            return  # gone since the slot was read: it is free
        if holder.application_name != repl.application_name():
            raise self._busy(sql, f"{holder}, not a bridge")
        # Still the newest? Two bridges starting together each fence the other's earlier
        # registration; only the last one registered may end the other's walsender
        # (FencedError stops this one instead).
        sink.prove_not_fenced()
        try:
            ended = end_walsender(sql, holder, _TAKEOVER_WAIT_S)
        except psycopg.errors.InsufficientPrivilege:
            log_event(
                log,
                logging.WARNING,
                f"cannot end the walsender of the fenced predecessor, {holder}: role "
                f"{sql.info.user} may not signal it; waiting until the server ends it "
                "(wal_sender_timeout). GRANT pg_signal_backend to this role, or run every "
                "bridge of the slot as one role, to take over at once",
                slot=self._settings.slot_name,
            )
            raise self._busy(sql, str(holder)) from None
        if not ended:
            raise self._busy(sql, f"{holder}, still exiting")
        log_event(
            log,
            logging.INFO,
            f"ended the walsender of the predecessor, {holder}: this bridge registered the "
            "slot's Kafka transactional id, so the predecessor can publish and confirm nothing "
            "more",
            slot=self._settings.slot_name,
            pid=holder.pid,
        )

    @contextmanager
    def racing(
        self, sql: psycopg.Connection[tuple[object, ...]], sink: KafkaSink
    ) -> Iterator[None]:
        """Replication commands that may lose a race for the slot to another bridge.

        A bridge that registered the transactional id after this one wins the race: it
        may have ended this session's walsender (``takeover``), which breaks the command
        with any error, or hold or have made the slot itself. Kafka is asked first, with
        this session's producer (a new one would fence the winner in turn), and asked
        again while it cannot answer (``fenced``), so such a loser stops with FencedError.
        Otherwise a slot held or just made by someone else is SlotBusy, not a failure. Only
        while no other thread uses ``sink``.
        """
        try:
            yield
        except StreamError as exc:
            fenced = self._fenced(sink)
            if fenced is not None:
                raise fenced from None
            if exc.sqlstate == ObjectInUse.sqlstate:
                state = slot_state(sql, self._settings.slot_name)
                holder = state.active_pid if state is not None else None
                raise self._busy(
                    sql, f"process {holder}" if holder else "a process that has just let it go"
                ) from None
            if exc.sqlstate == DuplicateObject.sqlstate:  # both found no slot; the other made it
                raise self._busy(sql, "another bridge that just created it") from None
            raise

    def _busy(self, sql: psycopg.Connection[tuple[object, ...]], holder: str) -> SlotBusy:
        with sql.cursor() as cur:
            cur.execute("SELECT setting::int FROM pg_settings WHERE name = 'wal_sender_timeout'")
            row = cur.fetchone()
        timeout_ms = int(str(row[0])) if row else 0
        # 0 disables the timeout: a dead client's walsender then lingers until TCP notices.
        linger_s = timeout_ms / 1000 if timeout_ms > 0 else 60.0
        return SlotBusy(self._settings.slot_name, holder, linger_s + 2 * HEARTBEAT_S + 10)
