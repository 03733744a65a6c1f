"""How the sink words Kafka errors (pure: no broker involved)."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

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
