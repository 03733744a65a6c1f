"""The transactional sink against the real broker: what Kafka refuses must fail the commit."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import KafkaError

# Their public home, confluent_kafka.admin (its stubs do not declare the re-export).
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AdminClient,
    NewTopic,
)

from services.bridge.records.events import Record
from services.bridge.settings import BridgeSettings
from services.bridge.sink.errors import FencedError, KafkaRefused, ProducerFailed, SinkError
from services.bridge.sink.kafka import KafkaSink, kafka_client_config
from services.bridge.sink.topics import Topics
from slotbridge_dev.stack.kafka import Kafka
from slotbridge_dev.stack.kafka_proxy import INVALID_TXN_STATE, KafkaFaultProxy
from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import read_topics, wait_for


def _settings(
    stack: Stack, name: str, bootstrap: str | None = None, **extra: object
) -> BridgeSettings:
    return BridgeSettings(
        source_dsn="host=unused",
        kafka_bootstrap=bootstrap or stack.kafka_bootstrap,
        slot_name=name,
        topic_prefix=name,
        http_port=0,
        **extra,  # type: ignore[arg-type]
    )


def test_refused_record_aborts_the_transaction(stack: Stack) -> None:
    """Only failed deliveries are reported to Python; the commit must still hear of them,
    and say in one line which topic refused what (a fatal error: no retry changes it)."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    # A topic made elsewhere with a small record limit: the broker refuses our big record.
    admin.create_topics([NewTopic(name, 1, 1, config={"max.message.bytes": "2000"})])[name].result()
    sink = KafkaSink(_settings(stack, name))
    try:
        sink.start()
        sink.begin()  # not through topics.ensure, which would raise the topic's limit
        sink.produce(name, b"k", b'"small"')
        # Random, so that compression cannot bring it under the limit.
        sink.produce(name, b"k", b'"%s"' % base64.b64encode(os.urandom(50_000)))
        # Purged when the big one fails: the purge must not hide the broker's reason.
        for n in range(200):
            sink.produce(name, b"k%d" % n, b'"behind it"')
        with pytest.raises(
            KafkaRefused, match="Kafka delivery failed: MSG_SIZE_TOO_LARGE"
        ) as refused:
            sink.commit()
    finally:
        sink.close()  # aborts
    assert read_topics(stack.kafka, [name]) == []  # nothing of it is visible
    text = str(refused.value)
    assert f"topic {name}" in text and "max.message.bytes" in text and "\n" not in text


