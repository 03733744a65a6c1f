"""Fixtures shared by every test: the embedded stack (integration tests only use it).

Tests under tests/integration/ get the ``integration`` mark here, so ``-m "not
integration"`` runs the pure unit tests without PostgreSQL or Kafka. Every process a test
starts runs this checkout's code (``PYTHONPATH``), whatever the virtualenv points at.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import pytest

from slotbridge_dev import bootstrap
from slotbridge_dev.stack.cluster import free_ports
from slotbridge_dev.stack.kafka import Kafka, new_cluster_id
from slotbridge_dev.stack.stack import Stack, StackError

REPO = Path(__file__).resolve().parents[1]
INTEGRATION = Path(__file__).resolve().parent / "integration"
TEST_PG = os.environ.get("SLOTBRIDGE_TEST_PG", "17")
KEEP = os.environ.get("SLOTBRIDGE_KEEP_STACK") == "1"

# Child processes - the `slotbridge` console script above all - must run this checkout's
# code: an editable install in a virtualenv shared between checkouts points at another one.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
)
# The Spark consumer's jars come from its settings (jars_dir); here, the bootstrap's cache.
os.environ.setdefault(
    "SLOTBRIDGE_JARS_DIR", str(bootstrap.jars_dir(bootstrap.cache_dir(), bootstrap.SPARK_SET))
)


# README's command runs the suite on two xdist workers (``-n 2``, ``--dist loadgroup``).
# Each worker has a stack of its own (``stack``): tests stop, promote and reconfigure their
# stack's servers. Every test that runs Spark goes to one worker as one group, which xdist
# hands out first (it orders groups by size, and this is the largest): two Spark JVMs at
# once would take both cores of a small machine, while the other worker's tests mostly
# wait on servers and processes.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
SPARK_GROUP = "spark"


def _runs_spark(item: pytest.Item) -> bool:
    return item.get_closest_marker("spark") is not None or "spark" in getattr(
        item, "fixturenames", ()
    )


# Before xdist's own hook, which names each test's group from its marks.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if INTEGRATION in item.path.parents:
            item.add_marker(pytest.mark.integration)
        if _runs_spark(item):
            item.add_marker(pytest.mark.xdist_group(SPARK_GROUP))


def _up(stack: Stack, on_failure: Callable[[], None]) -> Stack:
    try:
        stack.up()
    except StackError as exc:
        # A half-started stack would outlive the session: nobody reaches the teardown.
        on_failure()
        pytest.fail(f"local stack: {exc}", pytrace=False)
    return stack


def _last_one_out(lock: IO[str]) -> bool:
    """Upgrade our shared lock; this fails while another session still holds one."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The shared stack, started or reused; down at the end unless SLOTBRIDGE_KEEP_STACK=1.
    An xdist worker's is in a subfolder named after the worker.

    Several pytest sessions may use the same folder at once: each holds a shared lock on
    it, and only the last one out stops the stack.
    """
    state_dir = Path(os.environ.get("SLOTBRIDGE_TEST_STACK_DIR", REPO / ".stack" / "test"))
    state_dir = state_dir / WORKER if WORKER else state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    shared = Stack(state_dir, TEST_PG)
    with (state_dir / "pytest-sessions.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)

        def stop_if_alone() -> None:
            if not KEEP and _last_one_out(lock):
                shared.down()

        yield _up(shared, stop_if_alone)
        stop_if_alone()


@pytest.fixture
def fresh_stack() -> Iterator[Callable[..., Stack]]:
    """Factory of dedicated stacks for destructive tests (of the tests' PostgreSQL major
    version, or the one given); each is purged afterwards."""
    made: list[Stack] = []

    def make(pg_major: str = TEST_PG) -> Stack:
        # Under /tmp rather than pytest's tmp_path: /tmp/pytest-of-root is mode 0700, which
        # the unprivileged PostgreSQL user cannot traverse.
        state_dir = Path(tempfile.mkdtemp(prefix="slotbridge-stack-"))
        made.append(Stack(state_dir, pg_major))
        return _up(made[-1], made[-1].down)

    yield make
    for dedicated in made:
        dedicated.down(purge=True)
        shutil.rmtree(dedicated.state_dir, ignore_errors=True)


def _broker_root(prefix: str) -> Path:
    # Under /tmp and world-traversable like the stacks' folders, so its log and segments
    # can be read by anyone looking into a failure (mkdtemp makes it 0700).
    root = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(root, 0o755)
    return root


def _lone_broker(root: Path, kafka_set: str) -> Kafka:
    """A broker of its own cluster, of the Kafka release ``kafka_set`` names, on free ports."""
    port, controller_port = free_ports(2)
    jars = bootstrap.jars_dir(bootstrap.cache_dir(), kafka_set)
    return Kafka(root, port, controller_port, jars, new_cluster_id())


@contextmanager
def _running(root: Path, what: str, logs_to: Path, *brokers: Kafka) -> Iterator[None]:
    """Start the brokers in order and wait until each answers; after, stop them (the last
    first), copy each broker's log and data directory into ``logs_to`` (the test's
    tmp_path, which pytest keeps for the last runs: a failure's ground truth is in the
    brokers' logs) and purge ``root``."""
    try:
        try:
            for broker in brokers:
                broker.start()
            for broker in brokers:
                broker.wait_ready()
        except StackError as exc:
            pytest.fail(f"{what}: {exc}", pytrace=False)
        yield
    finally:
        for broker in reversed(brokers):
            broker.stop()
        for broker in brokers:
            if broker.log_path.exists():
                shutil.copy(broker.log_path, logs_to / f"{broker.dir.name}.log")
            # The partitions' logs (every record, marker and producer state as the broker
            # wrote them), the transaction log and the cluster's metadata log (every ISR
            # change, leader election, fencing and config change, as the controller decided
            # it): what dump_log_segments reads to clear or convict a failure.
            if broker.data_dir.exists():
                shutil.copytree(broker.data_dir, logs_to / f"{broker.dir.name}-data")
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def kafka_pair(tmp_path: Path) -> Iterator[tuple[Kafka, Kafka]]:
    """Two brokers of the stack's Kafka version (node 1 is also the controller), every new
    topic on both: a follower to lose. Stopped and purged after, their logs kept in the
    test's tmp_path."""
    root = _broker_root("slotbridge-kafka2-")
    port, controller_port, port2 = free_ports(3)
    jars = bootstrap.jars_dir(bootstrap.cache_dir(), bootstrap.KAFKA_SET)
    cluster = new_cluster_id()
    first = Kafka(root, port, controller_port, jars, cluster, replicas=2)
    second = Kafka(root, port2, 0, jars, cluster, controller=first, replicas=2)
    with _running(root, "two-broker Kafka", tmp_path, first, second):
        yield first, second


