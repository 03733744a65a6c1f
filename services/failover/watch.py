"""The watch daemon: checks on a timer, metrics and health, safe remedies, promotions.

Each round probes every node, judges the facts with ``checks.evaluate``, replaces the
Prometheus series (so a dropped slot's series disappear instead of freezing), and then:

* remedies what is safe - ``pg_log_standby_snapshot()`` on the primary while a failover
  slot is missing or still temporary on a standby (PostgreSQL 18 keeps a fresh synced slot
  temporary until a newer standby snapshot arrives);
* notices a promotion - a standby that left recovery, or a timeline change - and, with
  ``auto_repoint``, finishes the failover with the promote runbook (which detects that the
  promotion already happened and only fences, cleans, repoints and verifies);
* re-fences an old primary that comes back writable after a promotion it saw (a crashed
  primary restarted by its supervisor).

``/healthz`` is the loop being alive; ``/readyz`` is "every standby is a safe failover
target", so an alert or a pre-maintenance gate can key on it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge

from services.common.httpserver import HealthServer
from services.common.logs import log_event, one_line
from services.common.pg import SourceError
from services.failover.checks import Report, Thresholds, evaluate
from services.failover.facts import ClusterFacts, Server
from services.failover.probe import open_node, probe_cluster, probe_server
from services.failover.promote import Runbook, fence_primary
from services.failover.settings import FailoverSettings, Node

log = logging.getLogger("slotbridge.failover.watch")

# Checks whose cause a fresh standby snapshot on the primary can cure.
_SNAPSHOT_CURES = ("slot_temporary", "slot_missing")


class Metrics:
    """Every series the daemon exports, in its own registry (tests build several)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        p = "slotbridge_failover_"
        self.ready = Gauge(
            p + "ready",
            "1 when the standby is a safe failover target",
            ["standby"],
            registry=registry,
        )
        self.slot_ready = Gauge(
            p + "slot_ready",
            "1 when the slot is synced, permanent, valid",
            ["standby", "slot"],
            registry=registry,
        )
        self.slot_lag = Gauge(
            p + "slot_lag_bytes",
            "how far the synced slot trails the primary's confirmed_flush_lsn",
            ["standby", "slot"],
            registry=registry,
        )
        self.replay_lag = Gauge(
            p + "replay_lag_bytes",
            "primary WAL position minus the standby's replay position",
            ["standby"],
            registry=registry,
        )
        self.sub_enabled = Gauge(
            p + "subscription_enabled",
            "1 when the subscription is enabled",
            ["subscriber", "subscription"],
            registry=registry,
        )
        self.sub_streaming = Gauge(
            p + "subscription_streaming",
            "1 when its apply worker streams",
            ["subscriber", "subscription"],
            registry=registry,
        )
        self.failed = Gauge(
            p + "checks_failed", "failed checks by code", ["check"], registry=registry
        )
        self.senders_blocked = Gauge(
            p + "logical_senders_blocked",
            "1 when logical walsenders wait on a standby",
            registry=registry,
        )
        self.last_round = Gauge(
            p + "last_round_timestamp_seconds", "end of the last round", registry=registry
        )
        self.remedies = Counter(p + "remedies", "remedies applied", ["action"], registry=registry)
        self.promotions = Counter(
            p + "promotions_detected", "promotions seen", ["standby"], registry=registry
        )

    def export(self, report: Report) -> None:
        for gauge in (
            self.ready,
            self.slot_ready,
            self.slot_lag,
            self.replay_lag,
            self.sub_enabled,
            self.sub_streaming,
            self.failed,
        ):
            gauge.clear()
        for name in report.standbys:
            self.ready.labels(name).set(report.ready_for(name))
            lag = report.replay_lag_bytes.get(name)
            if lag is not None:
                self.replay_lag.labels(name).set(lag)
        for slot in report.slots:
            self.slot_ready.labels(slot.standby, slot.slot).set(slot.ready)
            if slot.lag_bytes is not None:
                self.slot_lag.labels(slot.standby, slot.slot).set(slot.lag_bytes)
        for sub in report.subscriptions:
            self.sub_enabled.labels(sub.subscriber, sub.subscription).set(sub.enabled)
            self.sub_streaming.labels(sub.subscriber, sub.subscription).set(sub.streaming)
        codes = {c.code for c in report.checks}
        for code in codes:
            self.failed.labels(code).set(
                sum(1 for c in report.checks if c.code == code and c.status == "fail")
            )
        self.senders_blocked.set(report.has("logical_senders_blocked"))
        self.last_round.set(time.time())


