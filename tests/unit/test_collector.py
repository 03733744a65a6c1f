"""The collector's young generation spaced out at start, and startup's objects frozen
(services/common/collector.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from services.common.collector import (
    YOUNG_THRESHOLD,
    freeze_startup_objects,
    space_out_collections,
)


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    """The thresholds before the test, set back after it (the test process shares them)."""
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_only_the_young_threshold_changes(thresholds: tuple[int, int, int]) -> None:
    space_out_collections()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, thresholds[1], thresholds[2])


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """The objects the test froze back in the collector's sight (the test process shares them)."""
    yield
    gc.unfreeze()


def test_objects_alive_at_the_freeze_are_out_of_the_collectors_sight(unfrozen: None) -> None:
    alive: list[list[int]] = [[] for _ in range(100)]
    freeze_startup_objects()
    assert gc.get_freeze_count() >= len(alive)
    seen = {id(o) for o in gc.get_objects()}
    assert not any(id(x) in seen for x in alive)
