"""The bridge daemon's wait between sessions: pure arithmetic, no server."""

from __future__ import annotations

from services.bridge.daemon import Backoff


def test_wait_doubles_while_sessions_fail_up_to_the_cap() -> None:
    backoff = Backoff()
    waits = [backoff.session_ended(streamed=False) for _ in range(9)]
    assert waits == [0.5, 1, 2, 4, 8, 16, 30, 30, 30]
    assert backoff.failures == 9


def test_a_session_that_streamed_starts_the_wait_over() -> None:
    backoff = Backoff()
    for _ in range(20):
        backoff.session_ended(streamed=False)
    assert backoff.session_ended(streamed=True) == 0.5
    assert backoff.failures == 1
    assert backoff.session_ended(streamed=False) == 1


def test_hours_of_failures_keep_the_cap() -> None:
    backoff = Backoff(failures=5000)  # 2.0 ** 5000 alone would overflow a float
    assert backoff.session_ended(streamed=False) == 30
