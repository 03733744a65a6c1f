"""What the sink raises, and the one line an operator reads for each Kafka refusal.

The error's class decides what the daemon does next (``retryable``: a new session, or a
stop for the operator); its message says what Kafka refused and what to change. Kept apart
from the producer so every decision about an error code sits in one place.
"""

from __future__ import annotations

from confluent_kafka import KafkaError

from services.bridge.settings import BridgeSettings
from services.common.errors import SlotbridgeError
from services.common.kafka import explain


class SinkError(SlotbridgeError):
    """Kafka refused or lost something; the session must restart from durable progress."""

    retryable = True


class FencedError(SinkError):
    """Another bridge instance owns this slot's transactional id now."""

    retryable = False  # the newer bridge streams the slot; this one steps aside


class TopicReplaced(SinkError):
    """A topic the bridge wrote was deleted (and maybe created again) behind its back."""

    retryable = False  # what was published there is gone: only the operator can decide


class ProducerFailed(SinkError):
    """The producer hit a fatal error other than being fenced (librdkafka: INVALID_TXN_STATE
    from an abort, a lost authorization): it can commit nothing more, nor tell whether a
    successor fenced it, which the daemon must know before it starts a new session."""

    retryable = False


class ProducerStranded(SinkError):
    """The producer knows no broker any more and will not look for one (librdkafka#5301):
    it can publish nothing, abort nothing, nor tell whether a successor fenced it. Only a
    new producer, in a new session, reaches Kafka again."""

    retryable = True  # the new session's producer knows the bootstrap servers again


class KafkaRefused(SinkError):
    """Kafka refuses what the bridge must do (a topic, a record's size, a setting) and will
    refuse it again in every new session: only the operator can change that."""

    retryable = False


# Kafka errors that say nothing about the topics written: no need to check their ids.
NOT_ABOUT_TOPICS = frozenset(
    {
        KafkaError._FENCED,
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.RECORD_LIST_TOO_LARGE,
    }
)
# Records librdkafka dropped because another failed first: never the cause.
PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
_TOO_LARGE = frozenset({KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE})
_FENCED = frozenset(
    {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
)
# A right of the bridge's principal that an ACL no longer grants: every new session would
# be refused the same way, so the bridge stops (librdkafka takes some of them as fatal).
_NOT_AUTHORIZED = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
    }
)


def refusal(
    err: KafkaError | BaseException,
    settings: BridgeSettings,
    what: str,
    record: tuple[str, int],
    record_limit: int,
    sized_this_session: bool,
) -> SinkError:
    """The error for ``err``, Kafka's answer to the sink (``what`` prefixes the line).

    ``record`` is the (topic, bytes) of the record Kafka refused, if any; a record refused as
    too large is the operator's to fix (``KafkaRefused``) unless this session had made its
    topic take it (``sized_this_session``: the limit was lowered meanwhile, and a new
    session raises it again).
    """
    if not isinstance(err, KafkaError):
        return SinkError(f"{what}{explain(err)}")
    code = err.code()
    if code in _TOO_LARGE:
        topic, size = record
        if sized_this_session:
            return SinkError(
                f"{what}{err.name()}: Kafka refused a record of {size} bytes for topic "
                f"{topic}, whose max.message.bytes this session had set to take it: it was "
                "lowered meanwhile; a new session raises it again"
            )
        return KafkaRefused(
            f"{what}{err.name()}: Kafka refused a record of {size} bytes for topic {topic} "
            f"as too large: its max.message.bytes (the brokers' message.max.bytes if it "
            f"has none) must be at least {record_limit} for max_row_bytes="
            f"{settings.max_row_bytes}; set it, or lower max_row_bytes"
        )
    if code in _FENCED:
        return FencedError(
            f"another bridge took over slot {settings.slot_name} "
            f"(transactional id {settings.transactional_id}); this one stops"
        )
    if code in _NOT_AUTHORIZED:
        user = settings.kafka_config.get("sasl.username")
        principal = f"principal User:{user}" if user else "bridge's principal"
        return KafkaRefused(
            f"{what}{explain(err)} (the {principal}, transactional id "
            f"{settings.transactional_id}, topics {settings.topic_prefix}.*); "
            "start the bridge again once granted: what was not confirmed is published then"
        )
    if err.fatal():
        return producer_failed(err, settings.transactional_id)
    return SinkError(f"{what}{explain(err)}")


def producer_failed(err: KafkaError, transactional_id: str) -> ProducerFailed:
    """The one line for a fatal producer error that is not fencing (checked first)."""
    return ProducerFailed(
        f"Kafka: the transactional producer failed for good ({explain(err)}): it can commit "
        "nothing more and cannot tell whether another bridge took the slot over, so this "
        f"bridge stops; start it again once the cause is fixed: its new producer registers "
        f"transactional id {transactional_id} afresh, and what was not confirmed is published "
        "again, once"
    )
