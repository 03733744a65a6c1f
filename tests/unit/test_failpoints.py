"""The failpoint registry: what tests may arm is what the code passes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.common import failpoints

REPO = Path(__file__).resolve().parents[2]


def test_registry_names_exactly_the_call_sites() -> None:
    called: set[str] = set()
    for package in ("services", "spark_consumers"):
        for path in (REPO / package).rglob("*.py"):
            if path.name == "failpoints.py":
                continue
            text = path.read_text()
            assert not re.search(r"\bfailpoint\((?!\")", text), f"{path}: a computed name"
            called.update(re.findall(r'\bfailpoint\("([a-z_]+)"\)', text))
    assert called == failpoints.NAMES


def test_an_unknown_name_is_refused() -> None:
    assert failpoints._parse("after_chunk=6*kill") == {"after_chunk": (6, "kill")}
    with pytest.raises(ValueError, match="no failpoint named 'before_origin_advance'"):
        failpoints._parse("before_origin_advance=kill")
