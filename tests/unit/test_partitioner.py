"""Java-compatible partitioning and the first-write bookkeeping of the sink."""

from __future__ import annotations

import pytest

from services.bridge.sink.kafka import FirstWrites
from services.bridge.sink.partitioner import murmur2, partition_for

# Kafka's own UtilsTest.testMurmur2 vectors (signed Java ints).
JAVA = [
    (b"21", -973932308),
    (b"foobar", -790332482),
    (b"a-little-bit-long-string", -985981536),
    (b"a-little-bit-longer-string", -1486304829),
    (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
    (b"abc", 479470107),
]


@pytest.mark.parametrize(("key", "expected"), JAVA)
def test_murmur2_equals_java(key: bytes, expected: int) -> None:
    assert murmur2(key) == expected & 0xFFFFFFFF


def test_partition_is_positive_hash_modulo_count() -> None:
    assert partition_for(b"foobar", 1) == 0
    assert partition_for(None, 12) == 0
    # -790332482 & 0x7fffffff = 1357151166
    assert partition_for(b"foobar", 7) == 1357151166 % 7
    assert {partition_for(str(i).encode(), 5) for i in range(100)} == set(range(5))


def test_first_writes_settle_a_topic_once_every_partition_is_written() -> None:
    first = FirstWrites()
    assert first.is_new("t", 0) and first.is_new("t", 1)
    first.written("t", 0, 2)
    assert not first.is_new("t", 0) and first.is_new("t", 1)
    assert "t" not in first.settled
    first.written("t", 1, 2)
    assert "t" in first.settled
    first.forget()
    assert first.is_new("t", 0) and "t" not in first.settled


def test_first_writes_are_renewed_before_the_broker_forgets_the_producer() -> None:
    first = FirstWrites(renew_s=0.0)
    first.written("t", 0, 1)
    first.renew_if_old()
    assert first.is_new("t", 0) and not first.settled
    kept = FirstWrites(renew_s=3600.0)
    kept.written("t", 0, 1)
    kept.renew_if_old()
    assert not kept.is_new("t", 0)
