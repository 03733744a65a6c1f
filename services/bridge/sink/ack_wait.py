"""A transaction Kafka does not acknowledge: the wait exported, and one line that says why.

librdkafka waits without a word, up to the transaction's timeout, for brokers that do not
acknowledge records (a deleted topic, NOT_ENOUGH_REPLICAS, a full log dir) and for a
coordinator that cannot write a commit's markers. The sink's flush and its commit or abort
hand each such wait here, so an operator sees it as a metric at once and as a line from
``REPORT_AFTER_S`` on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from services.bridge.sink.topics import Topics
from services.common.logs import log_event

log = logging.getLogger(__name__)

# After this long without acknowledgement a wait says why, then once a minute.
REPORT_AFTER_S = 5.0
_REPEAT_S = 60.0


class AckWait:
    """The sink's waits on Kafka, reported: ``on_wait`` (a metric) gets the seconds waited,
    0 once the wait ended."""

    def __init__(self, topics: Topics, timeout_s: float, on_wait: Callable[[float], None]) -> None:
        self._topics = topics  # asked why the brokers do not acknowledge
        self._timeout_s = timeout_s  # when the sink gives up: kafka_transaction_timeout_ms
        self._on_wait = on_wait
        self._logged = 0.0  # monotonic time of the last line
        self._explained = False  # whether that line could say why

    def waited(self, waited_s: float, what: str) -> None:
        """Export the wait; from ``REPORT_AFTER_S`` on, say why once a minute, and sooner
        while the last line could not say it: brokers that just lost one of theirs may
        answer the sink's questions only once their metadata has caught up."""
        self._on_wait(waited_s)
        now = time.monotonic()
        if waited_s < REPORT_AFTER_S:
            return
        due = now - self._logged >= _REPEAT_S
        if not due and self._explained:
            return
        cause, explained = self._topics.why_unacknowledged()
        if not due and not explained:
            return  # nothing more to say than the last line
        self._logged, self._explained = now, explained
        log_event(
            log,
            logging.WARNING,
            "Kafka does not acknowledge this transaction; waiting, nothing is confirmed to "
            "PostgreSQL meanwhile",
            waited_s=round(waited_s),
            waiting_for=what,
            gives_up_in_s=max(0, round(self._timeout_s - waited_s)),
            cause=cause,
        )

    def ended(self) -> None:
        self._on_wait(0.0)
