"""Which of the stream's changes a table snapshotted mid-stream already holds."""

from __future__ import annotations

from services.bridge.coverage import SnapshotCoverage
from services.bridge.records import PendingSnapshot

A, B, C = ("public", "a"), ("public", "b"), ("public", "c")


def test_changes_before_the_snapshot_point_are_dropped_until_the_stream_passes_it() -> None:
    coverage = SnapshotCoverage([A], [], high_water=100)
    assert coverage.missing([A, B, C]) == [B, C]
    assert not coverage.dropping
    coverage.add([B], lsn=500)
    assert coverage.covers(B) and coverage.missing([A, B, C]) == [C]
    assert coverage.dropping
    assert coverage.drops(B, 499)  # committed before the snapshot: its rows hold it
    assert not coverage.drops(B, 500)  # a commit at the consistent point is streamed
    assert not coverage.drops(A, 10)  # covered by the initial snapshot: nothing to drop
    coverage.settle(499)
    assert coverage.drops(B, 499)
    coverage.settle(500)
    assert not coverage.dropping and coverage.covers(B)


def test_pending_points_survive_a_restart_through_the_progress_record() -> None:
    first = SnapshotCoverage([A], [], high_water=100)
    first.add([B, C], lsn=900)
    first.settle(200)
    pending = first.pending()
    assert [(p.schema_, p.table, p.lsn) for p in pending] == [("public", "b", 900),
                                                               ("public", "c", 900)]
    again = SnapshotCoverage([A], [PendingSnapshot.model_validate(p.model_dump(by_alias=True))
                                   for p in pending], high_water=300)
    assert again.missing([A, B, C]) == [] and again.drops(C, 899)
    # Restarted past the point: covered, nothing left to drop.
    later = SnapshotCoverage([A], pending, high_water=900)
    assert later.covers(B) and not later.dropping