class Watcher:
    """The daemon's state between rounds: current topology view, timelines, old primaries."""

    def __init__(
        self, settings: FailoverSettings, registry: CollectorRegistry | None = None
    ) -> None:
        self.settings = settings
        self.registry = registry or CollectorRegistry()
        self.metrics = Metrics(self.registry)
        self.stopping = threading.Event()
        self.report: Report | None = None
        self.last_round_at: float | None = None
        self.timelines: dict[str, int] = {}
        self.old_primaries: list[Node] = []
        self.promotions_seen: set[str] = set()

    # -- one round ------------------------------------------------------------------------

    def round(self) -> Report:
        facts = probe_cluster(self.settings)
        report = evaluate(
            facts, Thresholds(self.settings.max_slot_lag_bytes, self.settings.max_replay_lag_bytes)
        )
        self.metrics.export(report)
        for check in report.checks:
            if check.status != "ok":
                log_event(
                    log,
                    logging.WARNING if check.status == "warn" else logging.ERROR,
                    f"{check.scope} {check.code}: {check.detail}",
                    scope=check.scope,
                    check=check.code,
                    status=check.status,
                    remedy=check.remedy,
                )
        if self.settings.remedy:
            self.remedy(facts, report)
        self.refence_old_primaries()
        self.follow_promotion(facts)
        self.report, self.last_round_at = report, time.monotonic()
        return report

    def remedy(self, facts: ClusterFacts, report: Report) -> None:
        p = facts.primary
        if not (p.reachable and not p.in_recovery and any(report.has(c) for c in _SNAPSHOT_CURES)):
            return
        try:
            with open_node(self.settings.primary) as conn:
                conn.execute("SELECT pg_log_standby_snapshot()")
        except (SourceError, psycopg.Error) as exc:
            log_event(
                log, logging.WARNING, "remedy pg_log_standby_snapshot failed", error=one_line(exc)
            )
            return
        self.metrics.remedies.labels("pg_log_standby_snapshot").inc()
        log_event(
            log,
            logging.INFO,
            "remedy: logged a standby snapshot on the primary so "
            "pending synced slots can become sync-ready",
            action="pg_log_standby_snapshot",
        )

    def refence_old_primaries(self) -> None:
        for node in self.old_primaries:
            seen = probe_server("old_primary", node)
            if (
                seen.reachable
                and not seen.in_recovery
                and seen.settings.get("default_transaction_read_only") != "on"
            ):
                fence_primary(node)
                self.metrics.remedies.labels("fence_old_primary").inc()
                log_event(
                    log,
                    logging.WARNING,
                    "an old primary came back writable; fenced it (read-only, clients terminated)",
                    action="fence_old_primary",
                )

    def follow_promotion(self, facts: ClusterFacts) -> None:
        for standby in facts.standbys:
            self._timeline_change(standby)
            if standby.reachable and not standby.in_recovery:
                self._promoted(standby.name)
                return
        self._timeline_change(facts.primary)

    def _timeline_change(self, node: Server) -> None:
        if node.timeline is None:
            return
        before = self.timelines.get(node.name)
        self.timelines[node.name] = node.timeline
        if before is not None and before != node.timeline:
            log_event(
                log,
                logging.WARNING,
                f"{node.name} moved from timeline {before} to "
                f"{node.timeline}: a promotion happened",
                node=node.name,
                timeline=node.timeline,
                previous_timeline=before,
            )

    def _promoted(self, name: str) -> None:
        if name not in self.promotions_seen:
            self.promotions_seen.add(name)
            self.metrics.promotions.labels(name).inc()
        if not self.settings.auto_repoint:
            log_event(
                log,
                logging.ERROR,
                f"standby {name} left recovery; finish the failover "
                f"with `slotbridge failover promote --standby {name}`",
                standby=name,
            )
            return
        log_event(
            log,
            logging.WARNING,
            f"standby {name} left recovery; repointing the subscribers to it (auto_repoint)",
            standby=name,
        )
        result = Runbook(self.settings, name, force=True).run()
        if not result.ok:
            log_event(
                log,
                logging.ERROR,
                "automatic repoint failed; retrying next round",
                standby=name,
                error=result.error,
            )
            return
        self.old_primaries.append(self.settings.primary)
        self.settings = self.settings.promoted(name)
        log_event(
            log,
            logging.WARNING,
            f"{name} is the primary now; update the settings "
            "file to match (this daemon keeps the new view until restarted)",
            standby=name,
            seconds=result.summary()["seconds_total"],
        )

    # -- the daemon -----------------------------------------------------------------------

    def live(self) -> tuple[bool, str]:
        if self.last_round_at is None:
            return True, "starting"
        age = time.monotonic() - self.last_round_at
        limit = 3 * self.settings.check_interval_s + 60
        return age < limit, f"last round {age:.0f}s ago"

    def ready(self) -> tuple[bool, str]:
        if self.report is None:
            return False, "no round finished yet"
        failures = self.report.failures()
        if self.report.ready:
            return True, "every standby is ready for failover"
        return False, "; ".join(f"{c.scope} {c.code}" for c in failures) or "no standby"

    def run(self) -> None:
        """Rounds until SIGTERM/SIGINT; a failing round is logged, never fatal."""

        def stop(signum: int, frame: FrameType | None) -> None:
            log_event(log, logging.INFO, "stopping", signal=signal.Signals(signum).name)
            self.stopping.set()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        server = None
        if self.settings.http_port:
            server = HealthServer(
                self.settings.http_host,
                self.settings.http_port,
                self.live,
                self.ready,
                self.registry,
            ).start()
            log_event(log, logging.INFO, "serving /healthz /readyz /metrics", port=server.port)
        try:
            while not self.stopping.is_set():
                try:
                    report = self.round()
                    log_event(
                        log,
                        logging.INFO,
                        "round done",
                        ready=report.ready,
                        failed=len(report.failures()),
                    )
                except Exception as exc:  # a bug in one round must not kill the daemon
                    log.exception("round failed: %s", exc)
                self.stopping.wait(self.settings.check_interval_s)
        finally:
            if server is not None:
                server.stop()
            log_event(log, logging.INFO, "stopped")
