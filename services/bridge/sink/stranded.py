"""A producer left without a broker to ask, told from its statistics (librdkafka#5301).

librdkafka drops every broker a Metadata response does not list. A broker in controlled
shutdown can answer with no broker at all, so a producer that asks it for metadata in that
second forgets every broker, bootstrap servers included. Mostly librdkafka then bootstraps
again (3 of 4 such answers in a test script here). In the fourth the broker it dropped was
still connected, and dropping a connected broker is planned, not a broker going down, so no
re-bootstrap started. The producer then waits without a word, up to the transaction's
timeout, and so does its abort: seen in CI as a bridge idle for five minutes after a Kafka
restart, the broker up all along.

Only a new producer gets out of it, and the sink cannot tell that state from a slow broker
by waiting. librdkafka's statistics can: every broker it knows is listed with where it came
from, and one that can be asked came from ``bootstrap.servers`` or from metadata.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

# Documented in librdkafka's STATISTICS.md; the others are "internal" and "logical" (the
# transaction coordinator's handle, which needs a real broker to reach it).
_ASKABLE_SOURCES = frozenset({"learned", "configured"})


def askable_brokers(brokers: dict[str, Any]) -> int:
    """How many of a statistics document's brokers (``broker_stats.brokers_of``) the client
    can ask: came from the bootstrap servers or from metadata."""
    return sum(1 for b in brokers.values() if b.get("source") in _ASKABLE_SOURCES)


class Stranding:
    """Since when the producer has had no broker to ask, from its statistics documents'
    brokers (``seen``, from the sink's ``stats_cb``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since: float | None = None

    def seen(self, brokers: dict[str, Any] | None) -> None:
        """A document's brokers; None (it lists none) says nothing."""
        if brokers is None:
            return
        if askable_brokers(brokers):
            self._since = None
        elif self._since is None:
            self._since = self._clock()

    def stranded_s(self) -> float:
        """Seconds since the first document without a broker to ask, with none since; 0
        while the last document had one."""
        return 0.0 if self._since is None else self._clock() - self._since
