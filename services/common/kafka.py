"""Kafka client errors and logs as an operator should read them.

- ``explain``: one line per error (code name, reason, what to do where it is known),
  never the client's ``KafkaError{code=...,val=...,str=...}`` repr.
- ``KafkaLog``: librdkafka repeats a failing connection's line for every attempt (some
  ninety lines in thirty seconds); each distinct line is logged once per interval.
- ``check_reachable``: a bounded metadata request before anything else is set up, saying
  in one line what is wrong (nobody listens, not a Kafka listener, a security mismatch).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from services.common.errors import SlotbridgeError

_REMEDIES = {
    KafkaError.TOPIC_AUTHORIZATION_FAILED: "grant the client's principal access to the topic",
    KafkaError.CLUSTER_AUTHORIZATION_FAILED: "grant the client's principal the cluster "
    "operation it needs (CREATE, DESCRIBE_CONFIGS)",
    KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "grant the client's principal WRITE "
    "and DESCRIBE on its transactional id",
    KafkaError.GROUP_AUTHORIZATION_FAILED: "grant the client's principal READ on its group",
    KafkaError.SASL_AUTHENTICATION_FAILED: "check the SASL user and password",
    KafkaError._AUTHENTICATION: "check the security settings against the broker's listener",
    KafkaError._SSL: "check the TLS settings (CA, certificate, host name)",
    KafkaError._ALL_BROKERS_DOWN: "check that the brokers run and kafka_bootstrap names them",
    KafkaError._TRANSPORT: "check that the brokers run and kafka_bootstrap names them",
}


# The settings of a consumer that reads a partition to its end (``enable.partition.eof``).
# It learns of the end from a fetch that comes back empty, which the broker holds back for
# ``fetch.wait.max.ms`` (librdkafka's default: 500 ms), and an offsets request sent to
# the same broker meanwhile waits behind that fetch. The end of a topic written in Kafka
# transactions is a commit marker, which no consumer receives, so every read of such a
# topic to its end paid the wait, often more than once: reading a one-record schema
# topic took 0.57 s, 0.04 s with 10 ms (measured on the local stack).
END_READER_CONFIG: dict[str, object] = {"fetch.wait.max.ms": 10}


def cause(err: KafkaError | KafkaException | BaseException) -> KafkaError | BaseException:
    """The KafkaError behind an exception, if there is one."""
    # confluent-kafka raises SystemError ("<function ...> returned a result with an exception
    # set") when a callback runs while a fatal error is pending; the real error is its cause.
    while isinstance(err, SystemError) and (err.__cause__ or err.__context__) is not None:
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
    if isinstance(err, KafkaException) and err.args and isinstance(err.args[0], KafkaError):
        return err.args[0]
    return err


def explain(err: KafkaError | KafkaException | BaseException) -> str:
    """One readable line: ``NAME: reason[; what to do]``."""
    err = cause(err)
    if not isinstance(err, KafkaError):
        return str(err)
    text = f"{err.name()}: {err.str()}"
    remedy = _REMEDIES.get(err.code())
    return f"{text}; {remedy}" if remedy else text


# Parts of a librdkafka line that change on every repetition of the same problem.
_VOLATILE = re.compile(
    r"\(after \d+ms in state \w+(, \d+ identical error\(s\) suppressed)?\)"
    r"|rdkafka#(producer|consumer)-\d+"
)


class KafkaLog:
    """A ``logger`` for librdkafka (confluent-kafka calls ``log(level, fmt, *args)``) that
    passes each distinct line on once per ``interval_s``, then says how many it held back."""

    def __init__(
        self, target: logging.Logger, interval_s: float = 60.0, clock: Any = time.monotonic
    ) -> None:
        self._target = target
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()  # librdkafka logs from its own threads
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (last logged, held back)

    def log(self, level: int, msg: str, *args: object) -> None:
        if not self._target.isEnabledFor(level):
            return
        text = msg % args if args else msg
        key = _VOLATILE.sub("", text)
        now = self._clock()
        with self._lock:
            last, held = self._seen.get(key, (None, 0))
            if last is not None and now - last < self._interval:
                self._seen[key] = (last, held + 1)
                return
            self._seen[key] = (now, 0)
        if held:
            text = f"{text} (repeated {held} times in the last {self._interval:.0f}s)"
        self._target.log(level, text)


def _reason(errors: list[KafkaError]) -> str:
    """The first client-level error, without its broker prefix and timing."""
    for err in errors:
        text = _VOLATILE.sub("", err.str()).strip()
        text = re.sub(r"^\S+/(bootstrap|\d+): ", "", text)
        if "Invalid response size" in text:
            return "the server there does not speak the Kafka protocol (another service's port?)"
        if "Request not valid in current SASL state" in text:
            return (
                f"{text.split(':')[0]}: the listener does not use SASL "
                "(security.protocol does not match the broker's listener)"
            )
        return text
    return "no answer"


class KafkaUnreachable(SlotbridgeError):
    """The brokers did not answer; the message says why and what to check."""

    retryable = True  # an outage, or a broker still starting


def check_reachable(config: dict[str, Any], timeout_s: float, settings_hint: str) -> None:
    """Ask the brokers for metadata, waiting at most ``timeout_s``; raise
    ``KafkaUnreachable`` when they do not answer. ``settings_hint`` names the settings an
    operator should look at (it ends the line)."""
    errors: list[KafkaError] = []
    probe = {k: v for k, v in config.items() if k != "logger"}
    # Its log lines would repeat what the one line says.
    probe.update({"error_cb": errors.append, "log_level": 0})
    admin = AdminClient(probe)
    try:
        admin.list_topics(timeout=timeout_s)
        return
    except KafkaException as exc:
        admin.poll(0)  # serves error_cb
        failure = exc
    security = (
        ", ".join(
            f"{k}={config[k]}" for k in ("security.protocol", "sasl.mechanism") if k in config
        )
        or "security.protocol=plaintext"
    )
    reason = _reason(errors) if errors else explain(failure)
    raise KafkaUnreachable(
        f"Kafka at {config.get('bootstrap.servers')} ({security}) did not "
        f"answer within {timeout_s:.0f}s: {reason}; check {settings_hint}"
    )
