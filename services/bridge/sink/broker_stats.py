"""What librdkafka's statistics say of each broker the producer talks to.

librdkafka hands the producer a statistics document every ``statistics.interval.ms``
(STATISTICS.md): per broker, among much else, the round trip of its requests and how long
records waited in the producer before they were sent, as percentiles over the interval.
A Kafka commit is several round trips in a row, so these are what a slow commit is made of
(docs/performance.md, "The `oltp` latency bench's p99 was its own consumer's start").
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_BROKERS_KEY = re.compile(r'"brokers"\s*:\s*')
_DECODER = json.JSONDecoder()
_US = 1e-6


def brokers_of(statistics: str) -> dict[str, Any] | None:
    """The ``brokers`` object of a statistics document; None when it has none."""
    # Only the brokers object is decoded: the callback runs in the publisher's thread, and a
    # bridge with many topics emits a large document whose partitions say nothing here
    # (600 partitions, 413 kB: json.loads 2.7 ms, this 3 us). Topic names cannot hold a
    # quote and a string value's quotes are escaped, so the key matches once, the top
    # level's.
    key = _BROKERS_KEY.search(statistics)
    if key is None:
        return None
    brokers, _end = _DECODER.raw_decode(statistics, key.end())
    return brokers if isinstance(brokers, dict) else None


@dataclass(frozen=True)
class BrokerLatency:
    """One broker's figures over the last statistics interval, in seconds."""

    broker: str  # its node id
    rtt_p50_s: float
    rtt_p99_s: float
    queue_p99_s: float  # records' wait in the producer before being sent (linger.ms included)


def broker_latencies(brokers: dict[str, Any]) -> list[BrokerLatency]:
    """The brokers (node id >= 0: not a bootstrap address nor the coordinator's handle)
    that answered requests during the interval."""
    found = []
    for broker in brokers.values():
        rtt, queue = broker.get("rtt") or {}, broker.get("int_latency") or {}
        if broker.get("nodeid", -1) < 0 or not rtt.get("cnt"):
            continue
        found.append(
            BrokerLatency(
                broker=str(broker["nodeid"]),
                rtt_p50_s=rtt["p50"] * _US,
                rtt_p99_s=rtt["p99"] * _US,
                queue_p99_s=queue.get("p99", 0) * _US,
            )
        )
    return found
