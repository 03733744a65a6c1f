"""The bridge rides out source outages: its wait between sessions starts over after each.

The shared stack's primary is stopped twice under a running bridge. During the first
outage the sessions keep failing and the wait doubles; once a session streamed again, the
second outage must start from the shortest wait, not from where the first one ended.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from slotbridge_dev.stack.stack import Stack
from tests.integration.bridge_harness import Pipeline, sql, wait_for

TABLE = "reconnect"
RECONNECT = re.compile(
    r"WARNING +session ended, reconnecting .*attempt=(\d+) "
    r"retry_in_s=([\d.]+)"
)
STREAMING = re.compile(r"INFO +streaming slot=")


@pytest.fixture
def pipe(stack: Stack, tmp_path: Path) -> Iterator[Pipeline]:
    sql(
        stack.primary_dsn,
        f"DROP TABLE IF EXISTS {TABLE}; CREATE TABLE {TABLE} (id int PRIMARY KEY)",
    )
    pipeline = Pipeline(stack, [f"public.{TABLE}"], tmp_path)
    try:
        yield pipeline
    finally:
        stack.node("primary").start()  # a failed assertion must not leave it down
        pipeline.cleanup()


def reconnects(pipe: Pipeline) -> list[tuple[int, float]]:
    return [(int(a), float(s)) for a, s in RECONNECT.findall(pipe.output())]


def sessions_streamed(pipe: Pipeline) -> int:
    return len(STREAMING.findall(pipe.output()))


def test_backoff_starts_over_after_a_session_streamed(stack: Stack, pipe: Pipeline) -> None:
    primary = stack.node("primary")
    pipe.start()
    # Not wait_caught_up: a new slot is "caught up" before its first session streams, and
    # an error before then is fatal by design.
    wait_for(lambda: sessions_streamed(pipe) == 1, 60, f"streaming\n{pipe.output()}")

    # Outage 1: long enough for three failed sessions in a row.
    primary.stop("fast")
    wait_for(lambda: len(reconnects(pipe)) >= 4, 30, f"four reconnects\n{pipe.output()}")
    primary.start()
    wait_for(lambda: sessions_streamed(pipe) == 2, 60, f"streaming again\n{pipe.output()}")
    first = reconnects(pipe)
    assert [a for a, _ in first[:4]] == [1, 2, 3, 4], first
    assert [s for _, s in first[:4]] == [0.5, 1.0, 2.0, 4.0], first

    # Outage 2: the session that streamed ends; the count and the wait start over.
    primary.stop("fast")
    wait_for(lambda: len(reconnects(pipe)) > len(first), 30, f"a reconnect\n{pipe.output()}")
    assert reconnects(pipe)[len(first)] == (1, 0.5), pipe.output()[-3000:]
    primary.start()
    wait_for(lambda: sessions_streamed(pipe) == 3, 60, f"streaming again\n{pipe.output()}")
    assert pipe.proc is not None and pipe.proc.poll() is None
    assert pipe.stop() == 0
