"""librdkafka's repeated lines, logged once per interval (services/common/kafka.py), and
which of its levels reach the log (services/common/logs.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from services.common.kafka import KafkaLog
from services.common.logs import setup_logging

_FAIL = (
    "FAIL [rdkafka#producer-%d] [thrd:h:1/bootstrap]: h:1/bootstrap: Connect to "
    "ipv4#127.0.0.1:1 failed: Connection refused (after %dms in state CONNECT)"
)


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_repeats_are_held_back_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    kafka_log = KafkaLog(logging.getLogger("kafka.test"), interval_s=60, clock=clock)
    with caplog.at_level(logging.ERROR, "kafka.test"):
        for attempt in range(90):
            kafka_log.log(logging.ERROR, "%s", _FAIL % (1 + attempt % 2, attempt))
        kafka_log.log(logging.ERROR, "%s", "another problem")
        clock.now = 61
        kafka_log.log(logging.ERROR, "%s", _FAIL % (1, 5))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert lines[1] == "another problem"
    assert lines[2].endswith("(repeated 89 times in the last 60s)")


def test_levels_below_the_logger_are_dropped_before_any_work(
    caplog: pytest.LogCaptureFixture,
) -> None:
    target = logging.getLogger("kafka.test.quiet")
    target.setLevel(logging.WARNING)
    KafkaLog(target).log(logging.DEBUG, "%s", "chatter")
    assert not caplog.records


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """The root logger's handlers and level and the kafka logger's level, set back."""
    root, kafka = logging.getLogger(), logging.getLogger("kafka")
    handlers, root_level, kafka_level = root.handlers[:], root.level, kafka.level
    yield
    root.handlers[:] = handlers
    root.setLevel(root_level)
    kafka.setLevel(kafka_level)


@pytest.mark.usefixtures("logging_restored")
def test_librdkafka_debug_lines_pass_only_at_debug() -> None:
    """librdkafka's debug contexts (kafka_config "debug") reach the log at DEBUG only."""
    kafka = logging.getLogger("kafka")
    setup_logging("text", "INFO")
    assert not kafka.isEnabledFor(logging.INFO)
    assert kafka.isEnabledFor(logging.WARNING)
    setup_logging("text", "DEBUG")
    assert kafka.isEnabledFor(logging.DEBUG)
