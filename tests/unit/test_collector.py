"""The collector's young generation spaced out at start (services/common/collector.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from services.common.collector import YOUNG_THRESHOLD, space_out_collections


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    """The thresholds before the test, set back after it (the test process shares them)."""
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_only_the_young_threshold_changes(thresholds: tuple[int, int, int]) -> None:
    space_out_collections()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, thresholds[1], thresholds[2])
