"""What the probe saw, as plain frozen values: the contract between probe and checks.

Keeping the observations free of connections lets the judging in ``checks`` be pure (and
unit-tested with hand-made facts), and lets ``--json`` print exactly what was seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The wait event of a logical walsender held back by synchronized_standby_slots (17+).
WAIT_FOR_STANDBY = "WaitForStandbyConfirmation"


@dataclass(frozen=True)
class Slot:
    name: str
    slot_type: str  # "physical" | "logical"
    active: bool
    temporary: bool
    failover: bool
    synced: bool
    invalidation_reason: str | None
    confirmed_flush_lsn: int | None
    restart_lsn: int | None

    @property
    def position(self) -> int | None:
        """How far its consumer confirmed: flushed WAL for a standby, changes for a
        logical consumer."""
        return self.restart_lsn if self.slot_type == "physical" else self.confirmed_flush_lsn


@dataclass(frozen=True)
class Sender:
    """One walsender on the primary, sampled a few times (wait events in sample order)."""

    pid: int
    application_name: str
    slot_name: str | None
    slot_type: str | None
    wait_events: tuple[str | None, ...]

    @property
    def always_waiting_for_standby(self) -> bool:
        return bool(self.wait_events) and all(w == WAIT_FOR_STANDBY for w in self.wait_events)


@dataclass(frozen=True)
class Server:
    """Facts every node has, primary or standby."""

    name: str
    reachable: bool
    error: str | None = None
    in_recovery: bool = False
    system_identifier: int | None = None
    timeline: int | None = None
    wal_lsn: int | None = None  # current insert LSN on a primary, replay LSN on a standby
    settings: dict[str, str] = field(default_factory=dict)
    primary_conninfo_dbname: str | None = None
    wal_receiver_status: str | None = None
    slots: tuple[Slot, ...] = ()
    senders: tuple[Sender, ...] = ()
    # The slots again once the senders were sampled, and for how long they were: what
    # moved meanwhile tells a standby that confirms slowly from one that does not at all.
    slots_after: tuple[Slot, ...] = ()
    senders_window_s: float = 0.0

    def slot(self, name: str) -> Slot | None:
        return next((s for s in self.slots if s.name == name), None)

    def slot_advanced(self, name: str) -> bool:
        """Did the slot's position move while the senders were sampled?"""
        before = self.slot(name)
        after = next((s for s in self.slots_after if s.name == name), None)
        if before is None or after is None or before.position is None or after.position is None:
            return False
        return after.position > before.position

    def setting_list(self, name: str) -> list[str]:
        """A comma-separated GUC (synchronized_standby_slots) as names."""
        raw = self.settings.get(name, "")
        return [p.strip().strip('"') for p in raw.split(",") if p.strip()]


@dataclass(frozen=True)
class Subscription:
    oid: int
    name: str
    database: str
    enabled: bool
    failover: bool
    slot_name: str | None
    publisher: dict[str, str]  # the conninfo, password removed
    worker_pid: int | None
    received_lsn: int | None
    sync_slots: tuple[str, ...]  # table-sync slots of tables in state 'f' (finished copy)


@dataclass(frozen=True)
class SubscriberFacts:
    name: str
    reachable: bool
    error: str | None = None
    subscriptions: tuple[Subscription, ...] = ()


@dataclass(frozen=True)
class ClusterFacts:
    primary: Server
    standbys: tuple[Server, ...]
    subscribers: tuple[SubscriberFacts, ...]
    bridge_slots: tuple[str, ...]
    managed_subscriptions: dict[str, tuple[str, ...] | None]  # subscriber -> names or all

    def standby(self, name: str) -> Server | None:
        return next((s for s in self.standbys if s.name == name), None)
