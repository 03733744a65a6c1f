"""Continuing a slot's published progress on its source after ``pg_upgrade``.

PostgreSQL 17 and newer carry a caught-up logical slot through ``pg_upgrade``, and the new
cluster's WAL goes on above the old one's, so the bridge could simply resume; but
``pg_upgrade`` makes a new cluster with a new system identifier, and does not carry
replication origins. The bridge refuses a server whose system identifier differs from the
published progress's (``highwater.check_identity``): that is how it tells another cluster
from its own. So the operator says, once, that this server is the upgrade of that one
(``slotbridge adopt-upgrade --from-system ID``), and this module checks what can be checked
before it writes the new identity into Kafka's progress record:

- the published progress came from the system the operator names;
- the slot exists here, is pgoutput and valid, and confirms at least the published
  position (pg_upgrade moves only slots that had confirmed every change, and the new WAL
  goes on above the old: a slot behind the published position cannot be ours carried over).

Then the origin is created and advanced to the published position (before the progress
record, so a crash in between leaves a command that can simply be run again), and the
progress record is written again with this server's identity, in a Kafka transaction of
the slot's transactional id (which also fences a bridge still running on the slot).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.bridge.oneoff import fenced_slot, source_dsn
from services.bridge.progress.highwater import ServerIdentity
from services.bridge.progress.origin import OriginStore
from services.bridge.progress.record import progress_again, progress_key
from services.bridge.receive.stream import ReplicationConnection
from services.bridge.settings import BridgeSettings
from services.bridge.sink.kafka import KafkaSink
from services.bridge.source import Conn, slot_state
from services.common.errors import SlotbridgeError
from services.common.logs import log_event
from services.common.lsn import format_lsn, parse_lsn
from services.common.pg import connect
from services.contract.records import ProgressRecord

log = logging.getLogger(__name__)


class AdoptRefused(SlotbridgeError):
    """The server cannot be taken as the upgrade of the published one; the message says
    why and what to do."""

    retryable = False


@dataclass(frozen=True, slots=True)
class Adopted:
    """What ``adopt_upgraded_source`` did: the published position now belongs to
    ``system`` on ``timeline``; ``changed`` is False when it already did."""

    slot: str
    previous_system: str
    system: str
    timeline: int
    end_lsn: str
    changed: bool


def adopt_upgraded_source(settings: BridgeSettings, from_system: str) -> Adopted:
    """Take the source server as the ``pg_upgrade`` of system ``from_system`` (see the
    module's docstring); ``AdoptRefused`` when a check fails, with nothing written."""
    slot = settings.slot_name
    dsn = source_dsn(settings)
    with fenced_slot(settings) as (sink, published):
        if published is None:
            raise AdoptRefused(
                f"slot {slot} has no published progress in {settings.progress_topic}: "
                "nothing to adopt; start the bridge (it takes any server then)"
            )
        server = _identity(dsn)
        changed = published.system_identifier != server.system_identifier
        if changed:
            _adopt(settings, dsn, sink, published, server, from_system)
    return Adopted(
        slot,
        from_system,
        server.system_identifier,
        server.timeline,
        format_lsn(published.end_lsn),
        changed,
    )


def _adopt(
    settings: BridgeSettings,
    dsn: str,
    sink: KafkaSink,
    published: ProgressRecord,
    server: ServerIdentity,
    from_system: str,
) -> None:
    """The checks, then the origin, then the progress record (the module's docstring)."""
    slot = settings.slot_name
    if published.system_identifier != from_system:
        raise AdoptRefused(
            f"slot {slot}'s progress was published from system "
            f"{published.system_identifier}, not {from_system}: check --from-system "
            "(`slotbridge status` shows the published system)"
        )
    with connect(dsn) as sql:
        _check_slot_carried(sql, slot, published.end_lsn)
        origin = OriginStore(sql, settings.origin_name)
        origin.ensure()
        if origin.progress() < published.end_lsn:
            origin.advance(published.end_lsn)
    sink.begin()
    sink.produce(
        settings.progress_topic,
        progress_key(slot),
        progress_again(
            published, system_identifier=server.system_identifier, timeline=server.timeline
        ),
    )
    sink.commit()
    log_event(
        log,
        logging.INFO,
        "adopted upgraded source",
        slot=slot,
        previous_system=from_system,
        system=server.system_identifier,
        timeline=server.timeline,
        end_lsn=format_lsn(published.end_lsn),
    )


def _identity(dsn: str) -> ServerIdentity:
    repl = ReplicationConnection(dsn)
    try:
        system = repl.identify_system()
    finally:
        repl.close()
    return ServerIdentity(system.system_identifier, system.timeline)


def _check_slot_carried(sql: Conn, slot: str, published_end: int) -> None:
    """Refuse unless the slot here can be the published slot carried over by pg_upgrade."""
    state = slot_state(sql, slot)
    if state is None:
        raise AdoptRefused(
            f"slot {slot} does not exist on this server: pg_upgrade moves a logical slot only "
            "when it had confirmed every change; upgrade again from the old cluster after "
            "the bridge caught up, or start over with a new slot and snapshot"
        )
    if state.plugin != "pgoutput" or state.invalidation_reason:
        raise AdoptRefused(
            f"slot {slot} here is {state.plugin}"
            + (f", invalidated ({state.invalidation_reason})" if state.invalidation_reason else "")
            + ": not the bridge's slot carried over by pg_upgrade"
        )
    confirmed = parse_lsn(state.confirmed_flush) if state.confirmed_flush else 0
    if confirmed < published_end:
        raise AdoptRefused(
            f"slot {slot} here confirms {format_lsn(confirmed)}, below the published "
            f"{format_lsn(published_end)}: it is not the published slot carried over by "
            "pg_upgrade (whose WAL goes on above the old cluster's); point source_dsn at the "
            "upgraded cluster"
        )
