from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

class RowPlan:
    def __init__(
        self,
        names: tuple[bytes, ...],
        kinds: bytes,
        key_idx: tuple[int, ...],
        converters: tuple[Callable[[str], Any], ...],
        dumps: Callable[[Any], bytes],
        key_head: bytes = ...,
        key_tail: bytes = ...,
        whole_old_key: bool = ...,
        placeholders: tuple[bytes, ...] | None = ...,
        hash_key: bytes | None = ...,
        params: tuple[int, ...] | None = ...,
        /,
    ) -> None: ...
    def record(
        self, values: Sequence[str | None], pieces: tuple[bytes, ...], numbers: tuple[int, ...], /
    ) -> tuple[bytes, bytes | None] | None: ...

def runs(
    items: Iterator[tuple[int, Any]],
    lsn: int,
    payload: bytes,
    at: int,
    plans: Mapping[int, tuple[Any, RowPlan, tuple[tuple[bytes, ...], ...], str]],
    relations: Mapping[int, Any],
    per_table: dict[str, int],
    total: int,
    headers: Any,
    max_bytes: int,
    limit: int,
    trailing: tuple[int, ...],
    slots: bytes,
    tombstones: bool,
    /,
) -> tuple[list[Any], int, tuple[int, Any] | None]: ...
def accelerate_sha256(on: bool, /) -> bool: ...
