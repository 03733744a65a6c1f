"""Topic ids, asked of Kafka by a child process that is replaced before it grows.

Why a child: confluent-kafka's ``AdminClient.describe_topics`` (2.16.1, and its source up to
2.15.0) never frees the topic id it returns. Its C code passes the new reference
``c_Uuid_to_py`` makes to ``PyDict_SetItemString``, which does not take references over, so
one ``Uuid`` object per described topic stays in the process for good. No other public call
gives a topic's id, and the sink asks before every Kafka commit (``sink.TopicIds``): in the
daemon that was ~0.5 KB per commit, 67 -> 147 MB in 45 minutes of a soak, without end. Asked
here instead, the objects pile up in a child that is replaced after ``_TOPICS_PER_CHILD``
described topics, and the daemon's memory stays flat. The next child is started shortly
before, so a commit does not wait for one to start.

The child gets the client settings on its standard input (they hold the SASL password: never
on its command line or in its environment), then one question per line, and answers each on
a line of its own. It ends when its standard input closes, so it never outlives the daemon,
even one killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient

from services.common.kafka import cause, explain

# ~100 bytes stay behind per described topic (measured): a child grows by ~10 MB, from its
# ~29 MB (14 MB of it its own, the rest shared libraries). Replaced every few minutes at a
# thousand commits/s of a few topics each: a new process costs ~0.3 s of CPU.
_TOPICS_PER_CHILD = 100_000
# The next child starts when this share of the current one's topics is used: while it waits
# it costs a second child's memory, and it needs about a second to start on a loaded machine.
_NEXT_AT = 0.95
# A child has this long to start (import confluent-kafka, build its client) on a loaded
# machine, on top of the question's own timeout.
_START_S = 60.0
# An answer comes at most this long after the question's own timeout has passed.
_ANSWER_SLACK_S = 5.0


class ProbeError(Exception):
    """The topics could not be described now (the sink says so as a retryable error)."""


class TopicIdProbe:
    """``describe(topics)``: each topic's id now, None for one that does not exist."""

    def __init__(
        self, client_config: dict[str, Any], topics_per_child: int = _TOPICS_PER_CHILD
    ) -> None:
        # The daemon's librdkafka logger cannot cross a pipe; the child's failures come back
        # in its answers, and the daemon's own clients log the brokers' state.
        self._config = {k: v for k, v in client_config.items() if k != "logger"}
        self._topics_per_child = topics_per_child
        self._child: _Child | None = None
        self._next: _Child | None = None

    def describe(self, topics: list[str], timeout_s: float) -> dict[str, str | None]:
        child = self._current()
        try:
            answer = child.ask({"topics": topics, "timeout_s": timeout_s}, timeout_s)
        except ProbeError:
            child.close()  # an answer that comes late would answer the next question
            self._child = None
            raise
        if "error" in answer:
            raise ProbeError(answer["error"])
        ids: dict[str, str | None] = answer["ids"]
        return ids

    def _current(self) -> _Child:
        if self._child is None:
            self._child, self._next = self._next or _Child(self._config), None
        elif self._child.described >= self._topics_per_child and self._next is not None:
            self._child.close()
            self._child, self._next = self._next, None
        if self._next is None and self._child.described >= self._topics_per_child * _NEXT_AT:
            self._next = _Child(self._config)
        return self._child

    def close(self) -> None:
        for child in (self._child, self._next):
            if child is not None:
                child.close()
        self._child = self._next = None


class _Child:
    """One child process and the pipes to it."""

    def __init__(self, config: dict[str, Any]) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._stdin, self._stdout = self._process.stdin, self._process.stdout
        self._send(config)
        self._started = False
        self._buffer = b""
        self.described = 0

    def ask(self, question: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self._send(question)
        wait = timeout_s + _ANSWER_SLACK_S + (0.0 if self._started else _START_S)
        answer = json.loads(self._line(time.monotonic() + wait))
        self._started = True
        self.described += len(question["topics"])
        return answer  # type: ignore[no-any-return]

    def _send(self, message: dict[str, Any]) -> None:
        try:
            self._stdin.write(json.dumps(message).encode() + b"\n")
            self._stdin.flush()
        except OSError as exc:  # BrokenPipeError: the child is gone
            raise ProbeError(f"the topic id probe's process ended: {exc}") from None

    def _line(self, deadline: float) -> bytes:
        fd = self._stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    raise ProbeError("Kafka did not answer a DescribeTopics request in time")
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise ProbeError(
                        f"the topic id probe's process ended (exit code {self._process.wait()})"
                    )
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def close(self) -> None:
        try:
            self._stdin.close()  # the child ends at the end of its input
            self._process.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()
        self._stdout.close()


def _answer(admin: AdminClient, topics: list[str], timeout_s: float) -> dict[str, Any]:
    ids: dict[str, str | None] = {}
    described = admin.describe_topics(TopicCollection(topics), request_timeout=timeout_s)
    for topic, future in described.items():
        try:
            ids[topic] = str(future.result().topic_id)
        except KafkaException as exc:
            err = cause(exc)
            if not (isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
                return {"error": f"cannot describe topic {topic}: {explain(exc)}"}
            ids[topic] = None
    return {"ids": ids}


def main() -> None:
    """The child's side: settings, then a question per line until the input ends."""
    # The daemon decides when this ends (by closing the input): a Ctrl-C or a SIGTERM sent
    # to the process group must not end it first with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = json.loads(sys.stdin.readline())
    admin = AdminClient({**config, "log_level": 0})
    for line in sys.stdin:
        question = json.loads(line)
        try:
            answer = _answer(admin, question["topics"], question["timeout_s"])
        except KafkaException as exc:  # the request could not even be made
            answer = {"error": f"cannot describe topics: {explain(exc)}"}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
