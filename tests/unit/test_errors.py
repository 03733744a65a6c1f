"""What the daemon does with each error (retry in a new session, or stop), and how an
error that ends it is logged: pure, no server."""

from __future__ import annotations

import io
import json
import logging
import signal

import psycopg
import pytest
from confluent_kafka import KafkaError, KafkaException

from services.bridge.assemble.assembler import AssemblyError
from services.bridge.assemble.spool import SpoolError
from services.bridge.daemon import Bridge, retry_session
from services.bridge.decode.decoder import DecodeError
from services.bridge.progress.highwater import IdentityError
from services.bridge.progress.kafka_reader import TopicReadError, _scan
from services.bridge.progress.record import ProgressRecordError
from services.bridge.publish.publisher import GapError
from services.bridge.receive.stream import StreamError
from services.bridge.records.events import RowTooLarge
from services.bridge.records.masking import MaskingRefused
from services.bridge.records.routing import RoutingRefused
from services.bridge.settings import BridgeSettings
from services.bridge.sink.errors import (
    FencedError,
    KafkaRefused,
    ProducerFailed,
    ProducerStranded,
    SinkError,
    TopicReplaced,
)
from services.bridge.slot import SlotBusy
from services.common.errors import SlotbridgeError
from services.common.failpoints import FailpointError
from services.common.httpserver import HttpServerError
from services.common.kafka import KafkaUnreachable
from services.common.logs import JsonFormatter, TextFormatter, log_failure
from services.common.pg import SourceError, SourceRefused
from services.common.settings import SettingsError
from services.failover.promote import PromoteError
from slotbridge_dev.stack.cluster import StackError
from spark_consumers.batch import TableRefused

# Every error of ours, and whether a new session may get past it. Listed here on purpose:
# adding an error class means deciding this, and the test below fails until it is listed.
RETRYABLE: dict[type[SlotbridgeError], bool] = {
    AssemblyError: True,
    DecodeError: False,
    FailpointError: False,
    FencedError: False,
    GapError: False,
    HttpServerError: False,
    IdentityError: True,
    KafkaRefused: False,
    ProducerFailed: False,
    ProducerStranded: True,
    TopicReplaced: False,
    KafkaUnreachable: True,
    ProgressRecordError: False,
    PromoteError: False,
    RowTooLarge: False,
    MaskingRefused: False,
    RoutingRefused: False,
    SettingsError: False,
    SinkError: True,
    SlotBusy: True,
    SourceError: True,
    SourceRefused: False,
    SpoolError: False,
    StackError: False,
    StreamError: True,
    TableRefused: False,
    TopicReadError: True,
}


def _subclasses(cls: type[SlotbridgeError]) -> set[type[SlotbridgeError]]:
    direct = set(cls.__subclasses__())
    return direct.union(*(_subclasses(sub) for sub in direct))


def _instance(cls: type[BaseException]) -> BaseException:
    """An instance without running ``__init__`` (some take a server and a record)."""
    return cls.__new__(cls)


def test_every_error_sets_its_flag_in_its_own_definition() -> None:
    assert _subclasses(SlotbridgeError) == set(RETRYABLE)
    for cls in RETRYABLE:
        assert isinstance(cls.__dict__.get("retryable"), bool), cls


@pytest.mark.parametrize("cls", list(RETRYABLE), ids=[c.__name__ for c in RETRYABLE])
def test_the_daemon_retries_an_error_after_streaming_by_its_flag(
    cls: type[SlotbridgeError],
) -> None:
    assert retry_session(_instance(cls), streamed=True) is RETRYABLE[cls]


def test_before_the_first_stream_only_a_busy_slot_is_waited_out() -> None:
    """At start-up a failure is far more often a typo than an outage."""
    retried = {cls for cls in RETRYABLE if retry_session(_instance(cls), streamed=False)}
    assert retried == {SlotBusy}
    assert not retry_session(psycopg.OperationalError("gone"), streamed=False)


def test_driver_outages_are_retried_and_bugs_are_not() -> None:
    assert retry_session(psycopg.OperationalError("server closed the connection"), streamed=True)
    assert retry_session(KafkaException(KafkaError(KafkaError._TRANSPORT)), streamed=True)
    assert not retry_session(psycopg.ProgrammingError("syntax error"), streamed=True)
    assert not retry_session(ValueError("bug"), streamed=True)


class _SilentConsumer:
    """A consumer whose broker never answers."""

    def assign(self, partitions: object) -> None:
        pass

    def poll(self, timeout: float) -> None:
        return None


def test_a_kafka_read_timeout_is_its_own_retryable_error() -> None:
    """Not an IdentityError ("contradicts the server"): a slow broker is waited out."""
    with pytest.raises(TopicReadError, match=r"^timed out reading topic t$") as raised:
        list(_scan(_SilentConsumer(), "t", 0, 10, timeout_s=0))  # type: ignore[arg-type]
    assert retry_session(raised.value, streamed=True)


def _logged(exc: BaseException, formatter: logging.Formatter) -> str:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    logger = logging.getLogger("tests.errors")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        log_failure(logger, exc)
    finally:
        logger.removeHandler(handler)
    return out.getvalue()


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_a_bug_is_logged_with_its_one_line_and_its_traceback() -> None:
    bug = _raised(KeyError("no such column\nsecond line"))
    line = json.loads(_logged(bug, JsonFormatter()))
    assert line["level"] == "error"
    assert line["msg"] == "'no such column\\nsecond line'"
    assert line["error"] == "KeyError"
    assert line["exc"].startswith("Traceback (most recent call last)")
    assert "in _raised" in line["exc"]
    text = _logged(bug, TextFormatter())
    assert "ERROR" in text.splitlines()[0] and "Traceback" in text


@pytest.mark.parametrize(
    "exc",
    [
        SourceRefused("the bridge's role may not call f\nDETAIL: more"),
        psycopg.OperationalError("connection refused\n\tIs the server running?"),
        KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down")),
    ],
    ids=lambda exc: type(exc).__name__,
)
def test_our_errors_and_outages_are_one_line_without_traceback(exc: BaseException) -> None:
    logged = _logged(_raised(exc), JsonFormatter())
    assert len(logged.splitlines()) == 1
    line = json.loads(logged)
    assert "exc" not in line and "\n" not in line["msg"]
    assert line["error"] == type(exc).__name__


def test_the_daemon_logs_an_unexpected_error_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    bridge = Bridge(BridgeSettings(source_dsn="host=a", kafka_bootstrap="k:9092", http_port=0))

    def session() -> None:
        raise TypeError("unsupported operand")

    bridge._session = session  # type: ignore[method-assign]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with caplog.at_level(logging.ERROR, logger="services.bridge.daemon"):
            assert bridge.run() == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    (record,) = caplog.records
    assert record.getMessage() == "unsupported operand"
    assert record.exc_info is not None and record.exc_info[0] is TypeError
