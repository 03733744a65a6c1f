from collections.abc import Callable, Sequence
from typing import Any

class RowPlan:
    def __init__(
        self,
        names: tuple[bytes, ...],
        kinds: bytes,
        key_idx: tuple[int, ...],
        converters: tuple[Callable[[str], Any], ...],
        dumps: Callable[[Any], bytes],
        /,
    ) -> None: ...
    def record(
        self, values: Sequence[str | None], pieces: tuple[bytes, ...], numbers: tuple[int, ...], /
    ) -> tuple[bytes, bytes | None]: ...
    def record_tuple(
        self, buf: bytes, pos: int, pieces: tuple[bytes, ...], numbers: tuple[int, ...], /
    ) -> tuple[bytes, bytes | None] | None: ...
