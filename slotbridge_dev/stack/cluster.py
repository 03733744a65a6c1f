"""One PostgreSQL node of the local stack: initdb, its config file, pg_ctl start and stop.

A Node knows its name, folder and port, never its role: a promoted standby starts and
stops exactly like the primary, because everything goes through ``pg_ctl`` on the data
folder. The helpers at the top (errors, ports, processes, the OS user) are shared with the
Kafka broker, which has the same needs.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from services.common.errors import SlotbridgeError
from services.common.pg import SourceError, connect

T = TypeVar("T")

PG_USER = "slotbridge-pg"
# Our settings live in a file of their own, included last by postgresql.conf, so a rewrite
# (a new port for a clone, standby settings) never has to edit PostgreSQL's own file.
CONFIG_FILE = "slotbridge.conf"


class StackError(SlotbridgeError):
    """One line an operator can act on: which part failed and where its log is."""

    retryable = False  # the command stops; its user reads the log it names


def say(msg: str) -> None:
    """Progress on long steps, so a slow machine looks slow rather than hung."""
    print(f"[stack] {msg}", flush=True)


def wait_until(check: Callable[[], T | None], timeout: float, interval: float = 0.25) -> T | None:
    """Poll ``check`` until it returns something truthy; None once ``timeout`` has passed."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def port_in_use(port: int) -> bool:
    """True when some socket holds 127.0.0.1:port (a TIME_WAIT leftover does not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def port_taken(part: str, port: int) -> str:
    return (
        f"{part}: port {port} on 127.0.0.1 is already taken by another process; stop it, "
        "or `slotbridge stack down --purge` to pick new ports"
    )


def free_ports(count: int) -> list[int]:
    """Distinct ports the kernel considers free right now (all sockets held until the end)."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for sock in socks:
            sock.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has exited; only its parent has not collected it yet.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def children_of(pid: int) -> set[int]:
    """Direct children, read from /proc: postgres backends carry no path in their title."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[-1].split()[1]) == pid:
            found.add(int(entry.name))
    return found


def kill_all(pids: set[int], sig: signal.Signals = signal.SIGKILL) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@dataclass(frozen=True)
class RunAs:
    """The unprivileged account PostgreSQL runs under when we are root (initdb refuses root)."""

    name: str
    uid: int
    gid: int

    def chown(self, path: Path) -> None:
        os.chown(path, self.uid, self.gid)

    def chown_tree(self, top: Path) -> None:
        self.chown(top)
        for folder, dirs, files in os.walk(top):
            for name in dirs + files:
                os.lchown(os.path.join(folder, name), self.uid, self.gid)

    def can_enter(self, path: Path) -> bool:
        """Ask the kernel as that user, which also covers ACLs and every parent folder."""
        probe = subprocess.run(
            ["test", "-x", str(path)], user=self.uid, group=self.gid, extra_groups=[], check=False
        )
        return probe.returncode == 0


def pg_os_user() -> RunAs | None:
    """The account to run PostgreSQL as: ``slotbridge-pg`` (created if missing) for root."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(PG_USER)
    except KeyError:
        say(f"creating OS user {PG_USER} (PostgreSQL refuses to run as root)")
        proc = subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", PG_USER],
            capture_output=True,
            text=True,
            check=False,
        )
        try:
            entry = pwd.getpwnam(PG_USER)
        except KeyError:
            reason = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
            raise StackError(f"cannot create OS user {PG_USER}: {reason}") from None
    return RunAs(entry.pw_name, entry.pw_uid, entry.pw_gid)


