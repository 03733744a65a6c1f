"""How the sink words Kafka errors (pure: no broker involved)."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException, Message

from services.bridge.sink.diagnosis import OpenTransaction
from services.common.kafka import explain


def test_a_callback_system_error_is_explained_by_its_cause() -> None:
    """confluent-kafka raises SystemError("<function ...> returned a result with an
    exception set") when a callback runs while a fatal error is pending: say the error."""
    fatal = KafkaException(KafkaError(KafkaError._FENCED, "producer fenced", fatal=True))
    try:
        try:
            raise fatal
        except KafkaException as exc:
            raise SystemError(
                "<function OpenTransaction.delivered at 0x1> returned a result with an exception "
                "set"
            ) from exc
    except SystemError as wrapped:
        text = explain(wrapped)
    assert text == "_FENCED: producer fenced"
    assert "function" not in text


def test_known_errors_say_what_to_do() -> None:
    text = explain(KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)))
    assert text.startswith("TOPIC_AUTHORIZATION_FAILED: Broker: Topic authorization failed; ")
    assert "grant" in text and "KafkaError{" not in text


def test_a_failed_records_report_is_kept_over_the_purges_it_causes() -> None:
    """Once a record fails, librdkafka purges those queued behind it and may report the
    purges first: the open transaction keeps the cause, whichever came first, and the
    record it was about (a takeover reported as its purge read as an outage)."""
    purged = KafkaError(KafkaError._PURGE_QUEUE)
    fenced = KafkaError(KafkaError._FENCED, "producer fenced", fatal=True)
    later = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)

    txn = OpenTransaction()
    txn.delivered(None, Message(topic="ok", value=b"x"))  # a success reports nothing
    assert txn.failure is None
    txn.delivered(purged, Message(topic="behind", value=b"12"))
    txn.delivered(fenced, Message(topic="cause", value=b"123"))
    txn.delivered(later, Message(topic="after", value=b"1234"))
    assert txn.failure is fenced and txn.failed_record == ("cause", 3)

    first = OpenTransaction()
    first.delivered(fenced, Message(topic="cause", value=None))
    first.delivered(purged, Message(topic="behind", value=b"12"))
    assert first.failure is fenced and first.failed_record == ("cause", 0)
