"""What may be confirmed to the slot: never past what Kafka holds, never past a PREPARE
whose transaction is not published yet (the server would not send its content again)."""

from __future__ import annotations

from services.bridge.progress.confirm import ConfirmTracker


def test_the_confirmable_position_follows_what_kafka_holds() -> None:
    tracker = ConfirmTracker(0)
    assert tracker.confirmable() == 0
    tracker.published(0x200)
    tracker.published(0x100)  # a skipped replay behind it does not move it back
    assert tracker.confirmable() == tracker.published_lsn == 0x200


def test_a_prepared_transaction_holds_the_slot_before_its_prepare() -> None:
    tracker = ConfirmTracker(0)
    tracker.prepared("g1", 0x150)
    tracker.prepared("g2", 0x180)
    tracker.published(0x300)
    assert tracker.confirmable() == 0x14F
    tracker.finished("g1")  # published or rolled back
    assert tracker.confirmable() == 0x17F
    tracker.finished("g2")
    assert tracker.confirmable() == 0x300
    assert tracker.published_lsn == 0x300


def test_a_prepare_above_what_kafka_holds_does_not_raise_the_position() -> None:
    tracker = ConfirmTracker(0x100)
    tracker.prepared("g1", 0x500)
    assert tracker.confirmable() == 0x100
    tracker.finished("unknown gid")  # a rollback of a transaction prepared before our start
    assert tracker.confirmable() == 0x100
