"""The failover runbook as one command: check, disable, fence, catch up, promote, clean,
repoint, enable, verify.

Every step first looks at the servers and only then acts, so the runbook is safe to run
again after an interruption at any point: a disabled subscription is not disabled twice, a
promoted standby is not promoted again, a subscription already pointing at the new primary
is left alone. ``dry_run`` runs the same detection and reports what each step would do.

Fencing (what an operator can trust): when the old primary still answers, it is made
read-only with ``ALTER SYSTEM SET default_transaction_read_only = on`` plus a reload (this
survives its restart), its client backends and logical walsenders are terminated, and - if
the settings give a ``fence_command`` - that command then stops it for good. The soft fence
stops well-behaved writers (and ``target_session_attrs=read-write`` clients move on), but a
session may still ``SET default_transaction_read_only = off``; only ``fence_command`` (stop
the server, cut its network) is a hard guarantee. Logical consumers of the old primary are
held back by its own ``synchronized_standby_slots``: once the standby is promoted, its slot
on the old primary stays inactive and the old primary's logical walsenders wait forever. A
crashed (or unreachable) old primary cannot be fenced now, and ``fence_command`` only runs
against one that answers: restarted, it comes back writable. The runbook warns; keeping it
down, or the watch daemon with ``auto_repoint`` (which fences a returning old primary), is
what prevents that.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import conninfo, sql

from services.common.errors import SlotbridgeError
from services.common.failpoints import failpoint
from services.common.logs import log_event, one_line
from services.common.lsn import format_lsn, parse_lsn
from services.common.pg import SourceError, connect
from services.failover.checks import Thresholds, evaluate, managed_subscriptions
from services.failover.facts import Server, Subscription
from services.failover.probe import Conn, open_node, probe_cluster, probe_server
from services.failover.settings import FailoverSettings, Node, Standby, Subscriber

log = logging.getLogger("slotbridge.failover.promote")

Result = Literal["done", "skipped", "plan", "warn", "failed"]
# What the fence step found: a primary that answers (fenced, or to be in a dry run), one
# that does not (down or cut off, so not fenced), or one already in recovery.
OldPrimary = Literal["answers", "down", "standby"]


class PromoteError(SlotbridgeError):
    """The runbook stopped; the message says where and what to do next."""

    retryable = False  # re-running the command finishes the job; nothing retries it


@dataclass
class Step:
    step: str
    result: Result
    seconds: float
    detail: str


@dataclass(frozen=True)
class Target:
    """A managed subscription and where it lives."""

    subscriber: str
    node: Subscriber
    sub: Subscription


@dataclass
class RunResult:
    standby: str
    dry_run: bool
    steps: list[Step] = field(default_factory=list)
    ok: bool = False
    seconds_to_streaming: float | None = None
    error: str | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "standby": self.standby,
            "dry_run": self.dry_run,
            "ok": self.ok,
            "seconds_total": round(sum(s.seconds for s in self.steps), 3),
            "seconds_to_streaming": (
                None if self.seconds_to_streaming is None else round(self.seconds_to_streaming, 3)
            ),
            "error": self.error,
        }


def poll(check: Callable[[], bool], timeout: float, interval: float = 0.2) -> bool:
    """Call ``check`` until it is true or ``timeout`` passes; connection errors count false."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return True
        except (SourceError, psycopg.Error):
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def same_server(a: dict[str, str], b: dict[str, str]) -> bool:
    """Do two conninfos name the same server (host or hostaddr, and port)?"""

    def where(p: dict[str, str]) -> tuple[str, str]:
        return (p.get("hostaddr") or p.get("host") or "", p.get("port") or "5432")

    return where(a) == where(b)


def repointed_conninfo(current: str, publisher: dict[str, str]) -> str:
    """``current`` with its address replaced by ``publisher``'s parameters.

    The address keys are dropped first: a stale ``hostaddr`` would otherwise win over the
    new ``host``. Everything else (user, dbname, sslmode, password) is kept.
    """
    params = {
        k: str(v)
        for k, v in conninfo.conninfo_to_dict(current).items()
        if k not in ("host", "hostaddr", "port")
    }
    params.update(publisher)
    return conninfo.make_conninfo(**params)


def _open_db(node: Node, database: str) -> Conn:
    """A connection to the subscription's own database (ALTER SUBSCRIPTION needs it)."""
    return connect(node.conninfo(), connect_timeout=5, dbname=database)


def fence_primary(node: Node) -> str | None:
    """Soft-fence a primary that still answers; returns its WAL position after, or None.

    Idempotent: setting the same value and terminating nobody is harmless. A node that does
    not answer, or answers in recovery, is not a primary to fence (None).
    """
    try:
        conn = open_node(node, timeout=3)
    except SourceError:
        return None
    with conn:
        if conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,):
            return None
        conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        conn.execute("SELECT pg_reload_conf()")
        conn.execute("""
            SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a
            WHERE a.pid <> pg_backend_pid()
              AND (a.backend_type = 'client backend'
                   OR a.pid IN (SELECT active_pid FROM pg_replication_slots
                                WHERE slot_type = 'logical' AND active_pid IS NOT NULL))""")
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        return str(row[0])


