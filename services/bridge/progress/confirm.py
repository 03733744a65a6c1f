"""What may be confirmed to the slot: a bound below the high-water mark (``highwater``).

Never past what Kafka holds, and never past a prepared transaction not yet published -
once the slot's confirmed position passes a PREPARE, the server will not send its content
again.
"""

from __future__ import annotations

import threading


class ConfirmTracker:
    """What may be confirmed to the slot, shared by the socket loop and the publisher."""

    def __init__(self, start: int) -> None:
        self._lock = threading.Lock()
        self._published = start
        self._prepared: dict[str, int] = {}  # gid -> prepare LSN, until published/rolled back

    def published(self, end_lsn: int) -> None:
        with self._lock:
            self._published = max(self._published, end_lsn)

    def prepared(self, gid: str, prepare_lsn: int) -> None:
        with self._lock:
            self._prepared[gid] = prepare_lsn

    def finished(self, gid: str) -> None:
        with self._lock:
            self._prepared.pop(gid, None)

    def confirmable(self) -> int:
        with self._lock:
            if self._prepared:
                return min(self._published, min(self._prepared.values()) - 1)
            return self._published

    @property
    def published_lsn(self) -> int:
        return self._published
