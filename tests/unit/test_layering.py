"""What may import what: the product never depends on its development tools or tests, and
the bridge and failover services never on Spark (a bridge install does not pull it)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
import setuptools

REPO = Path(__file__).resolve().parents[2]


def _imports(package: str) -> dict[Path, set[str]]:
    """Top-level module names each file of ``package`` imports (absolute imports only:
    the code base uses no relative ones, which this also checks)."""
    found: dict[Path, set[str]] = {}
    for path in (REPO / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import"
                assert node.module is not None
                names.add(node.module.split(".")[0])
        found[path.relative_to(REPO)] = names
    return found


@pytest.mark.parametrize("package", ["services", "spark_consumers"])
def test_the_product_never_imports_tooling_or_tests(package: str) -> None:
    offenders = {
        str(path): sorted(names & {"slotbridge_dev", "tests", "bench"})
        for path, names in _imports(package).items()
        if names & {"slotbridge_dev", "tests", "bench"}
    }
    assert not offenders


def test_the_services_never_import_spark() -> None:
    spark = {"pyspark", "delta", "pandas", "pyarrow", "spark_consumers"}
    offenders = {
        str(path): sorted(names & spark)
        for path, names in _imports("services").items()
        if names & spark
    }
    assert not offenders


def test_the_distribution_holds_the_product_only() -> None:
    """The packages setuptools puts in the wheel (and so in the images), found the way it
    finds them: the tools and tests stay in the checkout."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = set(setuptools.find_packages(where=str(REPO), include=include))
    assert {p.split(".")[0] for p in shipped} == {"services", "spark_consumers"}
    assert {"services.bridge", "services.failover", "services.common"} <= shipped


# The bridge's pipeline, one package per stage, in the order data flows through it: a stage
# may use the stages before it (and the shared modules at the top of services/bridge),
# never one after it, so each file is entered once on the way from the socket to Kafka.
# ``progress`` is what the sink's commits make durable; ``snapshot`` feeds tables' rows in
# beside the stream and hands them to the publisher.
_PIPELINE = ("receive", "decode", "assemble", "records", "sink", "progress", "snapshot", "publish")
BRIDGE = REPO / "services" / "bridge"


def _stage_imports(stage: str) -> set[str]:
    """The stage packages that the modules of ``stage`` import."""
    used: set[str] = set()
    for path in (BRIDGE / stage).glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "services.bridge."
            ):
                used.add((node.module or "").split(".")[2])
    return used & set(_PIPELINE)


def test_every_package_of_the_bridge_is_a_stage_of_the_pipeline() -> None:
    packages = {p.name for p in BRIDGE.iterdir() if (p / "__init__.py").exists()}
    assert packages == set(_PIPELINE)


@pytest.mark.parametrize("stage", _PIPELINE)
def test_no_stage_of_the_bridge_uses_a_later_one(stage: str) -> None:
    later = set(_PIPELINE[_PIPELINE.index(stage) + 1 :])
    assert not _stage_imports(stage) & later


def test_only_the_decoder_reads_pgoutput_bytes() -> None:
    """``payload`` is the code base's name for a pgoutput message's raw bytes: only the
    decoder looks inside one (the others ask it: ``decoder.is_relation`` and the like)."""
    offenders = []
    for path in sorted(BRIDGE.rglob("*.py")):
        if path == BRIDGE / "decode" / "decoder.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.value, ast.Name)
                and node.value.id == "payload"
            ):
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders
