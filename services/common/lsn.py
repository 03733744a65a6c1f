"""PostgreSQL log sequence numbers, and its clock on the wire.

An LSN is a 64-bit byte position in the WAL. On the wire and in the protocol it is an
integer; PostgreSQL prints it as two hex halves (``16/B374D848``). We keep it an ``int``
everywhere (comparisons and arithmetic are then free) and convert only at the edges.
"""

from __future__ import annotations

from typing import Final

# Replication timestamps (pgoutput's, the walsender's and the standby status messages')
# count microseconds from PostgreSQL's epoch, 2000-01-01 UTC.
PG_EPOCH_UNIX_US: Final = 946_684_800_000_000
PG_EPOCH_UNIX_MS: Final = PG_EPOCH_UNIX_US // 1000


def parse_lsn(text: str) -> int:
    """Parse ``'16/B374D848'`` into an int; raises ValueError with the bad text."""
    hi, sep, lo = text.strip().partition("/")
    if not sep or not hi or not lo:
        raise ValueError(f"not an LSN: {text!r} (expected e.g. '16/B374D848')")
    try:
        return (int(hi, 16) << 32) | int(lo, 16)
    except ValueError:
        raise ValueError(f"not an LSN: {text!r} (expected e.g. '16/B374D848')") from None


def format_lsn(lsn: int) -> str:
    """Format an int LSN the way PostgreSQL prints it."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"
