"""The cyclic garbage collector of a long-running daemon: young collections spaced out.

CPython collects its youngest generation every 700 container allocations (net of
deallocations), the middle one every ten of those, and everything every ten middle ones
once the objects that survived since the last full collection are a quarter of the oldest
generation. The bridge allocates a few containers per row change (the queued transaction,
its spool, the decoded messages), and a backlog of small transactions keeps tens of
thousands of them in its queue, which every middle and full collection walks. Measured
(2026-11-25, ``bench/bridge_bench.py --workload oltp --rows 300000``, three pairs of runs,
the collector's CPU time taken in ``gc.callbacks`` by the thread it ran in): with the
defaults 666-714 young, 61-65 middle and 6-7 full collections took 0.32-0.43 s of the
daemon's ~3.7 s of CPU; with the first threshold at 10,000, 22-35 young, 2-3 middle and one
full collection took 0.10-0.19 s. The daemon's CPU per change moves more than that between
runs on a loaded machine (12.3 -> 10.6, 13.5 -> 11.2, 11.6 -> 11.0 us in those pairs; 10.9
and 11.4 before against 11.2 and 11.9 us after in two more), so the collector's own time is
the figure to go by.

Reference counting frees what the bridge allocates as soon as it is dropped; the collector
only finds cycles (an exception and its traceback, for one), and these now wait for up to
10,000 allocations instead of 700: kilobytes, not a trend.
"""

from __future__ import annotations

import gc

# Young collections every this many container allocations; the middle and oldest
# generations keep CPython's ratios (every ten of the one below).
YOUNG_THRESHOLD = 10_000


def space_out_collections() -> None:
    """Collect the youngest generation every ``YOUNG_THRESHOLD`` allocations (see the
    module's doc for why and what it saves)."""
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)
