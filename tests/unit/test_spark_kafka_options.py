"""The Kafka source's options: what the job sets and what the operator may change."""

from __future__ import annotations

from spark_consumers.kafka import kafka_options
from spark_consumers.settings import ConsumerSettings


def _options(**extra: str) -> dict[str, str]:
    settings = ConsumerSettings(
        kafka_bootstrap="k:9092", warehouse="/w", checkpoint_dir="/c", kafka_options=extra
    )
    return kafka_options(settings)


def test_a_fetch_past_the_last_record_is_held_briefly_unless_the_operator_says_otherwise() -> None:
    # A read's last offset is mostly a commit marker: the fetch after the last record
    # finds none, and Kafka's default holds it 500 ms every batch (spark_consumers/kafka.py).
    assert _options()["kafka.fetch.max.wait.ms"] == "10"
    assert _options(**{"fetch.max.wait.ms": "250"})["kafka.fetch.max.wait.ms"] == "250"


def test_the_isolation_level_and_bootstrap_are_the_jobs_whatever_the_extras_say() -> None:
    options = _options(**{"isolation.level": "read_uncommitted", "bootstrap.servers": "x:1"})
    assert options["kafka.isolation.level"] == "read_committed"
    assert options["kafka.bootstrap.servers"] == "k:9092"