class Runbook:
    """One promotion of ``standby``; ``emit`` sees each step as it finishes."""

    def __init__(
        self,
        settings: FailoverSettings,
        standby: str,
        *,
        force: bool = False,
        dry_run: bool = False,
        emit: Callable[[Step], None] | None = None,
    ) -> None:
        if standby not in settings.standbys:
            raise PromoteError(
                f"no standby named {standby!r} in the settings "
                f"(have: {', '.join(settings.standbys)})"
            )
        self.settings = settings
        self.name = standby
        self.target: Standby = settings.standbys[standby]
        self.force = force
        self.dry_run = dry_run
        self.emit = emit
        self.result = RunResult(standby=standby, dry_run=dry_run)
        self.targets: list[Target] = []
        self.already_promoted = False
        self.old_primary: OldPrimary | None = None  # set by the fence step
        self.fence_lsn: str | None = None
        self._started = 0.0

    # -- driver ---------------------------------------------------------------------------

    def run(self) -> RunResult:
        self._started = time.monotonic()
        steps: list[tuple[str, Callable[[], tuple[Result, str]]]] = [
            ("check", self.check),
            ("disable", self.disable),
            ("fence", self.fence),
            ("catchup", self.catchup),
            ("stop_old_primary", self.stop_old_primary),
            ("promote", self.promote),
            ("clean_settings", self.clean_settings),
            ("repoint", self.repoint),
            ("enable", self.enable),
            ("verify", self.verify),
        ]
        for name, action in steps:
            began = time.monotonic()
            try:
                result, detail = action()
            except (
                PromoteError,
                SourceError,
                psycopg.Error,
                subprocess.SubprocessError,
                OSError,
            ) as exc:
                self._record(name, "failed", began, one_line(exc))
                self.result.error = f"step {name} failed: {exc}".strip()
                return self.result
            self._record(name, result, began, detail)
        self.result.ok = True
        if not self.dry_run:
            self.result.seconds_to_streaming = time.monotonic() - self._started
        return self.result

    def _record(self, name: str, result: Result, began: float, detail: str) -> None:
        step = Step(name, result, time.monotonic() - began, detail)
        self.result.steps.append(step)
        level = logging.WARNING if result in ("warn", "failed") else logging.INFO
        log_event(
            log,
            level,
            f"promote step {name}: {result}",
            step=name,
            result=result,
            seconds=round(step.seconds, 3),
            detail=detail,
            standby=self.name,
            dry_run=self.dry_run,
        )
        if self.emit is not None:
            self.emit(step)

    # -- steps ----------------------------------------------------------------------------

    def check(self) -> tuple[Result, str]:
        facts = probe_cluster(self.settings)
        report = evaluate(
            facts, Thresholds(self.settings.max_slot_lag_bytes, self.settings.max_replay_lag_bytes)
        )
        for sub in facts.subscribers:
            node = self.settings.subscribers[sub.name]
            self.targets += [Target(sub.name, node, s) for s in managed_subscriptions(facts, sub)]
        target = facts.standby(self.name)
        assert target is not None
        if not target.reachable:
            raise PromoteError(
                f"standby {self.name} does not answer ({target.error}): nothing to promote"
            )
        if not target.in_recovery:
            self.already_promoted = True
            return "done", (
                f"{self.name} is already out of recovery: resuming an earlier "
                f"run; {len(self.targets)} subscription(s) to move"
            )
        failures = report.failures(self.name)
        if not failures:
            return "done", f"{self.name} is ready; {len(self.targets)} subscription(s) to move"
        listed = "; ".join(f"{c.scope} {c.code}: {c.detail}" for c in failures)
        if not self.force:
            raise PromoteError(
                f"{self.name} is not ready ({listed}); fix that or pass --force to promote anyway"
            )
        return "warn", f"NOT ready, promoting because of --force: {listed}"

    def _publisher(self) -> dict[str, str]:
        return self.target.publisher_params()

    def _moved(self, t: Target) -> bool:
        return same_server(t.sub.publisher, self._publisher())

    def disable(self) -> tuple[Result, str]:
        todo = [t for t in self.targets if t.sub.enabled and not self._moved(t)]
        if not todo:
            return "skipped", "no enabled subscription points at the old primary"
        names = ", ".join(f"{t.subscriber}/{t.sub.name}" for t in todo)
        if self.dry_run:
            return "plan", f"would disable {names}"
        for t in todo:
            with _open_db(t.node, t.sub.database) as conn:
                conn.execute(
                    sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(sql.Identifier(t.sub.name))
                )
                # The apply worker leaves at its next look at the catalog; until then it may
                # still be applying from the old primary.
                if not poll(_workers_gone(conn, t.sub.oid), 30):
                    raise PromoteError(
                        f"{t.subscriber}/{t.sub.name}: workers still running "
                        "30 s after DISABLE; see the subscriber's log"
                    )
        failpoint("promote_after_disable")
        return "done", f"disabled {names}"

    def fence(self) -> tuple[Result, str]:
        old = probe_server("primary", self.settings.primary)
        if not old.reachable:
            self.old_primary = "down"
            return "skipped", f"old primary does not answer ({old.error}): not fenced"
        if old.in_recovery:
            self.old_primary = "standby"
            return "skipped", "old primary is in recovery (already a standby): nothing to fence"
        self.old_primary = "answers"
        if self.dry_run:
            return "plan", (
                "would set default_transaction_read_only=on on the old primary, "
                "reload, terminate its client backends and logical walsenders"
            )
        self.fence_lsn = fence_primary(self.settings.primary)
        if self.fence_lsn is None:
            self.old_primary = "down"
            return "skipped", "old primary stopped answering while being fenced"
        return "done", f"old primary read-only, clients cut off at {self.fence_lsn}"

    def catchup(self) -> tuple[Result, str]:
        if self.already_promoted:
            return "skipped", "standby already promoted"
        if self.dry_run:
            return "plan", f"would wait until {self.name} replays the fenced primary's WAL"
        if self.fence_lsn is None:
            return "skipped", "old primary not fenced (down): promoting with what is replayed"
        goal = parse_lsn(self.fence_lsn)

        def replayed() -> bool:
            return (probe_server(self.name, self.target).wal_lsn or 0) >= goal

        if poll(replayed, self.settings.catchup_timeout_s):
            return "done", f"{self.name} replayed up to {format_lsn(goal)}"
        if not self.force:
            raise PromoteError(
                f"{self.name} did not replay up to {format_lsn(goal)} within "
                f"{self.settings.catchup_timeout_s:.0f}s; promoting now would "
                "lose transactions. Re-run (the old primary stays fenced) or "
                "use --force"
            )
        return "warn", f"{self.name} behind {format_lsn(goal)}; promoting because of --force"

    def stop_old_primary(self) -> tuple[Result, str]:
        command = self.settings.fence_command
        if self.old_primary == "standby":
            return "skipped", "old primary is in recovery (a standby): nothing to stop"
        if self.old_primary == "down":
            # Nothing reached it, and a crashed primary restarts as a primary: the one way
            # left to fork the data, so the step warns.
            detail = (
                "old primary is down or unreachable, so it was not fenced"
                + (" and fence_command was not run" if command else "")
                + ": if restarted it comes back WRITABLE; keep it down, or run "
                "`slotbridge failover watch` with auto_repoint: true (it fences an old "
                "primary that comes back)"
            )
            if not command:
                detail += (
                    "; configure fence_command so the next promotion stops an old "
                    "primary that still answers"
                )
            return "warn", detail
        if not command:
            return "skipped", (
                "no fence_command configured: the old primary keeps running, "
                "soft-fenced (read-only by default, but a session can still "
                "turn that off); stop it, or configure fence_command"
            )
        if self.dry_run:
            return "plan", f"would run fence_command {command[0]} to stop the old primary"
        proc = subprocess.run(
            command,
            env={**os.environ, "SLOTBRIDGE_FENCE_NODE": "primary"},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            raise PromoteError(f"fence_command exited {proc.returncode}: {tail[0]}")
        return "done", f"fence_command {command[0]} stopped the old primary"

    def promote(self) -> tuple[Result, str]:
        if self.already_promoted:
            return "skipped", f"{self.name} already promoted"
        if self.dry_run:
            return "plan", f"would run pg_promote() on {self.name} and wait"
        timeout = int(self.settings.promote_timeout_s)
        with open_node(self.target) as conn:
            row = conn.execute("SELECT pg_promote(true, %s)", (timeout,)).fetchone()
        if row != (True,):
            raise PromoteError(
                f"{self.name} did not leave recovery within {timeout}s; see its log, then re-run"
            )
        after = probe_server(self.name, self.target)
        return "done", f"{self.name} is primary on timeline {after.timeline}"

    def clean_settings(self) -> tuple[Result, str]:
        node = probe_server(self.name, self.target)
        if node.reachable and node.in_recovery and self.dry_run:
            harmful = _harmful(node)
            return (
                "plan" if harmful else "skipped",
                f"after promotion would reset {', '.join(harmful)}"
                if harmful
                else "nothing copied that would stall it",
            )
        if not node.reachable or node.in_recovery:
            raise PromoteError(f"{self.name} is not a primary ({node.error or 'in recovery'})")
        harmful = _harmful(node)
        if not harmful:
            return "skipped", "nothing copied from the old primary that would stall it"
        with open_node(self.target) as conn:
            for key in harmful:
                conn.execute(sql.SQL("ALTER SYSTEM RESET {}").format(sql.Identifier(key)))
            conn.execute("SELECT pg_reload_conf()")
        if not poll(lambda: not _harmful(probe_server(self.name, self.target)), 10):
            raise PromoteError(
                f"{', '.join(harmful)} still set on {self.name} after ALTER "
                "SYSTEM RESET: it comes from postgresql.conf; remove it there "
                "and reload"
            )
        return "done", f"reset {', '.join(harmful)}"

    def repoint(self) -> tuple[Result, str]:
        todo = [t for t in self.targets if not self._moved(t)]
        if not todo:
            return "skipped", f"every subscription already points at {self.name}"
        names = ", ".join(f"{t.subscriber}/{t.sub.name}" for t in todo)
        if self.dry_run:
            return "plan", f"would ALTER SUBSCRIPTION ... CONNECTION to {self.name}: {names}"
        for t in todo:
            with _open_db(t.node, t.sub.database) as conn:
                row = conn.execute(
                    "SELECT subconninfo FROM pg_subscription WHERE oid = %s", (t.sub.oid,)
                ).fetchone()
                if row is None:
                    raise PromoteError(f"{t.subscriber}/{t.sub.name} disappeared")
                new = repointed_conninfo(str(row[0]), self._publisher())
                conn.execute(
                    sql.SQL("ALTER SUBSCRIPTION {} CONNECTION {}").format(
                        sql.Identifier(t.sub.name), sql.Literal(new)
                    )
                )
        return "done", f"{names} now connect to {self.name}"

    def enable(self) -> tuple[Result, str]:
        todo = [t for t in self.targets if not (t.sub.enabled and self._moved(t))]
        if not todo:
            return "skipped", "every subscription is enabled"
        names = ", ".join(f"{t.subscriber}/{t.sub.name}" for t in todo)
        if self.dry_run:
            return "plan", f"would enable {names}"
        for t in todo:
            with _open_db(t.node, t.sub.database) as conn:
                conn.execute(
                    sql.SQL("ALTER SUBSCRIPTION {} ENABLE").format(sql.Identifier(t.sub.name))
                )
        return "done", f"enabled {names}"

    def verify(self) -> tuple[Result, str]:
        if not self.targets:
            return "skipped", "no subscriptions to verify"
        if self.dry_run:
            return "plan", "would wait until every apply worker streams from the new primary"
        slots = {t.sub.slot_name for t in self.targets if t.sub.slot_name}
        with open_node(self.target) as conn:
            present = {
                r[0]
                for r in conn.execute(
                    "SELECT slot_name FROM pg_replication_slots WHERE slot_name = ANY(%s)",
                    (list(slots),),
                ).fetchall()
            }
            missing = slots - present
            if missing:
                raise PromoteError(
                    f"slot(s) {', '.join(sorted(missing))} do not exist on "
                    f"{self.name}: they were not synced; those subscriptions "
                    "need a new slot and a fresh copy"
                )

            def streaming() -> bool:
                rows = conn.execute(
                    "SELECT count(*) FROM pg_replication_slots s JOIN pg_stat_replication r "
                    "ON r.pid = s.active_pid WHERE s.slot_name = ANY(%s) "
                    "AND r.state = 'streaming'",
                    (list(slots),),
                ).fetchone()
                return rows == (len(slots),)

            if not poll(streaming, self.settings.stream_timeout_s):
                raise PromoteError(
                    f"not every subscription streams from {self.name} after "
                    f"{self.settings.stream_timeout_s:.0f}s; see the "
                    "subscribers' logs, then re-run"
                )
        return "done", f"{len(slots)} subscription slot(s) streaming from {self.name}"


def _workers_gone(conn: Conn, oid: int) -> Callable[[], bool]:
    def gone() -> bool:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_subscription WHERE subid = %s AND pid IS NOT NULL", (oid,)
        ).fetchone() == (0,)

    return gone


def _harmful(node: Server) -> list[str]:
    """Copied settings that would stall ``node`` as a primary.

    ``synchronized_standby_slots`` is harmful when it names a slot that does not exist
    there (logical senders would wait forever); a leftover read-only default from a fenced
    primary's auto.conf would refuse every write.
    """
    out = []
    physical = {s.name for s in node.slots if s.slot_type == "physical"}
    if any(n not in physical for n in node.setting_list("synchronized_standby_slots")):
        out.append("synchronized_standby_slots")
    if node.settings.get("default_transaction_read_only") == "on":
        out.append("default_transaction_read_only")
    return out
