"""The base of slotbridge's own errors, and whether a new attempt can get past an error.

Every error of ours says, next to its definition, whether a retry can fix it
(``retryable``): the daemon's restart loop reads that flag instead of keeping a list of
classes far from them. Our errors' text is one line an operator can act on, and so are the
drivers' errors for a server or broker that went away (``_outages``); any other exception
is a bug, and its traceback is what a developer needs (``self_explanatory``).
"""

from __future__ import annotations

from typing import ClassVar


class SlotbridgeError(Exception):
    """An error whose message says what went wrong and what to do, in one line.

    Subclasses set ``retryable`` in their own body (a unit test keeps that true), so a
    reader of the class sees at once what the daemon does with it.
    """

    retryable: ClassVar[bool]


def _outages() -> tuple[type[Exception], ...]:
    """The drivers' errors for a connection that broke or a broker that did not answer:
    what a restart waits out. Their own text names the server and the cause."""
    # Imported when an error is judged, not with this module: every error class (the
    # settings' too) imports it, and the CLI starts without either driver.
    import psycopg
    from confluent_kafka import KafkaException

    return (psycopg.OperationalError, KafkaException)


def retryable(exc: BaseException) -> bool:
    """Whether a new attempt may get past ``exc``: our error's own flag, or an outage."""
    if isinstance(exc, SlotbridgeError):
        return exc.retryable
    return isinstance(exc, _outages())


def self_explanatory(exc: BaseException) -> bool:
    """Whether ``exc``'s one line is the whole story (ours, or an outage), so a log needs
    no traceback; anything else is a bug to be found by its traceback."""
    return isinstance(exc, (SlotbridgeError, *_outages()))
