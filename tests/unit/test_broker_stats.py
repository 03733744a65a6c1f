"""Each broker's latencies, read from a librdkafka statistics document."""

from __future__ import annotations

import json

from services.bridge.sink.broker_stats import BrokerLatency, broker_latencies, brokers_of


def _window(p50_us: int, p99_us: int, cnt: int) -> dict[str, int]:
    return {"min": 0, "max": p99_us, "avg": p50_us, "cnt": cnt, "p50": p50_us, "p99": p99_us}


def test_brokers_that_answered_requests_give_their_round_trip_and_queue_time() -> None:
    """A broker with a node id and requests in the window gives its figures in seconds;
    the bootstrap address, the coordinator's handle and an idle broker give none."""
    document = json.dumps(
        {
            "name": "rdkafka#producer-1",
            "brokers": {
                "127.0.0.1:9092/1": {
                    "nodeid": 1,
                    "rtt": _window(2_000, 40_000, 12),
                    "int_latency": _window(3_000, 55_000, 480),
                },
                "127.0.0.1:9093/2": {
                    "nodeid": 2,
                    "rtt": _window(0, 0, 0),
                    "int_latency": _window(0, 0, 0),
                },
                "127.0.0.1:9092/bootstrap": {"nodeid": -1, "rtt": _window(1_000, 1_000, 1)},
                "GroupCoordinator": {"nodeid": -1, "rtt": _window(1_000, 1_000, 1)},
            },
            "topics": {"t": {"partitions": {"0": {"broker": 1}}}},
        }
    )
    brokers = brokers_of(document)
    assert brokers is not None
    assert broker_latencies(brokers) == [
        BrokerLatency(broker="1", rtt_p50_s=0.002, rtt_p99_s=0.04, queue_p99_s=0.055)
    ]


def test_a_document_without_brokers_has_none() -> None:
    assert brokers_of(json.dumps({"name": "x", "topics": {}})) is None
