"""The local stack as one object: primary, hot standby, subscriber, Kafka, and a state file.

``<state_dir>/stack.json`` records the PostgreSQL major version, the ports chosen at the
first ``up`` and the Kafka cluster id, so every later ``up`` (and every test process)
finds the parts at the same addresses. ``down`` stops processes and keeps the data, so
the next ``up`` is a warm start; ``down(purge=True)`` removes what ``up`` built.

Nodes are named, not typed by role: after a drill promotes ``standby`` it is still the
node called ``standby`` and still starts and stops through ``pg_ctl``.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg

from slotbridge_dev import bootstrap
from slotbridge_dev.stack.cluster import (
    Node,
    RunAs,
    StackError,
    free_ports,
    kill_all,
    pg_os_user,
    pid_alive,
    say,
    wait_until,
)
from slotbridge_dev.stack.kafka import Kafka, has_broker, new_cluster_id
from slotbridge_dev.stack.standby import (
    clone_standby,
    standby_status,
    wait_for_standby_slot,
    wait_streaming,
)
from slotbridge_dev.stack.upgrade import old_bin_dir, pg_upgrade, replace_data_dir

__all__ = ["NODE_NAMES", "Stack", "StackError"]

NODE_NAMES = ("primary", "standby", "subscriber")
STATE_FILE = "stack.json"
SUPPORTED = ("17", "18")

# Same on every node: a standby refuses to start with smaller max_* values than its
# primary, and the subscriber is wal_level=logical so it can be a source in tests too.
COMMON_SETTINGS: dict[str, object] = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
    "wal_level": "logical",
    "max_replication_slots": 20,
    "max_wal_senders": 20,
    "max_prepared_transactions": 20,
    "max_worker_processes": 16,
    "max_logical_replication_workers": 8,
    "wal_sender_timeout": "60s",
    "hot_standby": True,
    "log_line_prefix": "%m [%p] %q[%a] ",
}


class Stack:
    """The embedded stack rooted at ``state_dir``; ``pg_major`` only matters to ``up``."""

    def __init__(self, state_dir: Path, pg_major: str = "17") -> None:
        if pg_major not in SUPPORTED:
            raise StackError(
                f"PostgreSQL {pg_major} is not supported; use one of {', '.join(SUPPORTED)}"
            )
        self.state_dir = Path(state_dir).absolute()
        self.requested_major = pg_major
        self.state_path = self.state_dir / STATE_FILE
        self._state: dict[str, Any] | None = self._load_state()
        self._nodes: dict[str, Node] = {}
        self._kafka: Kafka | None = None
        self._run_as: RunAs | None = None

    # -- state ----------------------------------------------------------------------------

    def _load_state(self) -> dict[str, Any] | None:
        try:
            data = json.loads(self.state_path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise StackError(
                f"state file {self.state_path} is unreadable ({exc}); "
                "run `slotbridge stack down --purge` and up again"
            ) from None
        if not isinstance(data, dict):
            raise StackError(f"state file {self.state_path} is not a JSON object")
        return data

    def _new_state(self) -> dict[str, Any]:
        names = [*NODE_NAMES, "kafka", "kafka_controller"]
        state = {
            "pg_major": self.requested_major,
            "ports": dict(zip(names, free_ports(len(names)), strict=True)),
            "kafka_cluster_id": new_cluster_id(),
        }
        self._state = state
        self._save_state()
        return state

    def _save_state(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2) + "\n")
        tmp.replace(self.state_path)

    @property
    def state(self) -> dict[str, Any]:
        if self._state is None:
            raise StackError(
                f"no stack in {self.state_dir}; run `slotbridge stack up --dir {self.state_dir}`"
            )
        return self._state

    @property
    def pg_major(self) -> str:
        """The recorded version once built, else the one ``up`` will build."""
        return str(self._state["pg_major"]) if self._state else self.requested_major

    def _cache(self) -> Path:
        return bootstrap.cache_dir()

    def _pg_bin(self) -> Path:
        return bootstrap.pg_bin(self._cache(), self.pg_major)

    def _kafka_jars(self) -> Path:
        return bootstrap.jars_dir(self._cache(), bootstrap.KAFKA_SET)

    def _user(self) -> RunAs | None:
        if self._run_as is None:
            self._run_as = pg_os_user()
        return self._run_as

    # -- parts ----------------------------------------------------------------------------

    def node(self, name: str) -> Node:
        if name not in NODE_NAMES:
            raise StackError(f"unknown node {name!r}; nodes are {', '.join(NODE_NAMES)}")
        if name not in self._nodes:
            self._nodes[name] = Node(
                name, self.state_dir, int(self.state["ports"][name]), self._pg_bin(), self._user()
            )
        return self._nodes[name]

    @property
    def kafka(self) -> Kafka:
        if self._kafka is None:
            ports = self.state["ports"]
            self._kafka = Kafka(
                self.state_dir,
                int(ports["kafka"]),
                int(ports["kafka_controller"]),
                self._kafka_jars(),
                str(self.state["kafka_cluster_id"]),
            )
        return self._kafka

    @property
    def primary_dsn(self) -> str:
        return self.node("primary").dsn

    @property
    def standby_dsn(self) -> str:
        return self.node("standby").dsn

    @property
    def subscriber_dsn(self) -> str:
        return self.node("subscriber").dsn

    @property
    def kafka_bootstrap(self) -> str:
        return self.kafka.bootstrap

    def env(self) -> dict[str, str]:
        return {
            "SLOTBRIDGE_PRIMARY_DSN": self.primary_dsn,
            "SLOTBRIDGE_STANDBY_DSN": self.standby_dsn,
            "SLOTBRIDGE_SUBSCRIBER_DSN": self.subscriber_dsn,
            "SLOTBRIDGE_KAFKA_BOOTSTRAP": self.kafka_bootstrap,
            # The Spark consumer's jars (its jars_dir), as the bootstrap resolved them.
            "SLOTBRIDGE_JARS_DIR": str(bootstrap.jars_dir(self._cache(), bootstrap.SPARK_SET)),
        }

    # -- up -------------------------------------------------------------------------------

    def _preflight(self) -> None:
        """Everything that can be refused before any work, each as one actionable line."""
        if self._state is not None and self._state.get("pg_major") != self.requested_major:
            raise StackError(
                f"the stack in {self.state_dir} was built with PostgreSQL "
                f"{self._state.get('pg_major')}, not {self.requested_major}; run `slotbridge "
                f"stack down --purge --dir {self.state_dir}` first to rebuild it"
            )
        postgres = self._pg_bin() / "postgres"
        if not postgres.exists() or not has_broker(self._kafka_jars()):
            raise StackError(
                f"binary cache {self._cache()} lacks PostgreSQL "
                f"{self.pg_major} or the Kafka jars; run python3 -m "
                "slotbridge_dev.bootstrap"
            )
        self.state_dir.mkdir(parents=True, exist_ok=True)
        user = self._user()
        if user is not None:
            # PostgreSQL runs as another user and must reach its folders below this one.
            os.chmod(self.state_dir, self.state_dir.stat().st_mode | 0o711)
            if not user.can_enter(self.state_dir):
                raise StackError(
                    f"state dir {self.state_dir} is not traversable by OS user "
                    f"{user.name} (PostgreSQL runs as it); chmod o+x its "
                    "parent folders or pick another --dir"
                )
            if not user.can_enter(postgres):
                raise StackError(
                    f"{postgres} is not executable by OS user {user.name}; "
                    f"make the cache {self._cache()} world-readable"
                )

    def _check_ports(self) -> None:
        """Fail fast on a taken port, before spending time on initdb and clones."""
        for name in NODE_NAMES:
            if not self.node(name).is_running():
                self.node(name).check_port()
        if not self.kafka.is_running():
            self.kafka.check_ports()

    def running(self) -> bool:
        """Whether any process of this stack runs (a bench stops only a stack it started)."""
        return bool(self._leftovers())

    def up(self) -> None:
        """Build or start what is missing; return only when every part is really ready."""
        started = time.monotonic()
        self._preflight()
        if self._state is None:
            self._state = self._new_state()
        self._check_ports()
        with ThreadPoolExecutor(max_workers=1) as pool:
            # The broker's JVM start overlaps with the PostgreSQL work.
            kafka_ready = pool.submit(self._kafka_up)
            self._primary_up()
            self._plain_up("subscriber")
            self._standby_up()
            kafka_ready.result()
        say(f"ready in {time.monotonic() - started:.1f}s ({self.state_dir})")

    def up_source(self) -> None:
        """Only the primary and its standby: for a test that brings its own broker and
        changes the source's servers under it (``upgrade``)."""
        self._preflight()
        if self._state is None:
            self._state = self._new_state()
        self._primary_up()
        self._standby_up()

    def upgrade(self, to_major: str) -> None:
        """The primary upgraded to ``to_major`` with ``pg_upgrade``, the standby rebuilt from
        it: the procedure of docs/operations.md ("Upgrading PostgreSQL"), on this stack.

        The caller stops writes and lets every logical slot catch up first (pg_upgrade
        refuses a slot with changes it has not confirmed). What ``pg_upgrade`` does not carry
        is set again: the physical slot of the standby (only logical slots move) and
        ``synchronized_standby_slots`` (it lives in postgresql.auto.conf, which is not copied).
        """
        old_major = self.pg_major
        if to_major not in SUPPORTED or int(to_major) <= int(old_major):
            raise StackError(f"cannot upgrade PostgreSQL {old_major} to {to_major}")
        primary = self.node("primary")
        self.node("standby").shutdown()
        if not primary.stop("fast"):
            raise StackError(f"primary: did not stop cleanly; log: {primary.log_path}")
        tools = bootstrap.pg_upgrade_bin(self._cache(), to_major)
        target = Node(f"primary-{to_major}", self.state_dir, primary.port, tools, self._user())
        shutil.rmtree(target.dir, ignore_errors=True)
        # pg_upgrade wants the new cluster's checksum setting to match the old one's (off:
        # the stack's 17 initdb default; 18's initdb turns them on).
        target.initdb("--no-data-checksums")
        target.write_config(COMMON_SETTINGS)
        pg_upgrade(primary, target, old_bin_dir(primary, old_major))
        replace_data_dir(primary, target)
        shutil.rmtree(target.dir)
        self.state["pg_major"] = to_major
        self._save_state()
        self._nodes = {}  # their binaries were the old major's
        self._primary_up()
        self.rejoin_as_standby("standby", "primary")

    def _kafka_up(self) -> None:
        self.kafka.start()
        self.kafka.wait_ready()

    def _plain_up(self, name: str) -> Node:
        node = self.node(name)
        if not node.exists():
            node.initdb()
            node.write_config(COMMON_SETTINGS)
        node.start()
        node.query("SELECT 1")  # a live postmaster is not yet a server that answers
        return node

    def _primary_up(self) -> None:
        primary = self.node("primary")
        fresh = not primary.exists()
        self._plain_up("primary")
        with primary.connect() as conn:
            if conn.execute("SELECT pg_is_in_recovery()").fetchone() == (True,):
                raise StackError(
                    f"primary: is in recovery, not a primary; rebuild with "
                    f"`slotbridge stack down --purge --dir {self.state_dir}`"
                )
            if fresh:
                # ALTER SYSTEM, as an operator would; the standby inherits it through the
                # file copy, which is the trap the failover runbook has to clean up.
                wait_for_standby_slot(conn)

    def _standby_up(self) -> None:
        standby = self.node("standby")
        if standby.exists() and not (standby.data_dir / "standby.signal").exists():
            say("standby: it was promoted (no standby.signal); re-cloning it from the primary")
            standby.shutdown()
            standby.wipe()
        if not standby.exists():
            clone_standby(self.node("primary"), standby, COMMON_SETTINGS)
        standby.start()
        wait_streaming(standby)

    def rejoin_as_standby(self, name: str, primary_name: str) -> None:
        """Node ``name`` (an old primary after a failover drill) rebuilt as a standby of node
        ``primary_name``, which then waits for it before sending logical changes
        (``synchronized_standby_slots``), as the stack's first primary does."""
        node = self.node(name)
        node.shutdown()
        node.wipe()
        clone_standby(self.node(primary_name), node, COMMON_SETTINGS)
        node.start()
        wait_streaming(node)
        with self.node(primary_name).connect() as conn:
            wait_for_standby_slot(conn)

    # -- down -----------------------------------------------------------------------------

    def _leftovers(self) -> set[int]:
        """Processes whose command line names one of our folders: postmasters and the JVM."""
        if self._state is None:
            return set()
        marks = [str(self.node(n).data_dir).encode() for n in NODE_NAMES]
        marks.append(str(self.kafka.config_path).encode())
        found = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if any(mark in cmdline for mark in marks) and pid_alive(int(entry.name)):
                found.add(int(entry.name))
        return found

    def down(self, purge: bool = False) -> None:
        """Stop every process of the stack; with ``purge`` also delete what ``up`` built."""
        if self._state is not None:
            with ThreadPoolExecutor(max_workers=1) as pool:
                kafka_stopped = pool.submit(self.kafka.stop)
                for name in ("standby", "subscriber", "primary"):
                    self.node(name).shutdown()
                kafka_stopped.result()
            left = self._leftovers()
            if left:
                say(f"killing leftover processes {sorted(left)}")
                kill_all(left)
                if wait_until(lambda: not any(pid_alive(p) for p in left), 10) is None:
                    raise StackError(f"processes {sorted(left)} of the stack survive SIGKILL")
        if purge:
            for part in (*NODE_NAMES, "kafka"):
                shutil.rmtree(self.state_dir / part, ignore_errors=True)
            self.state_path.unlink(missing_ok=True)
            self._state, self._nodes, self._kafka = None, {}, None

    # -- status ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """Each part with port, health and log; standbys with lag and synced slots."""
        parts: dict[str, Any] = {}
        primary_lsn = None
        for name in NODE_NAMES:
            parts[name] = self._node_status(self.node(name))
            if name == "primary" and parts[name]["role"] == "primary":
                primary_lsn = self.node(name).query("SELECT pg_current_wal_lsn()::text")[0][0]
        for name in NODE_NAMES:
            if parts[name]["role"] == "standby":
                parts[name].update(standby_status(self.node(name), primary_lsn))
        kafka = self.kafka
        parts["kafka"] = {
            "port": kafka.port,
            "controller_port": kafka.controller_port,
            "running": kafka.is_running(),
            "healthy": kafka.is_running() and kafka.answers(),
            "log": str(kafka.log_path),
        }
        return {
            "state_dir": str(self.state_dir),
            "pg_major": self.pg_major,
            "healthy": all(p["healthy"] for p in parts.values()),
            "parts": parts,
        }

    @staticmethod
    def _node_status(node: Node) -> dict[str, Any]:
        info: dict[str, Any] = {
            "port": node.port,
            "running": node.is_running(),
            "healthy": False,
            "role": None,
            "log": str(node.log_path),
            "data_dir": str(node.data_dir),
        }
        if info["running"]:
            try:
                info["role"] = "standby" if node.in_recovery() else "primary"
                info["healthy"] = True
            except (StackError, psycopg.Error):
                pass
        return info

    # -- failover slots -------------------------------------------------------------------

    def wait_slot_synced(
        self,
        slot: str,
        timeout: float = 60,
        advance: bool = False,
        primary_name: str = "primary",
        standby_name: str = "standby",
    ) -> float:
        """Wait until ``standby`` holds ``slot`` synced, permanent and valid; seconds taken.

        A fresh slot whose catalog xmin is older than the standby's own horizon stays
        temporary ("could not synchronize ... catalog xmin", seen on 18 and, after other
        activity on the standby, on 17) until a consumer confirms a newer position and a
        newer standby snapshot is in the WAL. So every round logs a standby snapshot on the
        primary, and with ``advance`` also advances the slot to the primary's current WAL
        position, playing the consumer: only for slots whose skipped changes nobody needs.
        """
        primary, standby = self.node(primary_name), self.node(standby_name)
        started = time.monotonic()

        def ready() -> bool:
            rows = standby.query(
                "SELECT synced AND NOT temporary AND invalidation_reason IS NULL "
                "FROM pg_replication_slots WHERE slot_name = %s",
                (slot,),
            )
            if rows == [(True,)]:
                return True
            with primary.connect() as conn:
                conn.execute("SELECT pg_log_standby_snapshot()")
                if advance:
                    conn.execute(
                        "SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (slot,)
                    )
            return False

        say(f"{standby_name}: waiting for failover slot {slot} to be sync-ready ({timeout:.0f}s)")
        if not wait_until(ready, timeout, interval=1.0):
            raise StackError(
                f"{standby_name}: slot {slot} not synced within {timeout:.0f}s; "
                f"log: {standby.log_path}"
            )
        return time.monotonic() - started
