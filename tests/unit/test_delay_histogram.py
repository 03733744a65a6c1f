"""The commit-to-visible histogram, observed a batch at a time (services/bridge/metrics.py),
against prometheus_client's own ``Histogram`` fed the same delays one by one."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.bridge.metrics import COMMIT_TO_VISIBLE_BUCKETS, DelayHistogram

NAME = "slotbridge_commit_to_visible_seconds"
END_US = 1_000_000_000


def _samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
    """(sample name, its le or "") -> value, of the histogram's bucket, count and sum."""
    return {
        (sample.name, sample.labels.get("le", "")): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
        if family.name == NAME and not sample.name.endswith("_created")
    }


def _compared(batches: list[list[int]]) -> dict[tuple[str, str], float]:
    """The histogram fed ``batches`` of delays (µs) against prometheus_client's fed them one
    by one; the histogram's samples."""
    reference_registry = CollectorRegistry()
    reference = Histogram(
        NAME, "doc", ["slot"], registry=reference_registry, buckets=COMMIT_TO_VISIBLE_BUCKETS
    ).labels("s1")
    for delay in (d for batch in batches for d in batch):
        reference.observe(max(0, delay) / 1_000_000)

    registry = CollectorRegistry()
    histogram = DelayHistogram(NAME, "doc", "s1", COMMIT_TO_VISIBLE_BUCKETS)
    registry.register(histogram)
    for batch in batches:
        histogram.observe_until(END_US, [END_US - delay for delay in batch])

    got, want = _samples(registry), _samples(reference_registry)
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) < 1e-6, (key, got[key], value)
    return got


def test_batches_count_as_the_same_delays_one_by_one() -> None:
    # On a bound (le is inclusive), just above one, past the last, and a negative delay
    # (the bridge's clock behind the server's): counted as 0.
    delays_us = [0, 5_000, 5_001, 99_999, 100_000, 100_001, 10_000_000, 60_000_000, -3_000]
    got = _compared([delays_us[:4], delays_us[4:], []])
    assert got[(f"{NAME}_count", "")] == len(delays_us)
    assert got[(f"{NAME}_bucket", "0.005")] == 3  # 0, 5,000 and the negative one


def test_large_unordered_batches_count_as_one_by_one() -> None:
    # A Kafka commit of a backlog: thousands of delays, in any order, some on the bounds.
    rng = random.Random(7)
    bounds_us = [round(bound * 1_000_000) for bound in COMMIT_TO_VISIBLE_BUCKETS]
    batches = [
        [
            rng.choice(bounds_us) + rng.choice((-1, 0, 1))
            if rng.random() < 0.2
            else rng.randint(-50_000, 80_000_000)
            for _ in range(rng.randint(0, 5_000))
        ]
        for _ in range(6)
    ]
    got = _compared(batches)
    assert got[(f"{NAME}_count", "")] == sum(map(len, batches))