@pytest.fixture
def sasl_kafka(tmp_path: Path) -> Iterator[Kafka]:
    """A broker of the stack's Kafka version with a SASL/PLAIN listener where ACLs apply,
    for the user ``bridge`` (its password in ``sasl_users``); its plain listener is open."""
    root = _broker_root("slotbridge-kafka-sasl-")
    port, controller_port, sasl_port = free_ports(3)
    broker = Kafka(
        root,
        port,
        controller_port,
        bootstrap.jars_dir(bootstrap.cache_dir(), bootstrap.KAFKA_SET),
        new_cluster_id(),
        sasl_port=sasl_port,
        sasl_users={"bridge": f"bridge-{uuid.uuid4().hex[:12]}"},
    )
    with _running(root, "SASL Kafka", tmp_path, broker):
        yield broker


@pytest.fixture
def small_disk_kafka(tmp_path: Path) -> Iterator[Kafka]:
    """A broker of the stack's Kafka version whose log dir is a filesystem of its own, a
    64 MiB tmpfs, so that it can fill up. Mounting one needs root and a machine that lets
    root mount (not every container does): skipped otherwise, with the reason."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a broker on a small filesystem needs root and mount(8) (mount -t tmpfs)")
    root = _broker_root("slotbridge-kafka-disk-")
    broker = _lone_broker(root, bootstrap.KAFKA_SET)
    broker.data_dir.mkdir(parents=True)
    mount = ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0755", "slotbridge-kafka-disk"]
    mounted = subprocess.run([*mount, str(broker.data_dir)], capture_output=True, text=True)
    if mounted.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        with _running(root, "small-disk Kafka", tmp_path, broker):
            yield broker
    finally:
        subprocess.run(["umount", str(broker.data_dir)], check=True)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def oldest_kafka(tmp_path: Path) -> Iterator[Kafka]:
    """A dedicated broker of the oldest Kafka version we support, stopped and purged after."""
    root = _broker_root("slotbridge-kafka-")
    broker = _lone_broker(root, bootstrap.KAFKA_OLDEST_SET)
    with _running(root, f"Kafka {bootstrap.KAFKA_OLDEST_VERSION} broker", tmp_path, broker):
        yield broker


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One local-mode Spark session for every Spark test (a JVM start costs ~10 s)."""
    from spark_consumers.job import build_session
    from spark_consumers.settings import ConsumerSettings

    settings = ConsumerSettings(
        kafka_bootstrap="unused:9",
        warehouse="/unused",
        checkpoint_dir="/unused",
        spark_master="local[2]",
        shuffle_partitions=2,
    )
    yield build_session(settings)
