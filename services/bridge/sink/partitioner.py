"""Kafka's Java partitioner (``Utils.murmur2``), for records the sink must place itself.

librdkafka's ``murmur2_random`` partitioner is the same function (and a random partition
for a null key), so a key lands on the same partition whether the sink or librdkafka picks
it. The sink picks only while a topic still has partitions this producer has not written
(see ``sink.FirstWrites``); afterwards librdkafka does, in C.
"""

from __future__ import annotations

import struct

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Java's ``Utils.murmur2`` as an unsigned 32-bit value."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    whole = length // 4
    for (k,) in struct.iter_unpack("<I", data[: whole * 4]):
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = ((h * _M) & _MASK) ^ k
    tail = length & 3
    base = whole * 4
    if tail == 3:
        h ^= data[base + 2] << 16
    if tail >= 2:
        h ^= data[base + 1] << 8
    if tail >= 1:
        h ^= data[base]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    return h ^ (h >> 15)


def partition_for(key: bytes | None, partitions: int) -> int:
    """The partition Kafka's default partitioner gives ``key`` (0 for a null key: any
    partition is right for it, and one already proven costs nothing)."""
    if partitions == 1 or key is None:
        return 0
    return (murmur2(key) & 0x7FFFFFFF) % partitions
