"""Defaults that keep data and endpoints private, and settings written as YAML users write
them (issue #12 items 3, 15, 16)."""

from __future__ import annotations

import resource
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from services.bridge.assemble.spool import Spool, SpoolError, SpoolStats
from services.bridge.settings import BridgeSettings
from services.bridge.sink.kafka import producer_config
from services.failover.settings import FailoverSettings
from spark_consumers.settings import ConsumerSettings


def test_http_endpoints_default_to_loopback() -> None:
    bridge = BridgeSettings(source_dsn="host=a", kafka_bootstrap="k:9092")
    topology: dict[str, Any] = {"primary": {"dsn": "host=a"}, "standbys": {"b": {"dsn": "host=b"}}}
    failover = FailoverSettings(**topology)
    assert (bridge.http_host, failover.http_host) == ("127.0.0.1", "127.0.0.1")


def test_spool_defaults_to_a_folder_of_the_user(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    spool_dir = BridgeSettings(source_dsn="host=a", kafka_bootstrap="k:9092").spool_dir
    assert spool_dir == tmp_path / ".cache" / "slotbridge" / "spool"


def test_client_settings_accept_yaml_numbers_and_booleans() -> None:
    # As a YAML file gives them (typed here as Any, like the file's contents).
    yaml_values: dict[str, Any] = {"linger.ms": 5, "socket.keepalive.enable": True}
    bridge = BridgeSettings(source_dsn="host=a", kafka_bootstrap="k:9092", kafka_config=yaml_values)
    assert bridge.kafka_config == {"linger.ms": "5", "socket.keepalive.enable": "true"}
    options: dict[str, Any] = {"fetch.max.bytes": 1048576}
    conf: dict[str, Any] = {"spark.sql.ansi.enabled": False}
    consumer = ConsumerSettings(
        kafka_bootstrap="k:9092",
        warehouse="/w",
        checkpoint_dir="/c",
        kafka_options=options,
        spark_conf=conf,
    )
    assert consumer.kafka_options == {"fetch.max.bytes": "1048576"}
    assert consumer.spark_conf == {"spark.sql.ansi.enabled": "false"}


def test_kafka_config_cannot_undo_exactly_once() -> None:
    with pytest.raises(ValidationError) as caught:
        BridgeSettings(
            source_dsn="host=a",
            kafka_bootstrap="k:9092",
            kafka_config={"acks": "1", "transactional.id": "x", "compression.type": "zstd"},
        )
    message = str(caught.value)
    assert "acks, transactional.id cannot be set here" in message
    assert "use kafka_transactional_id" in message
    assert "compression.type" not in message
    # What agrees with the bridge's own settings is accepted (configs copied from elsewhere).
    agreeing = {
        "acks": "all",
        "enable.idempotence": "true",
        "partitioner": "murmur2_random",
        "allow.auto.create.topics": "false",
    }
    BridgeSettings(source_dsn="host=a", kafka_bootstrap="k:9092", kafka_config=agreeing)
    # A topic deleted under the bridge must not come back from its producer's metadata
    # requests with the broker's defaults.
    with pytest.raises(ValidationError, match="the bridge creates its topics itself"):
        BridgeSettings(
            source_dsn="host=a",
            kafka_bootstrap="k:9092",
            kafka_config={"allow.auto.create.topics": "true"},
        )


def test_kafka_config_overrides_the_producer_tuning() -> None:
    tuned = BridgeSettings(
        source_dsn="host=a", kafka_bootstrap="k:9092", kafka_config={"compression.type": "zstd"}
    )
    config = producer_config(tuned, record_limit=2_000_000)
    assert config["compression.type"] == "zstd"
    assert config["linger.ms"] == 5  # a default kept
    assert config["acks"] == "all"
    assert config["message.max.bytes"] == 2_000_000


@pytest.fixture
def file_size_limit() -> Iterator[None]:
    """Writes past 64 kB fail (EFBIG) instead of killing the process with SIGXFSZ."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_spool_write_that_fails_names_spool_dir(tmp_path: Path, file_size_limit: None) -> None:
    spool = Spool(tmp_path, "stream-1", 0, SpoolStats())
    with pytest.raises(
        SpoolError, match=f"^spool_dir {tmp_path}: File too large; check spool_dir$"
    ):
        for lsn in range(100):
            spool.append(lsn, b"x" * 4096)
    spool.discard()
