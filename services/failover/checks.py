"""Judging the facts: is each standby a safe failover target right now? Pure functions.

The checks follow PostgreSQL 17's "Logical Replication Failover" procedure (which slots the
subscribers need, each one ``synced AND NOT temporary AND invalidation_reason IS NULL`` on
the standby) and add what that page leaves to the reader but an operator trips over: the
standby's own settings, ``synchronized_standby_slots`` naming a live physical slot, the
logical walsenders stalled behind a dead standby, lag, and the subscriptions themselves.

A ``fail`` blocks readiness; a ``warn`` is reported and exported but does not (lag, a
disabled subscription, a setting promote fixes by itself). Every non-ok result carries the
remedy, because "not ready" alone sends the operator to the docs at the worst moment.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

from services.failover.facts import (
    WAIT_FOR_STANDBY,
    ClusterFacts,
    Sender,
    Server,
    Slot,
    SubscriberFacts,
    Subscription,
)

Status = Literal["ok", "warn", "fail"]


@dataclass(frozen=True)
class Check:
    """One verdict. ``standby`` names the failover target it concerns (None: all of them)."""

    scope: str
    code: str
    status: Status
    detail: str
    remedy: str = ""
    standby: str | None = None


@dataclass(frozen=True)
class SlotState:
    standby: str
    slot: str
    ready: bool
    lag_bytes: int | None


@dataclass(frozen=True)
class SubscriptionState:
    subscriber: str
    subscription: str
    enabled: bool
    streaming: bool


@dataclass(frozen=True)
class Thresholds:
    max_slot_lag_bytes: int
    max_replay_lag_bytes: int


@dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]
    standbys: tuple[str, ...]
    replay_lag_bytes: dict[str, int | None] = field(default_factory=dict)
    slots: tuple[SlotState, ...] = ()
    subscriptions: tuple[SubscriptionState, ...] = ()

    def failures(self, standby: str | None = None) -> list[Check]:
        """Failed checks that block ``standby`` (every standby when None)."""
        return [
            c
            for c in self.checks
            if c.status == "fail" and (standby is None or c.standby in (None, standby))
        ]

    def ready_for(self, standby: str) -> bool:
        return not self.failures(standby)

    @property
    def ready(self) -> bool:
        return bool(self.standbys) and not self.failures()

    def has(self, code: str) -> bool:
        return any(c.code == code and c.status != "ok" for c in self.checks)


def _ok(scope: str, code: str, detail: str, standby: str | None = None) -> Check:
    return Check(scope, code, "ok", detail, standby=standby)


def _bad(
    status: Status, scope: str, code: str, detail: str, remedy: str, standby: str | None = None
) -> Check:
    return Check(scope, code, status, detail, remedy, standby)


# -- which slots must survive a failover ------------------------------------------------------


def managed_subscriptions(facts: ClusterFacts, sub: SubscriberFacts) -> list[Subscription]:
    """The subscriptions on ``sub`` that follow the primary.

    Explicitly listed names win; otherwise a subscription belongs to us when its slot is a
    logical slot on the primary or, with the primary gone, a synced slot on a standby.
    """
    wanted = facts.managed_subscriptions.get(sub.name)
    if wanted is not None:
        return [s for s in sub.subscriptions if s.name in wanted]
    ours = {
        s.name
        for node in (facts.primary, *facts.standbys)
        for s in node.slots
        if s.slot_type == "logical"
    }
    return [s for s in sub.subscriptions if s.slot_name in ours]


def failover_slots(facts: ClusterFacts) -> list[str]:
    """Every slot that must exist, sync-ready, on each standby (sorted, no duplicates).

    From the primary: its failover-enabled logical slots. From the settings: the bridge's.
    From the subscribers (the 17 docs' query): failover subscriptions' slots and the
    table-sync slots of tables whose copy finished, which the sync worker still needs.
    """
    names = {
        s.name
        for s in facts.primary.slots
        if s.slot_type == "logical" and s.failover and not s.temporary
    }
    names.update(facts.bridge_slots)
    for sub in facts.subscribers:
        for subscription in managed_subscriptions(facts, sub):
            if subscription.failover and subscription.slot_name:
                names.add(subscription.slot_name)
                names.update(subscription.sync_slots)
    return sorted(names)


# -- the checks -------------------------------------------------------------------------------


def check_primary(p: Server) -> Iterator[Check]:
    scope = "primary"
    if not p.reachable:
        yield _bad(
            "fail",
            scope,
            "primary_reachable",
            f"primary does not answer: {p.error}",
            "start it or fix its DSN; if it is lost for good, promote a standby with "
            "`slotbridge failover promote --standby NAME --force`",
        )
        return
    if p.in_recovery:
        yield _bad(
            "fail",
            scope,
            "primary_role",
            "the configured primary is in recovery",
            "point `primary` in the settings at the current primary",
        )
        return
    yield _ok(scope, "primary_reachable", f"primary answers (timeline {p.timeline})")
    wal_level = p.settings.get("wal_level")
    if wal_level == "logical":
        yield _ok(scope, "wal_level", "wal_level = logical")
    else:
        yield _bad(
            "fail",
            scope,
            "wal_level",
            f"wal_level = {wal_level}",
            "ALTER SYSTEM SET wal_level = logical; restart the primary",
        )
    yield from _check_standby_slots(p)
    yield from _check_senders(p)


def _check_standby_slots(p: Server) -> Iterator[Check]:
    scope = "primary"
    names = p.setting_list("synchronized_standby_slots")
    if not names:
        yield _bad(
            "fail",
            scope,
            "synchronized_standby_slots",
            "synchronized_standby_slots is empty: subscribers may receive changes the "
            "standby has not, and be ahead of it after a failover",
            "ALTER SYSTEM SET synchronized_standby_slots = '<standby physical slot>'; "
            "SELECT pg_reload_conf()",
        )
        return
    for name in names:
        slot = p.slot(name)
        if slot is None or slot.slot_type != "physical":
            yield _bad(
                "fail",
                scope,
                "synchronized_standby_slots",
                f"synchronized_standby_slots names {name!r}, which is not a physical "
                "slot on the primary: logical replication waits for it forever",
                f"SELECT pg_create_physical_replication_slot('{name}') and point a "
                "standby's primary_slot_name at it, or remove it from the setting",
            )
        elif slot.invalidation_reason is not None:
            yield _bad(
                "fail",
                scope,
                "synchronized_standby_slots",
                f"standby slot {name!r} is invalidated ({slot.invalidation_reason})",
                "rebuild the standby and recreate its slot",
            )
        elif not slot.active:
            yield _bad(
                "fail",
                scope,
                "synchronized_standby_slots",
                f"standby slot {name!r} is not active: its standby is not streaming, "
                "so logical senders wait for it",
                "start or repair the standby that uses this slot",
            )
        else:
            yield _ok(
                scope,
                "synchronized_standby_slots",
                f"synchronized_standby_slots: {name!r} is an active physical slot",
            )


def _held_back(p: Server, sender: Sender) -> str | None:
    """Why ``sender`` is stalled behind synchronized_standby_slots; None if it is not.

    Under that setting a logical walsender waits for the standby on every commit, so being
    seen in that wait, even in every sample, proves nothing under write load. It is stalled
    when it waited all along and a standby slot is inactive (nothing will confirm), or
    when neither the standby slots nor its own slot moved meanwhile.
    """
    if not sender.always_waiting_for_standby:
        return None
    names = p.setting_list("synchronized_standby_slots")
    inactive = [n for n in names if (slot := p.slot(n)) is None or not slot.active]
    if inactive:
        return f"standby slot(s) {', '.join(inactive)} inactive"
    if all(p.slot_advanced(n) for n in names) or (
        sender.slot_name is not None and p.slot_advanced(sender.slot_name)
    ):
        return None
    return (
        f"neither standby slot(s) {', '.join(names)} nor slot {sender.slot_name} advanced "
        f"in {p.senders_window_s:.1f}s"
    )


def _check_senders(p: Server) -> Iterator[Check]:
    logical = [s for s in p.senders if s.slot_type == "logical"]
    stalled = [(s, why) for s in logical if (why := _held_back(p, s)) is not None]
    if stalled:
        who = "; ".join(
            f"{s.slot_name or s.application_name} (pid {s.pid}): {why}" for s, why in stalled
        )
        yield _bad(
            "fail",
            "primary",
            "logical_senders_blocked",
            f"logical walsender(s) stuck in wait event {WAIT_FOR_STANDBY} ({who}): no "
            "changes reach subscribers or bridges until the standby confirms WAL",
            "bring the standby named in synchronized_standby_slots back; only if it is "
            "lost for good, remove its slot from the setting (losing failover safety "
            "until a new standby is in place)",
        )
    else:
        yield _ok(
            "primary",
            "logical_senders_blocked",
            f"{len(logical)} logical walsender(s), none blocked on a standby",
        )


def check_standby(p: Server, s: Server, thresholds: Thresholds) -> tuple[list[Check], int | None]:
    """Settings, link and lag of one standby; returns its checks and replay lag in bytes."""
    scope, n = f"standby:{s.name}", s.name
    if not s.reachable:
        return [
            _bad(
                "fail",
                scope,
                "standby_reachable",
                f"standby does not answer: {s.error}",
                "start the standby or fix its DSN",
                n,
            )
        ], None
    if not s.in_recovery:
        return [
            _bad(
                "fail",
                scope,
                "standby_role",
                "not in recovery: it was promoted or is a separate primary",
                "if it was promoted, finish with `slotbridge failover promote --standby "
                f"{n}` and make it the primary in the settings; else rebuild it",
                n,
            )
        ], None
    out = [_ok(scope, "standby_reachable", "standby answers, in recovery", n)]
    if p.system_identifier is not None and p.system_identifier != s.system_identifier:
        out.append(
            _bad(
                "fail",
                scope,
                "system_identifier",
                f"system identifier {s.system_identifier} differs from the primary's "
                f"{p.system_identifier}: not a standby of this primary",
                "rebuild the standby from this primary",
                n,
            )
        )
    out += _standby_settings(p, s)
    lag = None
    if s.wal_receiver_status != "streaming":
        out.append(
            _bad(
                "fail",
                scope,
                "wal_receiver",
                f"WAL receiver is {s.wal_receiver_status or 'not running'}",
                "check primary_conninfo and the standby's log",
                n,
            )
        )
    if p.reachable and not p.in_recovery and p.wal_lsn is not None and s.wal_lsn is not None:
        lag = max(0, p.wal_lsn - s.wal_lsn)
        if lag > thresholds.max_replay_lag_bytes:
            out.append(
                _bad(
                    "warn",
                    scope,
                    "replay_lag",
                    f"replay lag {lag} bytes",
                    "promote waits for the standby to catch up; look for slow disks "
                    "or a saturated network",
                    n,
                )
            )
        else:
            out.append(_ok(scope, "replay_lag", f"replay lag {lag} bytes", n))
    return out, lag


def _standby_settings(p: Server, s: Server) -> Iterator[Check]:
    scope, n = f"standby:{s.name}", s.name
    for key, why in (
        ("sync_replication_slots", "failover slots are not copied to it"),
        (
            "hot_standby_feedback",
            "the primary may remove catalog rows the synced slots need, invalidating them",
        ),
    ):
        value = s.settings.get(key)
        if value == "on":
            yield _ok(scope, key, f"{key} = on", n)
        else:
            yield _bad(
                "fail",
                scope,
                key,
                f"{key} = {value}: {why}",
                f"on the standby: ALTER SYSTEM SET {key} = on; SELECT pg_reload_conf()",
                n,
            )
    slot_name = s.settings.get("primary_slot_name", "")
    if not slot_name:
        yield _bad(
            "fail",
            scope,
            "primary_slot_name",
            "primary_slot_name is not set",
            "create a physical slot on the primary and set primary_slot_name to it",
            n,
        )
    elif p.reachable:
        slot = p.slot(slot_name)
        if slot is None or slot.slot_type != "physical":
            yield _bad(
                "fail",
                scope,
                "primary_slot_name",
                f"primary_slot_name {slot_name!r} is not a physical slot on the primary",
                f"on the primary: SELECT pg_create_physical_replication_slot('{slot_name}')",
                n,
            )
        elif slot_name not in p.setting_list("synchronized_standby_slots"):
            yield _bad(
                "fail",
                scope,
                "primary_slot_name",
                f"slot {slot_name!r} is not in the primary's synchronized_standby_slots: "
                "subscribers can get ahead of this standby",
                f"on the primary: add '{slot_name}' to synchronized_standby_slots",
                n,
            )
        else:
            yield _ok(scope, "primary_slot_name", f"primary_slot_name = {slot_name}", n)
    if s.primary_conninfo_dbname:
        yield _ok(
            scope,
            "primary_conninfo_dbname",
            f"primary_conninfo has dbname={s.primary_conninfo_dbname}",
            n,
        )
    else:
        yield _bad(
            "fail",
            scope,
            "primary_conninfo_dbname",
            "primary_conninfo has no dbname: the slot sync worker cannot connect",
            "add dbname=<any database> to primary_conninfo on the standby; reload",
            n,
        )
    if s.setting_list("synchronized_standby_slots"):
        yield _bad(
            "warn",
            scope,
            "copied_settings",
            "synchronized_standby_slots is set on the standby (copied from the "
            "primary); once promoted it would stall logical replication",
            "nothing now: `slotbridge failover promote` resets it after promotion",
            n,
        )


def check_slots(
    p: Server, s: Server, names: Iterable[str], thresholds: Thresholds
) -> tuple[list[Check], list[SlotState]]:
    """Each failover slot on one standby: present, synced, not temporary, valid, near."""
    checks: list[Check] = []
    states: list[SlotState] = []
    if not s.reachable or not s.in_recovery:
        return checks, states
    for name in names:
        check, ready, lag = _judge_slot(
            f"slot:{name}@{s.name}",
            name,
            p.slot(name) if p.reachable else None,
            s.slot(name),
            thresholds,
            s.name,
        )
        checks.append(check)
        states.append(SlotState(s.name, name, ready, lag))
    return checks, states


def _judge_slot(
    scope: str,
    name: str,
    on_primary: Slot | None,
    synced: Slot | None,
    thresholds: Thresholds,
    standby: str,
) -> tuple[Check, bool, int | None]:
    if synced is None:
        return (
            _bad(
                "fail",
                scope,
                "slot_missing",
                f"slot {name!r} is not on the standby",
                "make it failover-enabled on the primary (subscription: failover = true;"
                " bridge: created with FAILOVER true); sync takes a few seconds after "
                "the consumer first confirms",
                standby,
            ),
            False,
            None,
        )
    if not synced.synced:
        return (
            _bad(
                "fail",
                scope,
                "slot_not_synced",
                f"slot {name!r} on the standby was created locally, not by slot sync",
                f"on the standby: SELECT pg_drop_replication_slot('{name}')",
                standby,
            ),
            False,
            None,
        )
    if synced.invalidation_reason is not None:
        return (
            _bad(
                "fail",
                scope,
                "slot_invalidated",
                f"slot {name!r} is invalidated on the standby "
                f"({synced.invalidation_reason}); it cannot be used after promotion",
                "find why (max_slot_wal_keep_size, catalog conflict): on the standby "
                f"drop it (pg_drop_replication_slot('{name}')) so it syncs again; if it "
                "is invalidated on the primary too, recreate it and resync the consumer",
                standby,
            ),
            False,
            None,
        )
    if synced.temporary:
        return (
            _bad(
                "fail",
                scope,
                "slot_temporary",
                f"slot {name!r} is still temporary on the standby (not sync-ready)",
                "on the primary: SELECT pg_log_standby_snapshot() (watch does this) and "
                "let the consumer confirm a newer position",
                standby,
            ),
            False,
            None,
        )
    lag = None
    if on_primary is not None and None not in (
        on_primary.confirmed_flush_lsn,
        synced.confirmed_flush_lsn,
    ):
        lag = max(0, (on_primary.confirmed_flush_lsn or 0) - (synced.confirmed_flush_lsn or 0))
    if lag is not None and lag > thresholds.max_slot_lag_bytes:
        return (
            _bad(
                "warn",
                scope,
                "slot_lag",
                f"slot {name!r} trails the primary's by {lag} bytes",
                "check the slot sync worker in the standby's log",
                standby,
            ),
            True,
            lag,
        )
    return (
        _ok(scope, "slot_ready", f"slot {name!r} is sync-ready, trails by {lag} bytes", standby),
        True,
        lag,
    )


def check_primary_slots(facts: ClusterFacts) -> Iterator[Check]:
    """The failover flag and validity of the slots on the primary itself."""
    p = facts.primary
    if not p.reachable or p.in_recovery:
        return
    for name in facts.bridge_slots:
        slot = p.slot(name)
        if slot is None:
            yield _bad(
                "fail",
                f"slot:{name}",
                "slot_missing",
                f"bridge slot {name!r} does not exist on the primary",
                "start the bridge (it creates the slot) or fix bridge_slots",
            )
        elif not slot.failover:
            yield _bad(
                "fail",
                f"slot:{name}",
                "slot_not_failover",
                f"bridge slot {name!r} is not failover-enabled",
                f"ALTER_REPLICATION_SLOT {name} (FAILOVER true) over a replication "
                "connection while the bridge is stopped",
            )
    for slot in p.slots:
        if slot.slot_type == "logical" and slot.invalidation_reason is not None:
            yield _bad(
                "fail",
                f"slot:{slot.name}",
                "slot_invalidated",
                f"slot {slot.name!r} is invalidated on the primary "
                f"({slot.invalidation_reason}): its consumer cannot continue",
                "recreate the slot and resynchronize its consumer",
            )


def check_subscriber(
    facts: ClusterFacts, sub: SubscriberFacts
) -> tuple[list[Check], list[SubscriptionState]]:
    scope = f"subscriber:{sub.name}"
    if not sub.reachable:
        return [
            _bad(
                "fail",
                scope,
                "subscriber_reachable",
                f"subscriber does not answer: {sub.error}",
                "start it or fix its DSN: promote cannot repoint it otherwise",
            )
        ], []
    checks: list[Check] = []
    states: list[SubscriptionState] = []
    mine = managed_subscriptions(facts, sub)
    wanted = facts.managed_subscriptions.get(sub.name)
    for missing in sorted(set(wanted or ()) - {s.name for s in mine}):
        checks.append(
            _bad(
                "fail",
                scope,
                "subscription_missing",
                f"subscription {missing!r} does not exist",
                "fix the subscriber's `subscriptions` list",
            )
        )
    for s in mine:
        where = f"{scope}/{s.name}"
        streaming = s.worker_pid is not None and s.received_lsn is not None
        states.append(SubscriptionState(sub.name, s.name, s.enabled, streaming))
        if not s.failover:
            checks.append(
                _bad(
                    "fail",
                    where,
                    "subscription_not_failover",
                    f"subscription {s.name!r} does not use a failover slot: it would be lost",
                    f"ALTER SUBSCRIPTION {s.name} DISABLE; ALTER SUBSCRIPTION {s.name} SET "
                    f"(failover = true); ALTER SUBSCRIPTION {s.name} ENABLE",
                )
            )
        elif not s.enabled:
            checks.append(
                _bad(
                    "warn",
                    where,
                    "subscription_enabled",
                    f"subscription {s.name!r} is disabled",
                    f"ALTER SUBSCRIPTION {s.name} ENABLE (unless on purpose)",
                )
            )
        elif not streaming:
            checks.append(
                _bad(
                    "warn",
                    where,
                    "subscription_streaming",
                    f"subscription {s.name!r} has no streaming apply worker",
                    "see the subscriber's log",
                )
            )
        else:
            checks.append(
                _ok(
                    where,
                    "subscription_streaming",
                    f"subscription {s.name!r} streams with a failover slot",
                )
            )
    return checks, states


def evaluate(facts: ClusterFacts, thresholds: Thresholds) -> Report:
    """All checks for one round of facts."""
    checks = list(check_primary(facts.primary))
    checks += check_primary_slots(facts)
    names = failover_slots(facts)
    lags: dict[str, int | None] = {}
    slot_states: list[SlotState] = []
    for s in facts.standbys:
        standby_checks, lags[s.name] = check_standby(facts.primary, s, thresholds)
        slot_checks, slot_found = check_slots(facts.primary, s, names, thresholds)
        checks += standby_checks + slot_checks
        slot_states += slot_found
    sub_states: list[SubscriptionState] = []
    for sub in facts.subscribers:
        sub_checks, sub_found = check_subscriber(facts, sub)
        checks += sub_checks
        sub_states += sub_found
    return Report(
        checks=tuple(checks),
        standbys=tuple(s.name for s in facts.standbys),
        replay_lag_bytes=lags,
        slots=tuple(slot_states),
        subscriptions=tuple(sub_states),
    )
