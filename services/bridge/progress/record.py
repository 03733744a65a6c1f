"""The progress record's bytes on the compacted progress topic: written and read here only.

One key per slot, so compaction keeps each slot's last record; the value is the contract's
``ProgressRecord``, serialised and parsed through the model so that what the bridge writes
is what its JSON Schema (``schemas/``) describes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from services.bridge.progress.highwater import ServerIdentity
from services.common.errors import SlotbridgeError
from services.contract.records import EndedSnapshot, ProgressRecord, TableSnapshot


class ProgressRecordError(SlotbridgeError):
    """The progress topic holds, under this slot's key, a value that is not a progress
    record: written by something else, or by an incompatible release."""

    retryable = False  # the record stays there; only the operator can decide what it means


def progress_key(slot: str) -> bytes:
    return json.dumps({"slot": slot}).encode()


def gap_key(slot: str, after_lsn: int) -> bytes:
    """A gap's own key next to the slot's progress (and the table versions on the schema
    topic): compaction keeps every gap."""
    return json.dumps({"slot": slot, "gap_after_lsn": after_lsn}).encode()


def is_gap_key(key: bytes | None) -> bool:
    """Whether a progress- or schema-topic key is a gap's (``gap_key``)."""
    return key is not None and b'"gap_after_lsn"' in key


def progress_value(
    slot: str,
    end_lsn: int,
    commit_lsn: int,
    identity: ServerIdentity,
    snapshots: Sequence[TableSnapshot] = (),
    ended: Sequence[EndedSnapshot] = (),
    topic_ids: Mapping[str, str] | None = None,
) -> bytes:
    record = ProgressRecord(
        slot=slot,
        end_lsn=end_lsn,
        commit_lsn=commit_lsn,
        system_identifier=identity.system_identifier,
        timeline=identity.timeline,
        ts_ms=int(time.time() * 1000),
        snapshots=list(snapshots),
        ended=list(ended),
        topic_ids=dict(topic_ids or {}),
    )
    return record.model_dump_json(by_alias=True).encode()


def progress_again(published: ProgressRecord, **update: Any) -> bytes:
    """A published progress record written again with ``update`` (fields by name): what a
    one-off command changes in it (``adopt-upgrade`` the identity, ``resync`` the
    snapshots), the rest kept."""
    record = published.model_copy(update={**update, "ts_ms": int(time.time() * 1000)})
    return record.model_dump_json(by_alias=True).encode()


def parse_progress(value: bytes, topic: str) -> ProgressRecord:
    """The record, or ``ProgressRecordError`` naming what is wrong and what to do."""
    try:
        return ProgressRecord.model_validate_json(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "value"
        raise ProgressRecordError(
            f"progress topic {topic}: the last record for this slot is not a slotbridge "
            f"progress record ({where}: {first['msg']}); if another program or release wrote "
            "it, give this bridge a progress_topic of its own"
        ) from None
