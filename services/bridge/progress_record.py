"""The progress record's bytes on the compacted progress topic: written and read here only.

One key per slot, so compaction keeps each slot's last record; the value is
``records.ProgressRecord``. ``progress_value`` and ``parse_progress`` are the record's one
serialiser and parser, the place to route it through the shared record contract.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from services.bridge.highwater import ServerIdentity
from services.contract.records import ProgressRecord, TableSnapshot


def progress_key(slot: str) -> bytes:
    return json.dumps({"slot": slot}).encode()


def progress_value(
    slot: str,
    end_lsn: int,
    commit_lsn: int,
    identity: ServerIdentity,
    snapshots: Sequence[TableSnapshot] = (),
) -> bytes:
    return json.dumps(
        {
            "slot": slot,
            "end_lsn": end_lsn,
            "commit_lsn": commit_lsn,
            "system_identifier": identity.system_identifier,
            "timeline": identity.timeline,
            "ts_ms": int(time.time() * 1000),
            "snapshots": [snap.model_dump(by_alias=True) for snap in snapshots],
        }
    ).encode()


def parse_progress(value: bytes) -> ProgressRecord:
    return ProgressRecord.model_validate(json.loads(value))
