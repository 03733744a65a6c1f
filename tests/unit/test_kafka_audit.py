"""The audit's source-transaction check over committed records' essences (pure): what it
keeps of each record is enough to find a lost, a duplicated and an unended transaction."""

from __future__ import annotations

from typing import Any

from slotbridge_dev.stack.kafka_audit import (
    AuditReport,
    _check_source_transactions,
    _check_without_transaction_records,
    _event,
)

TXNS, MESSAGES = "p.transaction", "p.message"


def _change(txid: str, order: int, row: dict[str, Any], op: str = "u") -> dict[str, Any]:
    return {
        "op": op,
        "before": None,
        "after": row,
        "source": {"snapshot": "false"},
        "transaction": {"id": txid, "total_order": order},
    }


def _events(*records: tuple[str, dict[str, Any] | None]) -> list[Any]:
    events = [_event(topic, value, TXNS, MESSAGES) for topic, value in records]
    return [e for e in events if e is not None]


def _txn(txid: str, count: int) -> list[tuple[str, dict[str, Any] | None]]:
    return [
        (TXNS, {"status": "BEGIN", "id": txid}),
        (TXNS, {"status": "END", "id": txid, "event_count": count}),
    ]


def test_a_clean_log_has_no_problem() -> None:
    report = AuditReport()
    records = [
        *_txn("1:10", 2),
        ("p.s.t", _change("1:10", 1, {"k": 1})),
        ("p.s.t", None),  # a tombstone
        ("p.s.t", _change("1:10", 2, {"k": 2})),
        (MESSAGES, {"txId": 2, "commit_lsn": 20, "lsn": 19}),
        *_txn("2:20", 1),
        ("p.s.t", {"op": "r", "source": {"snapshot": "true"}}),
    ]
    _check_source_transactions(_events(*records), report)
    assert report.problems == [] and report.source_transactions == 2
    assert (report.change_records, report.snapshot_records) == (2, 1)


def test_lost_duplicated_and_unended_transactions_are_named() -> None:
    report = AuditReport()
    wrapped = {"schema": {}, "payload": _change("3:30", 1, {"k": 3})}  # Debezium format
    records = [
        *_txn("1:10", 2),
        ("p.s.t", _change("1:10", 1, {"k": 1})),  # change 2 of 1:10 is missing
        *_txn("2:20", 1),
        *_txn("2:20", 1),  # committed twice
        ("p.s.t", _change("2:20", 1, {"k": 2})),
        ("p.s.t", _change("2:20", 1, {"k": 2})),
        ("p.s.t", wrapped),  # no END for 3:30
    ]
    _check_source_transactions(_events(*records), report)
    assert report.problems == [
        "source transaction 1:10: END counts 2 events, the log holds 1",
        "source transaction 2:20: END committed 2 times",
        "source transaction 3:30: changes committed without its END",
        "p.s.t: change 1 (u) of source transaction 2:20 committed 2 times",
    ]
    assert report.kinds == {"lost": 2, "duplicated": 2}


def test_without_begin_records_an_end_alone_is_whole_and_a_begin_is_named() -> None:
    """A bridge with ``transaction_begin_records: false`` writes END records only: each is
    checked against its changes as usual, and a BEGIN it should not have written is named."""
    report = AuditReport()
    records = [
        (TXNS, {"status": "END", "id": "1:10", "event_count": 1}),
        ("p.s.t", _change("1:10", 1, {"k": 1})),
        *_txn("2:20", 1),
        ("p.s.t", _change("2:20", 1, {"k": 2})),
        (TXNS, {"status": "END", "id": "3:30", "event_count": 2}),
        ("p.s.t", _change("3:30", 1, {"k": 3})),  # change 2 of 3:30 is missing
    ]
    _check_source_transactions(_events(*records), report, begin_records=False)
    assert report.problems == [
        "source transaction 3:30: END counts 2 events, the log holds 1",
        "source transaction 2:20: a BEGIN record",
    ]
    assert report.kinds == {"lost": 1, "unexpected": 1} and report.source_transactions == 3
    with_begins = AuditReport()
    _check_source_transactions(_events(*records), with_begins)
    assert "source transaction 1:10: END without BEGIN" in with_begins.problems


def test_without_transaction_records_holes_duplicates_and_a_transaction_record_are_named() -> None:
    """A bridge with ``transaction_metadata: false`` writes no END to count against: each
    transaction's changes must be its total order's 1..n, none twice, and a record on the
    transaction topic is named. A key change (two records, one place) and a transaction
    with a logical message (a place that holds no change) are whole."""
    report = AuditReport()
    records = [
        ("p.s.t", _change("1:10", 1, {"k": 1})),
        ("p.s.t", _change("1:10", 2, {"k": 2}, op="d")),
        ("p.s.t", _change("1:10", 2, {"k": 3}, op="c")),  # the key change of 1:10
        ("p.s.t", _change("2:20", 1, {"k": 4})),
        ("p.s.t", _change("2:20", 3, {"k": 5})),  # change 2 of 2:20 is missing
        ("p.s.t", _change("3:30", 1, {"k": 6})),
        ("p.s.t", _change("3:30", 1, {"k": 6})),  # committed twice
        ("p.message", {"prefix": "x", "txId": 4, "commit_lsn": 40, "lsn": 41}),
        ("p.s.t", _change("4:40", 2, {"k": 7})),  # after its message
        (TXNS, {"status": "END", "id": "5:50", "event_count": 0}),
    ]
    _check_without_transaction_records(_events(*records), report)
    assert report.problems == [
        "source transaction 5:50: an END record",
        "source transaction 2:20: changes [1, 3] are not its total order's 1..n",
        "p.s.t: change 1 (u) of source transaction 3:30 committed 2 times",
    ]
    assert report.kinds == {"unexpected": 1, "lost": 1, "duplicated": 1}
    assert report.source_transactions == 4 and report.change_records == 8
