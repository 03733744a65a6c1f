"""Is Kafka there? Asked before Spark starts, because Spark's Kafka source waits minutes
for an absent broker and then fails with Java and Python traces.

``kafka_options`` are the Java client's settings (``sasl.jaas.config``, JKS trust stores),
which the Python client cannot use. Without them (a PLAINTEXT listener) the check is a
real metadata request; with them it is a TCP connection to a bootstrap server, which
still catches an unreachable or mistyped address in seconds.
"""

from __future__ import annotations

import socket

from services.common.kafka import KafkaUnreachable, check_reachable
from spark_consumers.settings import ConsumerSettings

TIMEOUT_S = 10.0


def check_kafka(settings: ConsumerSettings) -> None:
    """Raise ``KafkaUnreachable`` (one line) when Kafka does not answer."""
    protocol = settings.kafka_options.get("security.protocol", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        check_reachable(
            {"bootstrap.servers": settings.kafka_bootstrap},
            TIMEOUT_S,
            "kafka_bootstrap and kafka_options' security.protocol",
        )
        return
    errors = []
    for server in settings.kafka_bootstrap.split(","):
        host, _, port = server.strip().rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), TIMEOUT_S).close()
            return
        except (OSError, ValueError) as exc:
            errors.append(f"{server.strip()}: {exc}")
    raise KafkaUnreachable(
        f"Kafka at {settings.kafka_bootstrap} accepts no connection "
        f"({'; '.join(errors)}); check kafka_bootstrap"
    )
