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
