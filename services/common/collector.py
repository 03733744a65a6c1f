"""The cyclic garbage collector of a long-running daemon: young collections spaced out,
startup's objects out of its sight.

CPython collects its youngest generation every 700 container allocations (net of
deallocations), the middle one every ten of those, and everything every ten middle ones
once the objects that survived since the last full collection are a quarter of the oldest
generation. The bridge allocates a few containers per row change (the queued transaction,
its spool, the decoded messages), and a backlog of small transactions keeps tens of
thousands of them in its queue, which every middle and full collection walks. A collection
holds the GIL: the other thread (the socket's or the publisher's) stands still meanwhile.

Measured (2026-11-25, ``bench/bridge_bench.py --workload oltp --rows 300000``, three pairs of
runs, the collector's CPU time taken in ``gc.callbacks`` by the thread it ran in): with the
defaults 666-714 young, 61-65 middle and 6-7 full collections took 0.32-0.43 s of the
daemon's ~3.7 s of CPU; with the first threshold at 10,000, 22-35 young, 2-3 middle and one
full collection took 0.10-0.19 s.

Measured again (2026-11-29, the same bench with ``--rows 200000``, about 1.7 s of the
daemon's CPU a run, two runs each): at 10,000 the collector still took 118-135 ms, a full
collection alone 43-51 ms, most of it walking what startup made (the modules, the settings'
models: about 58,000 objects). The stream's own pairs and records are now untracked where
they are made (``decode/_runs.c``, ``records/_rowjson.c``: ints, bytes and strings make no
cycle), which took the young collections from 38-48 to 27-30 ms; with startup's objects
frozen (``freeze_startup_objects``) and the first threshold at 50,000, the collector took
29-41 ms a run: 3-4 young collections, no middle or full one. The daemon's CPU per change
moves more than these between runs on this machine, so the collector's own time is the
figure to go by.

Reference counting frees what the bridge allocates as soon as it is dropped; the collector
only finds cycles (an exception and its traceback, for one), and these now wait for up to
50,000 allocations: kilobytes, not a trend.
"""

from __future__ import annotations

import gc

# Young collections every this many container allocations; the middle and oldest
# generations keep CPython's ratios (every ten of the one below).
YOUNG_THRESHOLD = 50_000


def space_out_collections() -> None:
    """Collect the youngest generation every ``YOUNG_THRESHOLD`` allocations (see the
    module's doc for why and what it saves)."""
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, oldest)


def freeze_startup_objects() -> None:
    """Move every object alive now out of the collector's sight for good: called once the
    daemon has imported its modules and read its settings, whose objects live as long as
    the process and were most of what each full collection walked (module doc)."""
    gc.freeze()