def _conf_value(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return str(value)
    return "'" + str(value).replace("'", "''") + "'"


# Only TCP on loopback: no socket folder to own, and every client uses the same DSN form.
_HBA = (
    "# written by slotbridge stack: trust on loopback, local test stack only\n"
    "host all all 127.0.0.1/32 trust\n"
    "host replication all 127.0.0.1/32 trust\n"
    # The stack listens on no socket (unix_socket_directories is empty); pg_upgrade starts
    # the servers with a private socket of its own, and connects only through it.
    "local all all trust\n"
)


class Node:
    """A PostgreSQL cluster in ``<root>/<name>/data`` with its log at ``<root>/<name>``."""

    def __init__(
        self, name: str, root: Path, port: int, bin_dir: Path, run_as: RunAs | None
    ) -> None:
        self.name = name
        self.port = port
        self.bin_dir = bin_dir
        self.run_as = run_as
        self.dir = root / name
        self.data_dir = self.dir / "data"
        self.log_path = self.dir / "postgres.log"

    def __repr__(self) -> str:
        return f"Node({self.name!r}, port={self.port}, data_dir={str(self.data_dir)!r})"

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} dbname=postgres user=postgres"

    def exists(self) -> bool:
        return (self.data_dir / "PG_VERSION").exists()

    # -- running the binaries -------------------------------------------------------------

    def run(
        self, args: list[str], timeout: float, detach: bool = False, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """One of the node's binaries as the PostgreSQL OS user, in ``cwd`` (default: the
        node's folder); exit code not checked."""
        env = {
            "PATH": f"{self.bin_dir}:/usr/bin:/bin",
            "LC_ALL": "C",
            "HOME": str(self.dir),
            "TZ": "UTC",
        }
        who: dict[str, Any] = {}
        if self.run_as is not None:
            who = {"user": self.run_as.uid, "group": self.run_as.gid, "extra_groups": []}
        # detach: the postmaster must not share our session, or Ctrl-C on `stack up`
        # would take the database down with it.
        return subprocess.run(
            args,
            cwd=cwd or self.dir,
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=timeout,
            start_new_session=detach,
            check=False,
            **who,
        )

    def pg_ctl(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        """Run ``pg_ctl <args> -D <data_dir>`` as the PostgreSQL OS user; exit code not checked."""
        try:
            return self.run(
                [str(self.bin_dir / "pg_ctl"), *args, "-D", str(self.data_dir)],
                timeout,
                detach=bool(args) and args[0] in ("start", "restart"),
            )
        except FileNotFoundError:
            raise StackError(
                f"{self.name}: {self.bin_dir / 'pg_ctl'} is missing; run "
                "python3 -m slotbridge_dev.bootstrap"
            ) from None
        except subprocess.TimeoutExpired:
            raise StackError(
                f"{self.name}: pg_ctl {args[0] if args else ''} hung for "
                f"{timeout:.0f}s; log: {self.log_path}"
            ) from None

    def make_dir(self) -> None:
        """The node's folder, owned by the PostgreSQL user, so initdb and the log can write."""
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o700)
        if self.run_as is not None:
            self.run_as.chown(self.dir)

    def initdb(self, *options: str) -> None:
        """A new cluster; ``options`` are initdb's beyond the stack's own."""
        self.make_dir()
        say(f"{self.name}: initdb")
        # --no-sync: a crash of the whole machine during setup just means running up again.
        proc = self.run(
            [
                str(self.bin_dir / "initdb"),
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
                *options,
            ],
            timeout=300,
        )
        if proc.returncode != 0:
            self.log_path.write_text(proc.stdout + proc.stderr)
            raise StackError(
                f"{self.name}: initdb failed (exit {proc.returncode}); see {self.log_path}"
            )
        self._write(self.data_dir / "pg_hba.conf", _HBA)
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write(f"\ninclude_if_exists = '{CONFIG_FILE}'\n")

    def _write(self, path: Path, text: str) -> None:
        path.write_text(text)
        os.chmod(path, 0o600)
        if self.run_as is not None:
            self.run_as.chown(path)

    def write_config(self, settings: Mapping[str, object]) -> None:
        """Replace the node's own settings file (port first; the rest as given)."""
        lines = [f"port = {self.port}"]
        lines += [f"{key} = {_conf_value(value)}" for key, value in settings.items()]
        self._write(
            self.data_dir / CONFIG_FILE,
            "# written by slotbridge stack; rewritten on every build\n" + "\n".join(lines) + "\n",
        )

    # -- lifecycle ------------------------------------------------------------------------

    def postmaster_pid(self) -> int | None:
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
        except (OSError, ValueError):
            return None
        return int(first) if first.strip().isdigit() else None

    def is_running(self) -> bool:
        pid = self.postmaster_pid()
        return pid is not None and pid_alive(pid)

    def pids(self) -> set[int]:
        """The postmaster and its children: what must be gone after a stop."""
        pid = self.postmaster_pid()
        if pid is None or not pid_alive(pid):
            return set()
        return {pid} | children_of(pid)

    def check_port(self) -> None:
        if port_in_use(self.port):
            raise StackError(port_taken(self.name, self.port))

    def start(self, timeout: float = 120) -> None:
        if self.is_running():
            return
        if not self.exists():
            raise StackError(
                f"{self.name}: no data folder at {self.data_dir}; run "
                "`slotbridge stack up` to build it"
            )
        self.check_port()
        say(f"{self.name}: starting postgres on port {self.port}")
        proc = self.pg_ctl(
            "start", "-w", "-t", str(int(timeout)), "-l", str(self.log_path), timeout=timeout + 30
        )
        if proc.returncode != 0:
            raise StackError(
                f"{self.name}: postgres failed to start{self._log_reason()}; log: {self.log_path}"
            )

    def _log_reason(self) -> str:
        """The last FATAL/PANIC line of the log, because it usually says it all."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines[-200:]):
            for level in ("FATAL:", "PANIC:"):
                if level in line:
                    return " (" + line[line.index(level) :].strip()[:200] + ")"
        return ""

    def stop(self, mode: str = "fast", timeout: float = 60) -> bool:
        """Stop with ``pg_ctl -m mode``; True once no process of this node remains."""
        before = self.pids()
        if not before:
            return True
        proc = self.pg_ctl("stop", "-m", mode, "-w", "-t", str(int(timeout)), timeout=timeout + 30)
        gone = wait_until(lambda: not any(pid_alive(p) for p in before), 10)
        return proc.returncode == 0 and bool(gone)

    def shutdown(self) -> None:
        """Fast, then immediate, then SIGKILL: ``down`` must leave nothing behind."""
        before = self.pids()
        if not before:
            return
        say(f"{self.name}: stopping postgres")
        for mode, timeout in (("fast", 30), ("immediate", 15)):
            try:
                if self.stop(mode, timeout=timeout):
                    return
            except StackError as exc:  # no pg_ctl, or it hung: signals still work
                say(str(exc))
        left = {p for p in before if pid_alive(p)}
        say(f"{self.name}: killing leftover processes {sorted(left)}")
        kill_all(left)
        if wait_until(lambda: not any(pid_alive(p) for p in left), 10) is None:
            raise StackError(f"{self.name}: processes {sorted(left)} survive SIGKILL")

    def wipe(self) -> None:
        if self.is_running():
            raise StackError(f"{self.name}: refusing to delete a running node's data")
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- SQL ------------------------------------------------------------------------------

    def connect(self) -> psycopg.Connection[tuple[Any, ...]]:
        """An autocommit SQL connection; a failure names this node and its log."""
        try:
            return connect(self.dsn, connect_timeout=5)
        except SourceError as exc:
            raise StackError(f"{self.name}: {exc}; log: {self.log_path}") from None

    def query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self.connect() as conn:
            return conn.execute(sql, params).fetchall()

    def answers(self) -> bool:
        try:
            self.query("SELECT 1")
        except (StackError, psycopg.Error):
            return False
        return True

    def in_recovery(self) -> bool:
        return bool(self.query("SELECT pg_is_in_recovery()")[0][0])
