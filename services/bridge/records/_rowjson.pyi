from collections.abc import Callable, Iterator, Sequence
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
    def records(
        self,
        items: Iterator[tuple[int, Any]],
        lsn: int,
        payload: bytes,
        at: int,
        kinds: tuple[tuple[bytes, ...], tuple[bytes, ...], tuple[bytes, ...], tuple[bytes, ...]],
        total: int,
        order: int,
        topic: str,
        headers: Any,
        max_bytes: int,
        limit: int,
        trailing: tuple[int, ...],
        slots: bytes,
        /,
    ) -> tuple[list[Any], int, int, tuple[int, Any] | None]: ...

def accelerate_sha256(on: bool, /) -> bool: ...
