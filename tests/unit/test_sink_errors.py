"""How the sink words Kafka errors (pure: no broker involved)."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException

from services.bridge.sink import _explain


def test_a_callback_system_error_is_explained_by_its_cause() -> None:
    """confluent-kafka raises SystemError("<function ...> returned a result with an
    exception set") when a callback runs while a fatal error is pending: say the error."""
    fatal = KafkaException(KafkaError(KafkaError._FENCED, "producer fenced", fatal=True))
    try:
        try:
            raise fatal
        except KafkaException as exc:
            raise SystemError("<function KafkaSink._delivered at 0x1> returned a result "
                              "with an exception set") from exc
    except SystemError as wrapped:
        text = _explain(wrapped)
    assert text == "_FENCED: producer fenced"
    assert "function" not in text
