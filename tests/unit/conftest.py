"""Fixtures of the unit tests."""

from __future__ import annotations

import time

import pytest

from services.bridge.records import events


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processing times and the run number fixed, so two builds of the same records agree
    byte for byte."""
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_456_789)
    monkeypatch.setattr(events, "_RUN", 5)
