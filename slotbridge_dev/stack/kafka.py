"""A single-node KRaft Kafka broker run straight from the jar cache with plain ``java``.

The broker is its own controller (one process, two listeners). Every internal topic gets
replication factor 1, or transactions and consumer groups would wait forever for replicas
that do not exist. A second, broker-only node can join it (``controller``, ``replicas=2``)
for what needs replicas: ``min.insync.replicas`` that a lost follower leaves unsatisfied.
Storage is formatted once; a restart keeps the data. The same class runs any broker version
from 3.3 on: give it that version's jar folder.
"""

from __future__ import annotations

import base64
import shutil
import signal
import socket
import subprocess
import uuid
from pathlib import Path

from slotbridge_dev import bootstrap
from slotbridge_dev.stack.cluster import (
    StackError,
    kill_all,
    pid_alive,
    port_in_use,
    port_taken,
    say,
    wait_until,
)


def new_cluster_id() -> str:
    """Kafka's Uuid text form; Kafka itself never hands out ids starting with '-'."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


_LOG4J2 = """\
status = warn
# Log4j's own JVM shutdown hook would close the file while the broker's hook still logs its
# shutdown (4.4 lost all of it, older brokers the end); the appender flushes every line.
shutdownHook = disable
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.append = true
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.file.ref = FILE
# Startup and shutdown milestones stay visible; per-request chatter does not.
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
logger.broker.name = kafka.server.BrokerServer
logger.broker.level = INFO
"""


# What a partition really holds (producer ids, epochs, sequences, transaction markers), from
# the broker's own files. It left the broker's jar (kafka.tools) for kafka-tools in 4.3.
DUMP_LOG_SEGMENTS = "org.apache.kafka.tools.DumpLogSegments"


def _java_binary() -> str:
    java = shutil.which("java")
    if java is None:
        raise StackError("kafka: `java` (17+) is not on PATH; install a JDK 17")
    return java


def has_broker(jars: Path) -> bool:
    return any(jars.glob("kafka_2.13-*.jar"))


def dump_log_segments(*segments: Path, payloads: bool = True) -> str:
    """DumpLogSegments of the segment files (``.log``) of any broker version: every batch
    and record, with keys and values when ``payloads``, else only the transaction markers'
    contents (a much smaller dump of a large log).

    Runs the kafka-tools jar set of the cache, which reads every broker version we support.
    """
    return _dump(segments, "--print-data-log" if payloads else "--deep-iteration")


def dump_transaction_log(*segments: Path) -> str:
    """DumpLogSegments of segment files of the transaction log (``__transaction_state``):
    every state a transactional id went through, its key and payload decoded as JSON."""
    return _dump(segments, "--transaction-log-decoder")


def _dump(segments: tuple[Path, ...], option: str) -> str:
    jars = bootstrap.jars_dir(bootstrap.cache_dir(), bootstrap.KAFKA_TOOLS_SET)
    proc = subprocess.run(
        [
            _java_binary(),
            "-cp",
            f"{jars}/*",
            DUMP_LOG_SEGMENTS,
            "--files",
            ",".join(str(s) for s in segments),
            option,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if proc.returncode != 0:
        raise StackError(
            f"kafka: DumpLogSegments failed (exit {proc.returncode}; tools in "
            f"{jars}): {proc.stderr.strip()[-2000:]}"
        )
    return proc.stdout


class Kafka:
    """The broker in ``<root>/kafka``: config, data, pid file and one log file."""

    HEAP = "-Xmx768m"

    def __init__(
        self,
        root: Path,
        port: int,
        controller_port: int,
        jars: Path,
        cluster_id: str,
        *,
        controller: Kafka | None = None,
        replicas: int = 1,
        sasl_port: int = 0,
        sasl_users: dict[str, str] | None = None,
    ) -> None:
        """``controller``: the node whose controller this broker-only node 2 joins (its own
        ``controller_port`` is then unused); ``replicas``: the brokers there will be, the
        replication factor of new and internal topics. ``sasl_port``: a second listener,
        SASL/PLAIN for ``sasl_users`` (name -> password), with ACLs enforced there by the
        StandardAuthorizer; the plain listener stays open to anyone as a super user (the
        tests' own reads and the broker's own requests)."""
        self.sasl_port = sasl_port
        self.sasl_users = sasl_users or {}
        self.port = port
        self.controller_port = controller_port
        self.jars = jars
        self.cluster_id = cluster_id
        self._controller = controller
        self._replicas = replicas
        self.dir = root / ("kafka" if controller is None else "kafka-2")
        self.data_dir = self.dir / "data"
        self.config_path = self.dir / "server.properties"
        self.log_path = self.dir / "kafka.log"
        self._pid_path = self.dir / "kafka.pid"
        # Right after the launch /proc/<pid>/cmdline can still be empty (exec in progress),
        # so the process we started ourselves is judged by its pid alone.
        self._launched: int | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _config(self) -> str:
        listeners = f"PLAINTEXT://127.0.0.1:{self.port}"
        voter = (
            self.controller_port if self._controller is None else self._controller.controller_port
        )
        replicas = str(self._replicas)
        protocols = "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
        if self.sasl_port:
            listeners += f",SASL_PLAINTEXT://127.0.0.1:{self.sasl_port}"
            protocols += ",SASL_PLAINTEXT:SASL_PLAINTEXT"
        settings = {
            "process.roles": "broker,controller" if self._controller is None else "broker",
            "node.id": "1" if self._controller is None else "2",
            "controller.quorum.voters": f"1@127.0.0.1:{voter}",
            "listeners": listeners
            if self._controller is not None
            else f"{listeners},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": listeners,
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": protocols,
            "log.dirs": str(self.data_dir),
            "num.partitions": "1",
            "auto.create.topics.enable": "true",
            "default.replication.factor": replicas,
            "offsets.topic.replication.factor": replicas,
            "transaction.state.log.replication.factor": replicas,
            "transaction.state.log.min.isr": "1",
            "share.coordinator.state.topic.replication.factor": replicas,
            "share.coordinator.state.topic.min.isr": "1",
            # Tests start consumer groups all the time; the default 3 s delay is pure waiting.
            "group.initial.rebalance.delay.ms": "0",
        }
        if self.sasl_port:
            users = " ".join(f'user_{u}="{pw}"' for u, pw in self.sasl_users.items())
            settings |= {
                "sasl.enabled.mechanisms": "PLAIN",
                "listener.name.sasl_plaintext.plain.sasl.jaas.config": (
                    f"org.apache.kafka.common.security.plain.PlainLoginModule required {users};"
                ),
                "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
                "super.users": "User:ANONYMOUS",
                "allow.everyone.if.no.acl.found": "false",
            }
        return "".join(f"{k}={v}\n" for k, v in settings.items())

    def _java(self, main: str, *args: str) -> list[str]:
        return [
            _java_binary(),
            self.HEAP,
            "-Xms256m",
            "-XX:+UseG1GC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.dir / 'log4j2.properties'}",
            "-cp",
            f"{self.jars}/*",
            main,
            *args,
        ]

    def pid(self) -> int | None:
        """The broker's pid, if that process is still our broker (pids get reused)."""
        try:
            pid = int(self._pid_path.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return None
        ours = pid == self._launched or str(self.config_path).encode() in cmdline
        return pid if ours and pid_alive(pid) else None

    def is_running(self) -> bool:
        return self.pid() is not None

    def check_ports(self) -> None:
        ports = [("kafka", self.port)]
        if self.sasl_port:
            ports.append(("kafka sasl", self.sasl_port))
        if self._controller is None:
            ports.append(("kafka controller", self.controller_port))
        for part, port in ports:
            if port_in_use(port):
                raise StackError(port_taken(part, port))

    def _format(self) -> None:
        say("kafka: formatting storage")
        proc = subprocess.run(
            self._java(
                "kafka.tools.StorageTool",
                "format",
                "-t",
                self.cluster_id,
                "-c",
                str(self.config_path),
            ),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            self.log_path.write_text(proc.stdout + proc.stderr)
            raise StackError(f"kafka: formatting storage failed; log: {self.log_path}")

    def start(self) -> None:
        """Launch the broker (formatting storage the first time); see wait_ready."""
        if self.is_running():
            return
        if not has_broker(self.jars):
            raise StackError(
                f"kafka: no broker jars in {self.jars}; run python3 -m slotbridge_dev.bootstrap"
            )
        self.check_ports()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self._config())
        (self.dir / "log4j2.properties").write_text(_LOG4J2.format(log=self.log_path))
        if not (self.data_dir / "meta.properties").exists():
            self._format()
        say(f"kafka: starting broker on port {self.port}")
        with self.log_path.open("ab") as log:
            proc = subprocess.Popen(
                self._java("kafka.Kafka", str(self.config_path)),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                cwd=self.dir,
                start_new_session=True,
            )
        self._pid_path.write_text(f"{proc.pid}\n")
        self._launched = proc.pid

    def answers(self, timeout: float = 5) -> bool:
        """Metadata request through the real client: the listener alone proves little."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                pass
        except OSError:
            return False
        from confluent_kafka import KafkaException
        from confluent_kafka.admin import AdminClient

        # log_level 0 keeps librdkafka from printing connection errors while we poll.
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        try:
            meta = admin.list_topics(timeout=timeout)
        except KafkaException:
            return False
        return bool(meta.brokers)

    def wait_ready(self, timeout: float = 120) -> None:
        say(f"kafka: waiting for the broker to answer metadata requests (up to {timeout:.0f}s)")

        def ready() -> bool:
            alive = pid_alive(self._launched) if self._launched else self.is_running()
            if not alive:
                raise StackError(f"kafka: broker exited during startup; log: {self.log_path}")
            return self.answers(timeout=2)

        if not wait_until(ready, timeout, interval=0.5):
            raise StackError(
                f"kafka: broker never answered within {timeout:.0f}s; log: {self.log_path}"
            )

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM (a clean shutdown keeps restarts fast), SIGKILL if it hangs."""
        pid = self.pid()
        if pid is None:
            return
        say("kafka: stopping broker")
        kill_all({pid}, signal.SIGTERM)
        if wait_until(lambda: not pid_alive(pid), timeout) is None:
            say("kafka: broker ignored SIGTERM; killing it")
            kill_all({pid})
            if wait_until(lambda: not pid_alive(pid), 10) is None:
                raise StackError(f"kafka: broker pid {pid} survives SIGKILL")
        self._pid_path.unlink(missing_ok=True)
