"""What the socket loop confirms to the slot: only what Kafka holds, or, with nothing in
flight, the keepalive's WAL end (an idle database's slot must not pin WAL)."""

from __future__ import annotations

from services.bridge.progress.confirm import ConfirmTracker
from services.bridge.receive.feedback import StreamPosition


def test_with_transactions_in_flight_only_what_kafka_holds_is_confirmed() -> None:
    tracker = ConfirmTracker(0)
    position = StreamPosition(received=0x900, queued_end=0x500, idle_end=0x900)
    tracker.published(0x300)  # 0x500 is queued, not yet in Kafka
    assert position.in_flight(tracker.published_lsn)
    assert position.to_confirm(tracker.confirmable(), tracker.published_lsn, True) == 0x300
    tracker.published(0x500)
    assert not position.in_flight(tracker.published_lsn)
    assert position.to_confirm(tracker.confirmable(), tracker.published_lsn, True) == 0x900


def test_an_open_transaction_keeps_the_keepalive_end_unconfirmed() -> None:
    """A streamed or prepared transaction before the keepalive is not in Kafka yet."""
    tracker = ConfirmTracker(0x500)
    position = StreamPosition(queued_end=0x500, idle_end=0x900)
    assert position.to_confirm(tracker.confirmable(), tracker.published_lsn, False) == 0x500


def test_a_prepared_transaction_holds_back_even_an_idle_slot() -> None:
    tracker = ConfirmTracker(0)
    tracker.prepared("g1", 0x400)
    tracker.published(0x500)
    position = StreamPosition(queued_end=0x500, idle_end=0x300)
    assert position.to_confirm(tracker.confirmable(), tracker.published_lsn, False) == 0x3FF


def test_a_status_goes_out_for_news_a_reply_or_the_interval() -> None:
    position = StreamPosition(sent=0x300, last_status=100.0)
    assert position.status_due(0x400, False, 100.5, 10.0)  # a new position
    assert position.status_due(0x300, True, 100.5, 10.0)  # the server asked
    assert position.status_due(0x300, False, 110.0, 10.0)  # the interval is over
    assert not position.status_due(0x300, False, 105.0, 10.0)
