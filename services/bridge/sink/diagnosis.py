"""Why a call of the sink's open Kafka transaction failed: its cause, not its consequences.

librdkafka reports one failure in pieces. Once a record of a transaction fails, it purges
the records queued behind it (their delivery reports say ``_PURGE_QUEUE``), takes no more
(``_STATE``) and fails the commit; a fenced producer's calls may even fail with a bare
``SystemError``. Reported as they come, a takeover would read as an outage and the bridge
would reconnect and fence its successor in turn. So every error the sink raises is first
traced back here to the one that caused it, and only then given its line
(``errors.refusal``). Kept apart from sending and committing (``kafka.KafkaSink``), which
only record what this needs in ``OpenTransaction``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from services.bridge.settings import BridgeSettings
from services.bridge.sink.errors import NOT_ABOUT_TOPICS, PURGED, SinkError, refusal
from services.bridge.sink.topics import Topics
from services.common.kafka import cause


@dataclass(slots=True)
class OpenTransaction:
    """What the sink knows of its open Kafka transaction that explains a failure."""

    open: bool = False
    began: float = 0.0  # monotonic
    # Whether it is ``KafkaSink.prove_not_fenced``'s, which holds no change to publish.
    probing: bool = False
    # The first failed record's delivery report that is a cause (not a purge), and that
    # record's topic and size.
    failure: KafkaError | None = None
    failed_record: tuple[str, int] | None = None

    def delivered(self, err: KafkaError | None, msg: Any) -> None:
        """The producer's ``on_delivery`` (failures only). After one record fails, the
        producer purges those queued behind it and may report them first: the purge is the
        consequence, the other error the cause."""
        if err is not None and (self.failure is None or self.failure.code() in PURGED):
            self.failure = err
            self.failed_record = (msg.topic(), len(msg.value() or b""))


class Diagnosis:
    """Turns what a producer call raised into the ``SinkError`` of its cause."""

    def __init__(
        self, producer: Producer, settings: BridgeSettings, topics: Topics, txn: OpenTransaction
    ) -> None:
        self._producer = producer
        self._settings = settings
        self._topics = topics
        self._txn = txn

    def delivery_failed(self) -> SinkError:
        """The error of the open transaction's failed record (``OpenTransaction.failure``)."""
        assert self._txn.failure is not None
        return self.classify(self._txn.failure, "Kafka delivery failed: ")

    def transaction_failed(self, err: KafkaError) -> SinkError | None:
        """Why the open transaction failed, where ``err`` says only that it did: the failed
        record's own delivery report, else the transaction's error. None when nothing says
        more than ``err``."""
        self._producer.flush(self._settings.kafka_transaction_timeout_ms / 1000)  # the reports
        failure = self._txn.failure
        if failure is not None and failure.code() not in PURGED:
            return self.delivery_failed()
        why = self._transaction_error()
        if why is not None and why.code() != err.code():
            return self.classify(why)
        return None

    def classify(
        self,
        exc: KafkaException | KafkaError | SystemError,
        what: str = "Kafka: ",
        record: tuple[str, int] | None = None,
    ) -> SinkError:
        """The error to raise for ``exc`` (``what`` prefixes its line; ``record``: the topic
        and size of the record it refused, if any)."""
        txn = self._txn
        timeout_ms = self._settings.kafka_transaction_timeout_ms
        age = time.monotonic() - txn.began
        if txn.open and age * 1000 > timeout_ms:
            return self._timed_out(age)
        # A fenced producer's error often comes as a bare SystemError, or only as its
        # record's purge (_PURGE_QUEUE, the consequence): the producer's fatal error is the
        # cause, or the bridge would reconnect and fence the bridge that fenced it, in turn.
        err = cause(exc)
        if isinstance(err, SystemError) or (isinstance(err, KafkaError) and err.code() in PURGED):
            err = self._fatal_error() or err
        if isinstance(err, KafkaError) and err.code() not in NOT_ABOUT_TOPICS:
            # A topic deleted under a transaction fails it in more ways than one (a
            # partition that cannot join it, a purged queue, an abort the broker refuses):
            # TopicReplaced if a topic's id changed. A check that fails leaves the error be.
            self._topics.check_ids_briefly()
        if (
            isinstance(err, KafkaError)
            and err.code() == KafkaError._STATE
            and txn.open
            and err is not txn.failure
        ):
            known = self.transaction_failed(err)
            if known is not None:
                return known
        topic, size = record or txn.failed_record or ("?", 0)
        # A topic this session made ready had its limit fitted (Topics.ensure).
        fitted = topic in self._topics.ready
        return refusal(err, self._settings, what, (topic, size), self._topics.record_limit, fitted)

    def _timed_out(self, age: float) -> SinkError:
        """The coordinator aborts a transaction open past its timeout and fences the
        producer: the error then reads "fenced", but nobody else took over. The brokers may
        also not have answered at all (down, cut off): then nobody has aborted it yet, and
        the coordinator will once it can."""
        timeout_ms = self._settings.kafka_transaction_timeout_ms
        if self._txn.probing:
            return SinkError(
                f"the check for a newer bridge held its Kafka transaction open {age:.0f}s, "
                f"past kafka_transaction_timeout_ms ({timeout_ms} ms), so the broker "
                "aborts it; it held one record, which the brokers acknowledged slowly or "
                "not at all: the earlier warnings say why"
            )
        return SinkError(
            f"the Kafka transaction was open {age:.0f}s, past kafka_transaction_timeout_ms "
            f"({timeout_ms} ms), so the broker aborts it; a new session publishes what it "
            "held again. If the brokers acknowledged slowly or not at all, the earlier "
            "warnings say why; if they are healthy, raise kafka_transaction_timeout_ms (at "
            "most the brokers' transaction.max.timeout.ms) for batches this large"
        )

    def _fatal_error(self) -> KafkaError | None:
        """The producer's fatal error, where a call failed without naming any: confluent-kafka
        can raise a bare SystemError ("returned NULL without setting an exception"), most
        likely when an exception a callback raised during the call was cleared before the
        call returned (a fenced bridge's fence check failed that way under CPU load, and
        its one line said "Kafka: <method 'flush' ...>" instead of who took the slot
        over). None outside a transaction (asking would start one) and when the producer
        holds no fatal error."""
        if not self._txn.open:
            return None
        err = self._begin_answer()
        return err if err is not None and err.fatal() else None

    def _transaction_error(self) -> KafkaError | None:
        """The error the open transaction failed with where no record's report has it (a
        partition the coordinator would not add to it: TOPIC_AUTHORIZATION_FAILED)."""
        err = self._begin_answer()
        return err if err is not None and err.txn_requires_abort() else None

    def _begin_answer(self) -> KafkaError | None:
        """What begin_transaction answers within the open transaction, where it starts
        nothing: a fatal producer its fatal error, a failed transaction its error, any
        other _STATE."""
        try:
            self._producer.begin_transaction()
        except (KafkaException, SystemError) as exc:
            err = cause(exc)
            return err if isinstance(err, KafkaError) else None
        return None
