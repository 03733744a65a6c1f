"""Where a session resumes: the high-water mark, and whether this server may continue it.

The rule (ARCHITECTURE.md, "Exactly once"): ``high_water = max(origin progress, last committed
Kafka progress record)``; every transaction ending at or below it was published already
and is skipped. The origin is WAL-logged, so a promoted standby carries it; the Kafka
record closes the window between a Kafka commit and the origin update.

Pure: the caller reads both positions (``origin``, ``kafka_reader``) and the server's
identity.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.errors import SlotbridgeError
from services.contract.records import ProgressRecord


@dataclass(frozen=True, slots=True)
class ServerIdentity:
    system_identifier: str
    timeline: int


def high_water(origin_lsn: int, kafka: ProgressRecord | None) -> int:
    return max(origin_lsn, kafka.end_lsn if kafka is not None else 0)


class IdentityError(SlotbridgeError):
    """This server cannot be where the published progress came from.

    The message is the problem and what to do; ``problem`` alone serves a caller that
    moves on to another server instead.
    """

    # Once a session streamed, source_dsn may reach the right server again later (an
    # address that moves to the promoted primary after a failover).
    retryable = True

    def __init__(
        self, problem: str, remedy: str, server: ServerIdentity, published: ProgressRecord
    ) -> None:
        super().__init__(f"{problem}; {remedy}")
        self.problem = problem
        self.server = server
        self.published = published


def check_identity(server: ServerIdentity, kafka: ProgressRecord | None, slot: str) -> None:
    """Refuse a server that cannot be where our progress came from (``IdentityError``).

    A different system identifier is another cluster altogether; an older timeline is an
    old primary that came back after a failover - its slot may be behind what we
    published, and its WAL may hold transactions the new primary never had.
    """
    if kafka is None:
        return
    if kafka.system_identifier != server.system_identifier:
        raise IdentityError(
            f"slot {slot}'s published progress came from PostgreSQL system "
            f"{kafka.system_identifier}, but this server is system {server.system_identifier}",
            "point source_dsn at the right cluster (or use another slot_name/progress_topic); "
            "if this server is that cluster after pg_upgrade, run `slotbridge adopt-upgrade "
            f"--from-system {kafka.system_identifier}` once with the bridge stopped",
            server,
            kafka,
        )
    if server.timeline < kafka.timeline:
        raise IdentityError(
            f"server is on timeline {server.timeline} but slot {slot} already published from "
            f"timeline {kafka.timeline}: this looks like an old primary after a failover",
            "point source_dsn at the current primary",
            server,
            kafka,
        )
