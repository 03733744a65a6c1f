"""What the operator's one-off commands on a stopped bridge's slot share (``adopt-upgrade``,
``resync``): the slot's Kafka transactional id registered first, which fences a bridge
still running on the slot, then the slot's published progress read back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from services.bridge.progress.kafka_reader import read_kafka_progress
from services.bridge.settings import BridgeSettings
from services.bridge.sink.kafka import KafkaSink, kafka_client_config
from services.common.pg import with_password
from services.contract.records import ProgressRecord


@contextmanager
def fenced_slot(settings: BridgeSettings) -> Iterator[tuple[KafkaSink, ProgressRecord | None]]:
    """The slot's sink, its transactional id registered, and its published progress (None:
    nothing published yet); the sink is closed at the end."""
    sink = KafkaSink(settings)
    try:
        sink.start()
        yield (
            sink,
            read_kafka_progress(
                kafka_client_config(settings), settings.progress_topic, settings.slot_name
            ),
        )
    finally:
        sink.close()


def source_dsn(settings: BridgeSettings) -> str:
    secret = settings.source_password
    return with_password(settings.source_dsn, secret.get_secret_value() if secret else None)
