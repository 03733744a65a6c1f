"""``slotbridge resync``: publish every table again after the source lost changes (an
invalidated slot) or Kafka lost topics (deleted under the bridge), into the same topics,
with the gap on record.

An invalidated slot's changes after its confirmed position are gone from the source (and a
dropped slot's: the bridge would create a new one and go on, the gap unsaid). Run
once with the bridge stopped, this writes, in one Kafka transaction of the slot's
transactional id (which also fences a bridge still running on the slot):

- a ``GapRecord`` on the progress topic (its own key, so compaction keeps it): the
  changes after the published position are missing, and which tables are published
  again; the same record on the schema topic, which the Spark consumers read, so they
  can mark the gap in their tables;
- the slot's progress record again, with a snapshot of every published table under way
  (id ``resync``, from its first chunk);

then drops the invalidated slot. After a topic loss the slot is kept (nothing is missing
from the stream) and the replaced topics' ids are dropped from the progress record, so the
bridge accepts and learns the new ones. The bridge, started, creates a new slot (the progress
record's position is below anything the new slot sends) and snapshots the tables in
chunks while it streams, reconciled with the stream by watermarks: for every key, a
``read_committed`` consumer's last record is the table's current state once the resync
snapshot of its table ended. The slot is dropped last: a crash before it leaves the
invalidated slot, which stops the bridge again, and the command can be run again (the gap
record has the same key).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

from services.bridge.oneoff import fenced_slot, source_dsn
from services.bridge.progress.record import gap_key, progress_again, progress_key
from services.bridge.settings import BridgeSettings
from services.bridge.sink.kafka import KafkaSink
from services.bridge.snapshot.chunks import TableName
from services.bridge.source import SlotState, published_tables, slot_state
from services.common.errors import SlotbridgeError
from services.common.logs import log_event
from services.common.lsn import format_lsn
from services.common.pg import connect
from services.contract.records import GapRecord, ProgressRecord, TableSnapshot
from services.contract.topics import schema_topic

log = logging.getLogger(__name__)


class ResyncRefused(SlotbridgeError):
    """Nothing was lost, or the slot cannot be started over now; the message says why."""

    retryable = False


@dataclass(frozen=True, slots=True)
class Resynced:
    slot: str
    after_lsn: str  # the published position: changes after it are missing
    reason: str
    tables: list[str]


def resync(settings: BridgeSettings) -> Resynced:
    """The module's docstring; ``ResyncRefused`` with nothing written when a check fails."""
    slot = settings.slot_name
    with fenced_slot(settings) as (sink, published):
        if published is None:
            raise ResyncRefused(
                f"slot {slot} has no published progress in {settings.progress_topic}: "
                "nothing to resync; start the bridge (a new slot snapshots every table)"
            )
        replaced = sink.topics.replaced(published.topic_ids)
        with connect(source_dsn(settings)) as sql:
            state = slot_state(sql, slot)
            kind, reason = _lost(slot, state, replaced, published.topic_ids)
            tables = [p.name for p in published_tables(sql, settings.publication_name)]
            gap = _publish(settings, sink, published, kind, reason, tables, set(replaced))
            if state is not None and state.invalidation_reason:
                sql.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    log_event(
        log,
        logging.INFO,
        "resync recorded; start the bridge",
        slot=slot,
        after_lsn=format_lsn(published.end_lsn),
        tables=gap.tables,
    )
    return Resynced(slot, format_lsn(published.end_lsn), reason, gap.tables)


def _lost(
    slot: str,
    state: SlotState | None,
    replaced: dict[str, str | None],
    topic_ids: dict[str, str],
) -> tuple[Literal["source", "topic"], str]:
    """What Kafka misses, as the gap record's kind and reason; ResyncRefused for nothing."""
    if state is None:
        return "source", "slot dropped"
    if state.invalidation_reason:
        return "source", f"slot invalidated ({state.invalidation_reason})"
    if replaced:
        return "topic", "; ".join(
            f"topic {t} deleted (topic id {topic_ids[t]}, now {now or 'none'})"
            for t, now in sorted(replaced.items())
        )
    raise ResyncRefused(
        f"slot {slot} is valid and every topic it wrote is still there: Kafka misses "
        "nothing; start the bridge"
    )


def _publish(
    settings: BridgeSettings,
    sink: KafkaSink,
    published: ProgressRecord,
    kind: Literal["source", "topic"],
    reason: str,
    tables: list[TableName],
    replaced: set[str],
) -> GapRecord:
    """The gap record and the progress record with every table's snapshot under way and
    the replaced topics' ids forgotten (the bridge learns the new ones)."""
    now = int(time.time() * 1000)
    slot = settings.slot_name
    gap = GapRecord(
        slot=slot,
        kind=kind,
        after_lsn=published.end_lsn,
        reason=reason,
        tables=[f"{a}.{b}" for a, b in tables],
        ts_ms=now,
    )
    snapshots = [
        TableSnapshot(schema=schema, table=table, id="resync", started_ms=now)
        for schema, table in tables
    ]
    sink.begin()
    for topic in (settings.progress_topic, schema_topic(settings.topic_prefix)):
        sink.produce(topic, gap_key(slot, gap.after_lsn), gap.model_dump_json().encode())
    sink.produce(
        settings.progress_topic,
        progress_key(slot),
        progress_again(
            published,
            snapshots=snapshots,
            topic_ids={t: i for t, i in published.topic_ids.items() if t not in replaced},
        ),
    )
    sink.commit()
    return gap
