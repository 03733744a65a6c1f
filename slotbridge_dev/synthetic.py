"""Change records in the bridge's exact format, for tests and the merge benchmark.

The consumer must be testable (and measurable) without a running bridge: this module
builds schema and change records as ``services.contract.records`` defines them and publishes
them in Kafka transactions the way the bridge does (schema record first, same transaction).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from services.contract.records import CONNECTOR, VERSION
from services.contract.topics import schema_topic, table_topic

# One record: topic, key bytes (None for a truncate), value bytes (None for a tombstone).
Record = tuple[str, bytes | None, bytes | None]
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


@dataclass(frozen=True)
class SynthColumn:
    name: str
    pg_type: str
    type_oid: int = 0
    type_modifier: int = -1
    key: bool = False
    nullable: bool = True
    dimensions: int = 1


@dataclass(frozen=True)
class SynthTable:
    prefix: str
    schema: str
    table: str
    columns: tuple[SynthColumn, ...]
    version: int = 1

    @property
    def topic(self) -> str:
        return table_topic(self.prefix, self.schema, self.table)

    @property
    def key_columns(self) -> list[str]:
        return [c.name for c in self.columns if c.key]

    def schema_record(self) -> Record:
        value = {
            "schema": self.schema,
            "table": self.table,
            "version": self.version,
            "relation_oid": 16384,
            "replica_identity": "d",
            "columns": [
                {
                    "name": c.name,
                    "type": c.pg_type,
                    "type_oid": c.type_oid,
                    "type_modifier": c.type_modifier,
                    "nullable": c.nullable,
                    "key": c.key,
                    **({"dimensions": c.dimensions} if c.dimensions > 1 else {}),
                }
                for c in self.columns
            ],
            "key_columns": self.key_columns,
            "ts_ms": int(time.time() * 1000),
        }
        key = {"schema": self.schema, "table": self.table, "version": self.version}
        return schema_topic(self.prefix), _dumps(key).encode(), _dumps(value).encode()

    def change(
        self,
        op: str,
        row: Mapping[str, Any] | None,
        commit_lsn: int,
        total_order: int,
        tx_id: int | None = None,
        ts_ms: int = 1_700_000_000_000,
        before: Mapping[str, Any] | None = None,
    ) -> list[Record]:
        """The record(s) of one change; a delete brings its tombstone along.

        ``row`` is the after image (c/u/r) or the old key/row (d); None for a truncate.
        """
        source = {
            "connector": CONNECTOR,
            "version": VERSION,
            "name": self.prefix,
            "db": "postgres",
            "schema": self.schema,
            "table": self.table,
            "txId": tx_id if op != "r" else None,
            "lsn": commit_lsn - 8,
            "commit_lsn": commit_lsn,
            "ts_ms": ts_ms,
            "snapshot": "true" if op == "r" else "false",
            "sequence": _dumps([str(commit_lsn), str(commit_lsn - 8)]),
            "schema_version": self.version,
        }
        image = dict(row) if row is not None else None
        value = {
            "before": image if op == "d" else (dict(before) if before is not None else None),
            "after": image if op in ("c", "u", "r") else None,
            "source": source,
            "op": op,
            "ts_ms": int(time.time() * 1000),
            "transaction": {
                "id": f"{tx_id}:{commit_lsn}",
                "total_order": total_order,
                "data_collection_order": total_order,
            },
        }
        if op == "t":
            return [(self.topic, None, _dumps(value).encode())]
        assert image is not None
        key = _dumps({k: image[k] for k in self.key_columns}).encode()
        records: list[Record] = [(self.topic, key, _dumps(value).encode())]
        if op == "d":
            records.append((self.topic, key, None))
        return records


class TransactionalWriter:
    """Publishes records in Kafka transactions, as the bridge does (read_committed sees
    a transaction's records all at once, aborted ones never)."""

    def __init__(self, bootstrap: str, transactional_id: str) -> None:
        from confluent_kafka import Producer

        self.bootstrap = bootstrap
        self.producer = Producer(
            {
                "bootstrap.servers": bootstrap,
                "transactional.id": transactional_id,
                "enable.idempotence": True,
                "linger.ms": 20,
                "partitioner": "murmur2_random",
                "queue.buffering.max.messages": 1_000_000,
            }
        )
        self.producer.init_transactions(30)

    def create_topics(
        self, topics: Iterable[str], compacted: Iterable[str] = (), partitions: int = 1
    ) -> None:
        """Create ``topics`` with ``partitions`` partitions, ``compacted`` with one
        (existing ones are left alone)."""
        from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        compact = set(compacted)
        wanted = [
            NewTopic(
                t,
                num_partitions=1 if t in compact else partitions,
                replication_factor=1,
                config={"cleanup.policy": "compact"} if t in compact else {},
            )
            for t in {*topics, *compact}
        ]
        for future in admin.create_topics(wanted).values():
            try:
                future.result(30)
            except Exception as exc:  # an existing topic is what we wanted anyway
                if "TOPIC_ALREADY_EXISTS" not in str(exc):
                    raise

    def send(self, records: Iterable[Record], abort: bool = False) -> int:
        """One Kafka transaction holding ``records``; returns how many were sent."""
        self.producer.begin_transaction()
        count = 0
        for topic, key, value in records:
            while True:
                try:
                    self.producer.produce(topic, key=key, value=value)
                    break
                except BufferError:
                    self.producer.poll(0.1)
            count += 1
        if abort:
            self.producer.abort_transaction(30)
        else:
            self.producer.commit_transaction(60)
        return count