def test_transaction_open_past_its_timeout_says_so(stack: Stack) -> None:
    """The broker aborts it and fences the producer; the error must name the setting, not
    blame another bridge."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(_settings(stack, name, kafka_transaction_timeout_ms=1000))
    try:
        sink.start()
        sink.topics.ensure({name: False})
        sink.begin()
        deadline = time.monotonic() + 60  # the broker looks for expired ones every 10s
        with pytest.raises(SinkError, match="past kafka_transaction_timeout_ms") as caught:
            while time.monotonic() < deadline:
                sink.produce(name, b"k", b'"v"')
                time.sleep(0.2)
        assert not isinstance(caught.value, FencedError)
    finally:
        sink.close()
    assert read_topics(stack.kafka, [name]) == []


def test_records_keep_their_order_across_both_paths(stack: Stack) -> None:
    """Runs of plain records go to librdkafka in one call each (produce_batch), the others
    (with headers, or while its queue is full: 500 records here) through produce(). Per
    partition, Kafka must hold them exactly in the order given."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(_settings(stack, name, kafka_config={"queue.buffering.max.messages": "500"}))
    topics = [f"{name}.a", f"{name}.b"]
    records: list[Record] = []
    for n in range(20_000):
        topic = topics[(n // 700) % 2]  # runs of 700 records per topic
        key = None if n % 97 == 0 else b'{"id":%d}' % n
        value = None if n % 89 == 0 else b'{"n":%d}' % n
        records.append((topic, key, value, [("h", b"%d" % n)] if n % 53 == 0 else None))
    try:
        sink.start()
        sink.begin()
        assert sink.produce_all(iter(records), ()) == len(records)
        sink.commit()
    finally:
        sink.close()
    got = read_topics(stack.kafka, topics)
    for topic in topics:
        expected = [
            (None if k is None else json.loads(k), None if v is None else json.loads(v))
            for t, k, v, _ in records
            if t == topic
        ]
        assert [(r.key, r.value) for r in got if r.topic == topic] == expected


def test_refusal_of_a_record_sent_in_a_run_is_named(stack: Stack) -> None:
    """A record handed over in a run (produce_batch) keeps its delivery report: when the
    broker refuses it, the commit fails naming the record's topic, size and cause, and
    nothing of the transaction is visible."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    admin.create_topics([NewTopic(name, 1, 1, config={"max.message.bytes": "2000"})])[name].result()
    big = b'"%s"' % base64.b64encode(os.urandom(50_000))
    sink = KafkaSink(_settings(stack, name))
    try:
        sink.start()
        sink.begin()  # not through topics.ensure, which would raise the topic's limit
        sink.produce(name, b"k", b'"small"')  # the partition's first write: now proven
        sink.produce_all(iter([(name, b"k", big, None), (name, b"k", b'"behind"', None)]), ())
        with pytest.raises(KafkaRefused) as failed:
            sink.commit()
    finally:
        sink.close()  # aborts
    _assert_too_large_and_nothing_visible(failed.value, len(big), name, stack.kafka)


def _assert_too_large_and_nothing_visible(
    error: KafkaRefused, size: int, topic: str, kafka: Kafka
) -> None:
    """The refusal names its cause, the record's size and topic in one line, and nothing
    of the aborted transaction is visible."""
    text = str(error)
    assert "MSG_SIZE_TOO_LARGE" in text and f"{size} bytes for topic {topic}" in text
    assert "\n" not in text
    assert read_topics(kafka, [topic]) == []


def test_records_behind_a_refused_one_fail_the_transaction_with_its_cause(stack: Stack) -> None:
    """Once a record of the transaction failed, librdkafka takes no more (``_STATE``): a
    record sent through produce() behind one refused in a run (these carry headers) must
    fail with the refused record's cause, never as a bare state error."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    admin.create_topics([NewTopic(name, 1, 1, config={"max.message.bytes": "2000"})])[name].result()
    big = b'"%s"' % base64.b64encode(os.urandom(50_000))
    behind: list[Record] = [
        (name, b"k%d" % n, b'"behind"', [("h", b"%d" % n)]) for n in range(2000)
    ]
    sink = KafkaSink(_settings(stack, name))
    try:
        sink.start()
        sink.begin()  # not through topics.ensure, which would raise the topic's limit
        sink.produce(name, b"k", b'"small"')  # the partition's first write: now proven
        # The produce() path raises the topic's limit on its way (topics.ensure), after the
        # refusal: the error then reads as a limit lowered under the session (retryable).
        with pytest.raises(SinkError, match=f"MSG_SIZE_TOO_LARGE.*{len(big)} bytes for topic"):
            sink.produce_all(iter([(name, b"k", big, None), *behind]), ())
            time.sleep(1)  # the refusal is in by now, whichever call hears of it
            sink.produce_all(iter(behind), ())
            sink.commit()
    finally:
        sink.close()  # aborts
    assert read_topics(stack.kafka, [name]) == []


def test_a_record_with_headers_refused_by_the_producer_is_named(stack: Stack) -> None:
    """A record with headers for a proven topic is handed to librdkafka on its own, inside
    the batch path's loop: when librdkafka refuses it at once (larger than the producer's
    message.max.bytes), the error names its topic and size in one line, as for any other
    record, and nothing of the transaction is visible."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    admin.create_topics([NewTopic(name, 1, 1)])[name].result()
    sink = KafkaSink(_settings(stack, name))
    try:
        sink.start()
        sink.begin()
        sink.produce(name, b"k", b'"small"')  # the partition's first write: now proven
        huge = b'"%s"' % (b"x" * (max(sink.topics.record_limit, 1_000_000) + 1000))
        record: Record = (name, b"k", huge, [("h", b"1")])
        with pytest.raises(KafkaRefused) as refused:
            sink.produce_all(iter([record]), ())
    finally:
        sink.close()  # aborts
    _assert_too_large_and_nothing_visible(refused.value, len(huge), name, stack.kafka)


def test_a_first_write_waits_for_a_coordinator_that_does_not_know_its_topic(
    stack: Stack,
) -> None:
    """A transaction coordinator whose metadata lacks a topic (just created, on a cluster
    where the coordinator's metadata lags) answers UNKNOWN_TOPIC_OR_PARTITION for its
    partitions and OPERATION_NOT_ATTEMPTED for the others asked with them, adding none.
    librdkafka waits while the first comes first, but takes a not-attempted one read first
    for an abortable error, and the abort's refusal (INVALID_TXN_STATE: the transaction
    holds no partition) for a fatal one: a CI run lost its bridge so. A first write joins
    the transaction alone, behind a run of records to eight proven partitions: the
    transaction waits until the coordinator knows the topic, and commits."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    known, late = f"{name}.known", f"{name}.late"
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    admin.create_topics([NewTopic(known, 8, 1), NewTopic(late, 1, 1)])[late].result()
    wait_for(lambda: _leaders(admin, known) == 8 and _leaders(admin, late) == 1, 60, "leaders")
    keyed = [(known, b'{"id":%d}' % n, b'"%d"' % n, None) for n in range(200)]
    proxy = KafkaFaultProxy(stack.kafka_bootstrap, coordinator_lag=(late, 2.0)).start()
    sink = KafkaSink(_settings(stack, name, bootstrap=proxy.bootstrap))
    try:
        sink.start()
        sink.begin()
        for record in keyed:  # every partition of ``known`` written: proven
            sink.produce(*record)
        sink.commit()
        sink.begin()
        sink.produce_all(iter(keyed), ())  # a run, handed over by the next call
        sink.produce(late, b'{"id":0}', b'"late"')
        sink.commit()
    finally:
        sink.close()
        proxy.stop()
    assert proxy.stats.masked_requests > 0  # the coordinator did not know it, for a while
    assert proxy.stats.masked_with_others == 0
    assert len(_values(stack, known)) == 2 * len(keyed)
    assert _values(stack, late) == ["late"]


def _leaders(admin: AdminClient, topic: str) -> int:
    """How many of the topic's partitions have a leader."""
    found = admin.list_topics(topic, timeout=10).topics.get(topic)
    return sum(p.leader >= 0 for p in found.partitions.values()) if found else 0


def _values(stack: Stack, topic: str) -> list[object]:
    return [r.value for r in read_topics(stack.kafka, [topic])]


def test_abort_refused_as_invalid_txn_state_stops_in_one_line(stack: Stack) -> None:
    """An abort answered INVALID_TXN_STATE leaves librdkafka's producer failed for good:
    every later call fails the same way. After a broken session the daemon asks this
    producer whether a successor fenced it (``prove_not_fenced``) before it starts another,
    and kept asking forever while that failed as retryable: it must be a stop in one line.
    The broker aborted the transaction (the fault proxy changes only the answer), so a new
    producer on the same transactional id, which a restart makes, publishes again."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    proxy = KafkaFaultProxy(stack.kafka_bootstrap, refuse_aborts=INVALID_TXN_STATE).start()
    sink = KafkaSink(_settings(stack, name, bootstrap=proxy.bootstrap))
    try:
        sink.start()
        sink.topics.ensure({name: False})
        sink.begin()
        sink.produce(name, b'{"id":1}', b'"aborted"')
        sink.abort()  # logged only: the session is ending anyway
        assert proxy.stats.refused_aborts == 1
        with pytest.raises(ProducerFailed) as failed:
            sink.prove_not_fenced()
    finally:
        sink.close()
        proxy.stop()
    assert not failed.value.retryable
    text = str(failed.value)
    assert "INVALID_TXN_STATE" in text and "start it again" in text and "\n" not in text
    again = KafkaSink(_settings(stack, name))
    try:
        again.start()
        again.begin()
        again.produce(name, b'{"id":1}', b'"after"')
        again.commit()
    finally:
        again.close()
    assert _values(stack, name) == ["after"]


def test_abort_that_timed_out_is_finished_before_the_next_transaction(stack: Stack) -> None:
    """An abort while Kafka is unreachable times out, and librdkafka then refuses every
    other transactional call (_CONFLICT, retriable) until that abort is called again: the
    daemon's "was I fenced?" question failed that way forever once Kafka was back. The
    next transaction must finish the abort first, then publish."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    proxy = KafkaFaultProxy(stack.kafka_bootstrap).start()
    settings = _settings(stack, name, bootstrap=proxy.bootstrap)
    sink = KafkaSink(settings)
    try:
        sink.start()
        sink.topics.ensure({name: False, settings.progress_topic: True})
        sink.begin()
        sink.produce(name, b'{"id":1}', b'"aborted"')
        proxy.block()
        sink.abort()  # times out: logged, left to be finished
        proxy.block(False)
        sink.prove_not_fenced()
        sink.begin()
        sink.produce(name, b'{"id":1}', b'"after"')
        sink.commit()
    finally:
        sink.close()
        proxy.stop()
    assert _values(stack, name) == ["after"]


@contextlib.contextmanager
def _fenceable(settings: BridgeSettings) -> Iterator[tuple[KafkaSink, Callable[[], None]]]:
    """A started sink with its progress topic, and what fences it: a successor registering
    the same transactional id. Both are closed at the end."""
    sink = KafkaSink(settings)
    successors: list[KafkaSink] = []

    def fence() -> None:
        successors.append(KafkaSink(settings))
        successors[-1].start()

    try:
        sink.start()
        sink.topics.ensure({settings.progress_topic: True})
        yield sink, fence
    finally:
        sink.close()
        for successor in successors:
            successor.close()


def test_a_fenced_producer_named_by_a_call_that_fails_without_saying_why(stack: Stack) -> None:
    """confluent-kafka can fail a call with a bare SystemError ("returned NULL without
    setting an exception") once the producer is fenced: CI saw a losing bridge's fence check
    end on such a flush under CPU load and report "Kafka: <method 'flush' ...>" instead of
    the takeover. Whatever call failed that way, the error must be the fencing. The
    producer is fenced for real here; the bare SystemError cannot be provoked on demand, so
    it is handed to the classification as the flush raised it, and so is the purge of the
    fenced producer's record, the delivery report a probe of such a producer gets."""
    settings = _settings(stack, f"sink{uuid.uuid4().hex[:8]}")
    with _fenceable(settings) as (sink, fence):
        sink.begin()
        fence()
        # The first write to a partition makes the producer ask the coordinator to add it
        # to the transaction, which answers that a newer producer holds the id.
        with pytest.raises(FencedError):
            sink.produce(settings.progress_topic, b"fenced", None)
        bare = SystemError(
            "<method 'flush' of 'cimpl.Producer' objects> returned NULL without setting an "
            "exception"
        )
        assert isinstance(sink.diagnosis.classify(bare), FencedError)
        # Its record's delivery report, the purge: a bridge once stopped with that as a
        # plain SinkError, taken for an outage, instead of the takeover.
        purged = KafkaError(KafkaError._PURGE_QUEUE)
        assert isinstance(sink.diagnosis.classify(purged, "Kafka delivery failed: "), FencedError)


def test_the_fence_check_answers_after_the_broker_restarts(stack: Stack) -> None:
    """An idle bridge asks every 5 s whether a successor fenced it, and a bridge whose
    stream broke asks before anything else. Asked with a consumer-group offset, librdkafka
    2.16 waited past the call's timeout, for good, once the broker had restarted
    (confluentinc/librdkafka#5511): a soak's bridge stood silent after a broker restart and
    a failover. The check must end within its timeout after a restart, still tell a fenced
    producer, and leave nothing a read_committed reader sees."""
    name = f"sink{uuid.uuid4().hex[:8]}"
    timeout_s = 60
    settings = _settings(stack, name, kafka_transaction_timeout_ms=timeout_s * 1000)
    with _fenceable(settings) as (sink, fence):
        sink.prove_not_fenced()
        stack.kafka.stop()
        stack.kafka.start()
        stack.kafka.wait_ready()
        # In a thread: the old check never returned, and this test must say so rather
        # than wait for it. Twice the check's own timeout is its bound, whatever the load.
        outcome: list[BaseException | None] = []

        def check() -> None:
            try:
                sink.prove_not_fenced()
                outcome.append(None)
            except BaseException as exc:  # reported below
                outcome.append(exc)

        worker = threading.Thread(target=check, daemon=True)
        worker.start()
        worker.join(2 * timeout_s)
        assert not worker.is_alive(), "prove_not_fenced went past its timeout after a restart"
        assert outcome == [None]
        fence()
        with pytest.raises(FencedError):
            sink.prove_not_fenced()
    assert _values(stack, settings.progress_topic) == []


def test_topics_made_ready_on_brokers_whose_metadata_lags_are_known_by_their_ids(
    stack: Stack, kafka_pair: tuple[Kafka, Kafka]
) -> None:
    """Each broker answers from its own copy of the cluster's metadata, and right after
    CreateTopics one may not know the topic yet (on this pair under load, 18 of 60 new
    topics got such an answer among the next four). A topic just made ready is then known
    by its id all the same (or it goes unchecked, and a wait on it is never explained: a CI
    run waited two minutes so), and a check of the ids right after never calls one deleted
    (which stops the bridge)."""
    first, _second = kafka_pair
    name = f"sink{uuid.uuid4().hex[:8]}"
    settings = _settings(stack, name, bootstrap=first.bootstrap)
    topics = Topics(settings, kafka_client_config(settings))
    try:
        topics.start(30)
        for n in range(30):
            topic = f"{name}.t{n}"
            topics.ensure({topic: False})
            assert topic in topics.ids.learned, topic
            topics.check_ids()  # TopicReplaced if an answer's "unknown topic" were believed
    finally:
        topics.close()
