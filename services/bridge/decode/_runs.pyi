from collections.abc import Callable

# A transaction left open by a read: (xid, entries, memory).
Partial = tuple[int, list[tuple[int, bytes]], int]

# (items, state, received, partial): items are stream.next_message's frames ("w", start, end,
# payload) and ("k", end, 0, reply), sealed regular transactions ("T", xid, commit_lsn,
# end_lsn, commit_ts, entries, memory) and regular transactions left to the assembler
# ("B", xid, entries, memory).
def read(
    get_copy_data: Callable[[int], tuple[int, object]],
    memory_limit: int,
    max_change: int,
    max_bytes: int,
    partial: Partial | None,
    /,
) -> tuple[list[tuple[object, ...]], int, int, Partial | None]: ...
