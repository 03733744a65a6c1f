from typing import Any

from confluent_kafka import Producer

class Sender:
    def send(
        self,
        records: list[Any],
        start: int,
        settled: set[str] | frozenset[str],
        /,
    ) -> tuple[int, int]: ...

def bind(library: str, producer: Producer, /) -> Sender: ...
