"""The readiness judgement, on hand-made facts: no server involved."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.failover.checks import Report, Thresholds, evaluate, failover_slots
from services.failover.facts import (
    WAIT_FOR_STANDBY,
    ClusterFacts,
    Sender,
    Server,
    Slot,
    SubscriberFacts,
    Subscription,
)
from services.failover.promote import Runbook, _harmful, repointed_conninfo, same_server
from services.failover.report import render_report, report_dict
from services.failover.settings import FailoverSettings, Node, Standby

LIMITS = Thresholds(max_slot_lag_bytes=1000, max_replay_lag_bytes=1000)
SYSID = 7_400_000_000_000_000_001


def slot(name: str, **kw: object) -> Slot:
    base = dict(
        name=name,
        slot_type="logical",
        active=True,
        temporary=False,
        failover=True,
        synced=False,
        invalidation_reason=None,
        confirmed_flush_lsn=5000,
        restart_lsn=4000,
    )
    base.update(kw)
    return Slot(**base)  # type: ignore[arg-type]


PRIMARY = Server(
    name="primary",
    reachable=True,
    system_identifier=SYSID,
    timeline=1,
    wal_lsn=10_000,
    settings={"wal_level": "logical", "synchronized_standby_slots": "standby1"},
    slots=(
        slot(
            "standby1",
            slot_type="physical",
            failover=False,
            confirmed_flush_lsn=None,
            restart_lsn=9_900,
        ),
        slot("app_sub"),
        slot("bridge"),
    ),
    senders=(Sender(1, "app_sub", "app_sub", "logical", (None, None, None)),),
)
STANDBY = Server(
    name="s1",
    reachable=True,
    in_recovery=True,
    system_identifier=SYSID,
    timeline=1,
    wal_lsn=9_900,
    wal_receiver_status="streaming",
    settings={
        "sync_replication_slots": "on",
        "hot_standby_feedback": "on",
        "primary_slot_name": "standby1",
    },
    primary_conninfo_dbname="postgres",
    slots=(
        slot("app_sub", synced=True, active=False, confirmed_flush_lsn=4900),
        slot("bridge", synced=True, active=False, confirmed_flush_lsn=5000),
        slot("pg_16400_sync_16390_7400", synced=True, active=False),
    ),
)
SUB = Subscription(
    oid=16400,
    name="app_sub",
    database="app",
    enabled=True,
    failover=True,
    slot_name="app_sub",
    publisher={"host": "old", "port": "5432"},
    worker_pid=77,
    received_lsn=5000,
    sync_slots=("pg_16400_sync_16390_7400",),
)
GOOD = ClusterFacts(
    primary=PRIMARY,
    standbys=(STANDBY,),
    subscribers=(SubscriberFacts("sub", True, subscriptions=(SUB,)),),
    bridge_slots=("bridge",),
    managed_subscriptions={"sub": None},
)


def judge(facts: ClusterFacts) -> Report:
    return evaluate(facts, LIMITS)


def failed(report: Report) -> set[str]:
    return {c.code for c in report.failures()}


def with_standby(**kw: object) -> ClusterFacts:
    return replace(GOOD, standbys=(replace(STANDBY, **kw),))  # type: ignore[arg-type]


def with_primary(**kw: object) -> ClusterFacts:
    return replace(GOOD, primary=replace(PRIMARY, **kw))  # type: ignore[arg-type]


def standby_slot(name: str, **kw: object) -> ClusterFacts:
    slots = tuple(
        replace(s, **kw) if s.name == name else s  # type: ignore[arg-type]
        for s in STANDBY.slots
    )
    return with_standby(slots=slots)


def test_good_setup_is_ready() -> None:
    report = judge(GOOD)
    assert report.ready, render_report(report)
    assert report.ready_for("s1")
    assert report.replay_lag_bytes == {"s1": 100}
    lags = {s.slot: s.lag_bytes for s in report.slots}
    assert lags == {"app_sub": 100, "bridge": 0, "pg_16400_sync_16390_7400": None}


def test_failover_slots_come_from_primary_settings_and_subscribers() -> None:
    facts = replace(GOOD, bridge_slots=("bridge", "bridge2"))
    assert failover_slots(facts) == ["app_sub", "bridge", "bridge2", "pg_16400_sync_16390_7400"]


@pytest.mark.parametrize(
    ("facts", "code"),
    [
        (
            with_standby(settings={**STANDBY.settings, "sync_replication_slots": "off"}),
            "sync_replication_slots",
        ),
        (
            with_standby(settings={**STANDBY.settings, "hot_standby_feedback": "off"}),
            "hot_standby_feedback",
        ),
        (with_standby(settings={**STANDBY.settings, "primary_slot_name": ""}), "primary_slot_name"),
        (
            with_standby(settings={**STANDBY.settings, "primary_slot_name": "other"}),
            "primary_slot_name",
        ),
        (with_standby(primary_conninfo_dbname=None), "primary_conninfo_dbname"),
        (with_standby(wal_receiver_status=None), "wal_receiver"),
        (with_standby(system_identifier=1), "system_identifier"),
        (with_standby(reachable=False, error="connection refused"), "standby_reachable"),
        (with_standby(in_recovery=False), "standby_role"),
        (
            with_primary(
                settings={"wal_level": "replica", "synchronized_standby_slots": "standby1"}
            ),
            "wal_level",
        ),
        (with_primary(settings={"wal_level": "logical"}), "synchronized_standby_slots"),
        (with_primary(reachable=False, error="refused"), "primary_reachable"),
        (with_primary(in_recovery=True), "primary_role"),
        (standby_slot("app_sub", temporary=True), "slot_temporary"),
        (standby_slot("app_sub", invalidation_reason="wal_removed"), "slot_invalidated"),
        (standby_slot("app_sub", synced=False), "slot_not_synced"),
        (with_standby(slots=STANDBY.slots[1:]), "slot_missing"),
    ],
)
def test_each_broken_setup_is_pinpointed(facts: ClusterFacts, code: str) -> None:
    report = judge(facts)
    assert not report.ready
    assert code in failed(report), render_report(report)
    assert all(c.remedy for c in report.checks if c.status != "ok")


def test_subscription_without_failover_is_refused() -> None:
    sub = replace(SUB, failover=False)
    primary = replace(
        PRIMARY,
        slots=tuple(
            replace(s, failover=False) if s.name == "app_sub" else s for s in PRIMARY.slots
        ),
    )
    facts = replace(
        GOOD, primary=primary, subscribers=(SubscriberFacts("sub", True, subscriptions=(sub,)),)
    )
    assert "subscription_not_failover" in failed(judge(facts))


def test_bridge_slot_without_failover_is_refused() -> None:
    primary = replace(
        PRIMARY,
        slots=tuple(replace(s, failover=False) if s.name == "bridge" else s for s in PRIMARY.slots),
    )
    assert "slot_not_failover" in failed(judge(replace(GOOD, primary=primary)))


def test_standby_down_stalls_logical_senders() -> None:
    """Standby down: its slot is inactive and the logical senders wait on it."""
    primary = replace(
        PRIMARY,
        slots=tuple(replace(s, active=False) if s.name == "standby1" else s for s in PRIMARY.slots),
        senders=(Sender(1, "app_sub", "app_sub", "logical", (WAIT_FOR_STANDBY,) * 3),),
    )
    facts = replace(
        GOOD, primary=primary, standbys=(replace(STANDBY, reachable=False, error="refused"),)
    )
    codes = failed(judge(facts))
    assert {"standby_reachable", "synchronized_standby_slots", "logical_senders_blocked"} <= codes


def test_momentary_wait_is_not_a_stall() -> None:
    sender = Sender(1, "app_sub", "app_sub", "logical", (WAIT_FOR_STANDBY, None, WAIT_FOR_STANDBY))
    assert judge(with_primary(senders=(sender,))).ready


WAITING = Sender(1, "app_sub", "app_sub", "logical", (WAIT_FOR_STANDBY,) * 10)


def sampled(**moved: int) -> ClusterFacts:
    """A sender that waited on the standby in all ten samples of a 2.5 s window, while
    the named slots of the primary moved by the given number of bytes."""

    def advanced(s: Slot) -> Slot:
        by = moved.get(s.name, 0)
        if s.slot_type == "physical":
            return replace(s, restart_lsn=(s.restart_lsn or 0) + by)
        return replace(s, confirmed_flush_lsn=(s.confirmed_flush_lsn or 0) + by)

    return with_primary(
        senders=(WAITING,), slots_after=tuple(map(advanced, PRIMARY.slots)), senders_window_s=2.5
    )


def test_waiting_all_along_while_the_standby_confirms_is_not_a_stall() -> None:
    """Write load: each commit waits for the standby, which keeps confirming."""
    assert judge(sampled(standby1=4096)).ready


def test_waiting_all_along_while_its_own_slot_moves_is_not_a_stall() -> None:
    assert judge(sampled(app_sub=512)).ready


def test_waiting_all_along_with_nothing_moving_is_a_stall() -> None:
    """A standby that is connected but confirms nothing (hung, or its disk is full)."""
    report = judge(sampled(bridge=512))  # another consumer's progress does not count
    assert "logical_senders_blocked" in failed(report)
    blocked = next(c for c in report.checks if c.code == "logical_senders_blocked")
    assert "neither standby slot(s) standby1 nor slot app_sub advanced in 2.5s" in blocked.detail


def test_lag_warns_but_does_not_block() -> None:
    report = judge(with_standby(wal_lsn=1))
    assert report.ready
    assert report.has("replay_lag")
    report = judge(standby_slot("app_sub", confirmed_flush_lsn=1))
    assert report.ready and report.has("slot_lag")


def test_disabled_subscription_warns_and_is_exported() -> None:
    sub = replace(SUB, enabled=False, worker_pid=None, received_lsn=None)
    report = judge(replace(GOOD, subscribers=(SubscriberFacts("sub", True, subscriptions=(sub,)),)))
    assert report.ready and report.has("subscription_enabled")
    assert [(s.enabled, s.streaming) for s in report.subscriptions] == [(False, False)]


def test_explicit_subscription_list_reports_missing_ones() -> None:
    facts = replace(GOOD, managed_subscriptions={"sub": ("app_sub", "gone")})
    assert "subscription_missing" in failed(judge(facts))


def test_subscriptions_of_other_publishers_are_ignored() -> None:
    other = replace(SUB, name="elsewhere", slot_name="not_ours", failover=False)
    facts = replace(GOOD, subscribers=(SubscriberFacts("sub", True, subscriptions=(SUB, other)),))
    assert judge(facts).ready


def test_readiness_is_per_standby() -> None:
    down = replace(STANDBY, name="s2", reachable=False, error="refused")
    report = judge(replace(GOOD, standbys=(STANDBY, down)))
    assert report.ready_for("s1") and not report.ready_for("s2") and not report.ready
    assert report_dict(report, "s1")["ready"] is True
    assert report_dict(report)["ready"] is False


def test_report_table_names_what_to_do() -> None:
    text = render_report(
        judge(with_standby(settings={**STANDBY.settings, "hot_standby_feedback": "off"}))
    )
    assert "FAIL" in text and "ALTER SYSTEM SET hot_standby_feedback = on" in text
    assert text.rstrip().endswith("NOT READY for failover (s1: NOT ready)")


def test_copied_synchronized_standby_slots_is_harmful_only_without_the_slot() -> None:
    promoted = replace(
        STANDBY, in_recovery=False, settings={"synchronized_standby_slots": "standby1"}, slots=()
    )
    assert _harmful(promoted) == ["synchronized_standby_slots"]
    kept = replace(promoted, slots=(slot("standby1", slot_type="physical"),))
    assert _harmful(kept) == []


def test_repointed_conninfo_keeps_credentials_and_drops_old_address() -> None:
    new = repointed_conninfo(
        "host=old hostaddr=10.0.0.1 port=5432 dbname=app user=rep password=s3cret sslmode=require",
        {"host": "new", "port": "6432"},
    )
    assert "hostaddr" not in new and "host=new" in new and "port=6432" in new
    assert "password=s3cret" in new and "dbname=app" in new and "sslmode=require" in new
    assert same_server({"host": "new", "port": "6432"}, {"host": "new", "port": "6432"})
    assert not same_server({"host": "old"}, {"host": "new"})


@pytest.mark.parametrize("fence_command", [None, ["stop-old-primary"]])
def test_a_down_old_primary_is_reported_unfenced_and_coming_back_writable(
    fence_command: list[str] | None,
) -> None:
    settings = FailoverSettings(
        primary=Node(dsn="host=old"),
        standbys={"s1": Standby(dsn="host=new")},
        fence_command=fence_command,
    )
    runbook = Runbook(settings, "s1")
    runbook.old_primary = "down"  # what the fence step found
    result, detail = runbook.stop_old_primary()
    assert result == "warn"
    assert detail.startswith("old primary is down or unreachable, so it was not fenced")
    assert "if restarted it comes back WRITABLE; keep it down" in detail
    assert "slotbridge failover watch` with auto_repoint: true" in detail
    assert ("fence_command was not run" in detail) == bool(fence_command)
    assert ("configure fence_command" in detail) == (not fence_command)
