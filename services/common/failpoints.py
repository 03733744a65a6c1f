"""Named failure injection points, switched on by the ``SLOTBRIDGE_FAILPOINTS`` variable.

Crash tests must hit each window of the publish -> commit -> advance -> confirm sequence
on purpose, not by luck. The variable holds ``name=action`` pairs separated by commas:

    SLOTBRIDGE_FAILPOINTS="after_kafka_commit=kill"      # SIGKILL ourselves right there
    SLOTBRIDGE_FAILPOINTS="after_origin_advance=3*kill"   # on the third time through
    SLOTBRIDGE_FAILPOINTS="before_kafka_commit=error"     # raise FailpointError
    SLOTBRIDGE_FAILPOINTS="before_watermark=sleep0.1"     # every time through: a slow part

Without the variable ``failpoint()`` is an empty function. A name not in ``NAMES`` is
refused when the variable is read, so a test cannot arm a point that no code passes.
"""

from __future__ import annotations

import os
import signal
import time

from services.common.errors import SlotbridgeError

# Every failpoint() call site, by name (tests/unit/test_failpoints.py keeps this true).
NAMES = frozenset(
    {
        "after_chunk",
        "after_kafka_commit",
        "after_origin_advance",
        "after_produce",
        "after_slot_confirm",
        "before_kafka_commit",
        "before_watermark",
        "consume_after_history",
        "consume_in_housekeeping",
        "consume_in_history_fold",
        "consume_after_status",
        "promote_after_disable",
    }
)


class FailpointError(SlotbridgeError, RuntimeError):
    """An armed failpoint's ``error`` action: the failure a crash test asked for."""

    retryable = False  # the test wants the process to stop there


def _parse(spec: str) -> dict[str, tuple[int, str]]:
    points: dict[str, tuple[int, str]] = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, action = item.partition("=")
        if name not in NAMES:
            raise ValueError(
                f"SLOTBRIDGE_FAILPOINTS: no failpoint named {name!r} "
                f"(known: {', '.join(sorted(NAMES))})"
            )
        count, star, what = action.partition("*")
        if star:
            points[name] = (int(count), what)
        else:
            points[name] = (1, action or "kill")
    return points


def _fire(name: str) -> None:
    """Fire the named failpoint if it is armed and this is the chosen pass."""
    armed = _POINTS.get(name)
    if armed is None:
        return
    hits = _HITS[name] = _HITS.get(name, 0) + 1
    nth, action = armed
    if action.startswith("sleep"):
        time.sleep(float(action[5:]))
        return
    if hits != nth:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise FailpointError(f"failpoint {name} fired")


def _off(name: str) -> None:
    """No failpoint is armed in this process."""


_POINTS = _parse(os.environ.get("SLOTBRIDGE_FAILPOINTS", ""))
_HITS: dict[str, int] = {}
# Chosen once at import: in a process started without the variable (every production
# process) a failpoint is a call to an empty function.
failpoint = _fire if _POINTS else _off
