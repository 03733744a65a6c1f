"""In-memory stand-ins for the publisher's Kafka sink and replication origin.

They implement ``publisher.Sink`` and ``publisher.OriginProgress`` the way the real ones
behave where exactly-once depends on it (as supabase/etl tests its pipeline against a
memory destination and state store): records become visible only at ``commit`` and
vanish at ``abort``; the origin holds one position. Both write to a shared ``journal``, so
a test can check the order of Kafka commits and origin advances, not only their results.
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterable

from services.bridge.records.events import Record
from services.contract.records import ProgressRecord

Journal = list[tuple[str, int]]  # ("kafka commit", progress end_lsn) / ("origin", lsn)


class MemorySink:
    """A transactional Kafka producer over one in-memory log."""

    def __init__(self, progress_topic: str, journal: Journal) -> None:
        self.progress_topic = progress_topic
        self.journal = journal
        self.transactions: list[list[Record]] = []  # committed, in commit order
        self._open: list[Record] | None = None

    def begin(self) -> None:
        assert self._open is None, "begin inside an open Kafka transaction"
        self._open = []

    def produce(self, topic: str, key: bytes | None, value: bytes | None) -> None:
        self._records().append((topic, key, value, None))

    def produce_all(self, records: Iterable[Record], compacted: Container[str]) -> int:
        txn = self._records()
        before = len(txn)
        txn.extend(records)
        return len(txn) - before

    def commit(self) -> float:
        txn = self._records()
        self.transactions.append(txn)
        self._open = None
        progress = [json.loads(v) for t, _, v, _ in txn if t == self.progress_topic and v]
        self.journal.append(("kafka commit", progress[-1]["end_lsn"] if progress else -1))
        return 0.0

    def abort(self) -> None:
        self._open = None

    def prove_not_fenced(self) -> None:
        """Nothing a reader sees, as the real one's offsets-only transaction; like it,
        refused while a transaction is open."""
        self.begin()
        self._open = None

    def topic_ids(self) -> dict[str, str]:
        return {}

    def records(self, *topics: str) -> list[Record]:
        """Every committed record (of ``topics``, when given), in log order."""
        return [r for txn in self.transactions for r in txn if not topics or r[0] in topics]

    def progress(self) -> ProgressRecord | None:
        """The last committed progress record, as ``progress.read_kafka_progress`` reads it."""
        values = [v for _, _, v, _ in self.records(self.progress_topic) if v is not None]
        return ProgressRecord.model_validate(json.loads(values[-1])) if values else None

    def _records(self) -> list[Record]:
        assert self._open is not None, "produce or commit outside a Kafka transaction"
        return self._open


class MemoryOrigin:
    """A replication origin: the last position recorded as published."""

    def __init__(self, journal: Journal, lsn: int = 0) -> None:
        self.journal = journal
        self.lsn = lsn

    def advance(self, lsn: int) -> None:
        self.lsn = lsn
        self.journal.append(("origin", lsn))
