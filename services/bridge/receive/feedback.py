"""What the socket loop tells the server: which position to confirm, and when.

Pure: the socket loop feeds it what it received and what the publisher reports; it
answers with the position to send. Two rules (ARCHITECTURE.md, "Exactly once" and "Idle
databases"): a position is confirmed only once Kafka holds it (the confirm tracker's
answer), except that with nothing in flight a keepalive's WAL end is confirmed, so the
slot's restart_lsn moves on a database whose published tables are quiet.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StreamPosition:
    """Where the socket loop stands in the stream (socket thread only)."""

    received: int = 0  # highest WAL position seen
    queued_end: int = 0  # end LSN of the last sealed transaction handed to the publisher
    idle_end: int = 0  # a keepalive's WAL end, confirmable when nothing is in flight
    sent: int = 0  # the position last confirmed to the server
    last_status: float = 0.0  # monotonic time of the last status update

    def to_confirm(self, confirmable: int, published: int, assembler_idle: bool) -> int:
        """The position to confirm, given the tracker's ``confirmable`` and ``published``
        positions and whether the assembler holds no open transaction."""
        if assembler_idle and published >= self.queued_end and self.idle_end > confirmable:
            # Nothing in flight: every change before the keepalive's WAL end has been
            # received and published (or was not ours), so the slot may move past it.
            return self.idle_end
        return confirmable

    def status_due(self, confirm: int, reply: bool, now: float, interval_s: float) -> bool:
        """Whether to send a status update now: a new position to confirm, a keepalive
        that asked for a reply, or the interval since the last one is over."""
        return confirm > self.sent or reply or now - self.last_status >= interval_s

    def in_flight(self, published: int) -> bool:
        """Whether sealed transactions wait for the publisher."""
        return published < self.queued_end
