"""A producer without a broker to ask (librdkafka#5301), told from its statistics."""

from __future__ import annotations

import json
import threading
from typing import Any

from confluent_kafka import Producer

from services.bridge.sink.broker_stats import brokers_of
from services.bridge.sink.stranded import Stranding, askable_brokers


def statistics(brokers: dict[str, str], partitions: int = 2) -> str:
    """A statistics document of the shape STATISTICS.md gives: brokers by name with their
    source, then topics whose partitions name their broker too."""
    return json.dumps(
        {
            "name": "rdkafka#producer-3",
            "type": "producer",
            "brokers": {
                name: {"name": name, "nodeid": i, "source": source, "state": "UP"}
                for i, (name, source) in enumerate(brokers.items())
            },
            "topics": {
                "sb.public.orders": {
                    "topic": "sb.public.orders",
                    "partitions": {
                        str(p): {"partition": p, "broker": 1, "leader": 1}
                        for p in range(partitions)
                    },
                }
            },
        }
    )


STRANDED = statistics({"TxnCoordinator": "logical", ":0/internal": "internal"})
CONNECTED = statistics({"127.0.0.1:9092/1": "learned", "TxnCoordinator": "logical"})
BOOTSTRAPPING = statistics({"127.0.0.1:9092/bootstrap": "configured"})


def _brokers(document: str) -> dict[str, Any]:
    brokers = brokers_of(document)
    assert brokers is not None
    return brokers


def test_brokers_from_metadata_or_bootstrap_servers_can_be_asked_the_others_not() -> None:
    assert askable_brokers(_brokers(CONNECTED)) == 1
    assert askable_brokers(_brokers(BOOTSTRAPPING)) == 1
    assert askable_brokers(_brokers(STRANDED)) == 0
    assert brokers_of(json.dumps({"name": "x", "topics": {}})) is None


def test_a_real_producers_statistics_list_its_bootstrap_server() -> None:
    # No broker runs at port 1: the producer knows its bootstrap server all the same.
    documents: list[str] = []
    arrived = threading.Event()

    def seen(document: str) -> None:
        documents.append(document)
        arrived.set()

    producer = Producer(
        {
            "bootstrap.servers": "127.0.0.1:1",
            "statistics.interval.ms": 100,
            "stats_cb": seen,
            "log_level": 0,
        }
    )
    while not arrived.is_set():
        producer.poll(0.1)
    assert askable_brokers(_brokers(documents[0])) == 1


def test_stranded_counts_from_the_first_document_without_brokers_until_one_has_some() -> None:
    now = [100.0]
    stranding = Stranding(clock=lambda: now[0])
    stranding.seen(brokers_of(CONNECTED))
    now[0] += 5
    assert stranding.stranded_s() == 0
    stranding.seen(brokers_of(STRANDED))
    now[0] += 5
    stranding.seen(brokers_of(STRANDED))  # still stranded: counted from the first
    now[0] += 5
    assert stranding.stranded_s() == 10
    stranding.seen(brokers_of(BOOTSTRAPPING))  # a re-bootstrap found its servers again
    assert stranding.stranded_s() == 0
    # A document that says nothing of brokers changes nothing.
    stranding.seen(brokers_of(json.dumps({"name": "x"})))
    assert stranding.stranded_s() == 0
