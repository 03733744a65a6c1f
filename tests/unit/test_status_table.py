"""``slotbridge status``'s snapshot lines: an estimate only where PostgreSQL has one."""

from __future__ import annotations

from typing import Any

import pytest

from services.bridge.cli import _print_table


def _entry(estimate: int | None) -> dict[str, Any]:
    return {
        "state": "reading",
        "rows_done": 50_000,
        "rows_estimated": estimate,
        "chunks_done": 3,
        "rows_per_s": 1000,
        "eta_s": None,
    }


def test_snapshot_of_an_analysed_table_shows_its_estimate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _print_table({"slot": "s", "snapshot": {"public.t": _entry(120_000)}})
    line = capsys.readouterr().out.splitlines()[-1]
    assert "public.t: reading, 50,000 of ~120,000 rows in 3 chunks, 1,000 rows/s" in line


def test_snapshot_of_a_table_never_analysed_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    _print_table({"slot": "s", "snapshot": {"public.t": _entry(None)}})
    line = capsys.readouterr().out.splitlines()[-1]
    assert "50,000 rows in 3 chunks" in line and "no estimate: table not analysed" in line
    assert "unknown" not in line
