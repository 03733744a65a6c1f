"""Decoder throughput: pgoutput messages/s for decode only and for decode + typing values.

    python bench/decoder_bench.py [--count N] [--repeat R] [--profile WORKLOAD]

Synthetic payloads built in memory (no server): each workload is N copies of a few
distinct messages. Prints the best of R runs per workload; figures, not assertions.
``--profile`` runs one workload's decode+convert under cProfile and prints the top
functions, which is how the hot path was tuned.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import struct
import time
from collections.abc import Callable, Sequence

from services.bridge.decode import messages as m
from services.bridge.decode.decoder import PgOutputDecoder
from services.bridge.records.values import Converter, JsonValue, converter_for

RELATION_OID = 16_401


def _tuple(values: Sequence[str | None]) -> bytes:
    out = [struct.pack("!H", len(values))]
    for value in values:
        if value is None:
            out.append(b"n")
        else:
            raw = value.encode()
            out.append(b"t" + struct.pack("!I", len(raw)) + raw)
    return b"".join(out)


def _insert(row: Sequence[str | None]) -> bytes:
    return b"I" + struct.pack("!I", RELATION_OID) + b"N" + _tuple(row)


def _update_with_key(key: Sequence[str | None], row: Sequence[str | None]) -> bytes:
    return b"U" + struct.pack("!I", RELATION_OID) + b"K" + _tuple(key) + b"N" + _tuple(row)


def _int_text_rows(i: int) -> list[str | None]:
    return [str(1_000_000 + i), f"customer {i}", str(i % 97), "a short note", str(i * 7)]


INT_TEXT_TYPES = (20, 25, 23, 25, 23)
MIXED_TYPES = (20, 1700, 1184, 3802, 1007, 701, 16, 2950)


def _mixed_row(i: int) -> list[str | None]:
    return [
        str(i),
        f"{i}.25",
        "2024-11-21 00:43:10.123456+00",
        f'{{"k": {i}, "tags": ["a"]}}',
        "{1,2,3,NULL}",
        "3.141592653589793",
        "t",
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
    ]


WORKLOADS: dict[str, tuple[tuple[int, ...], Callable[[int], bytes]]] = {
    "insert 5 cols int/text": (INT_TEXT_TYPES, lambda i: _insert(_int_text_rows(i))),
    "update K+N int/text": (
        INT_TEXT_TYPES,
        lambda i: _update_with_key([str(1_000_000 + i), None, None, None, None], _int_text_rows(i)),
    ),
    "insert 8 cols mixed types": (MIXED_TYPES, lambda i: _insert(_mixed_row(i))),
}


def _typed(converters: Sequence[Converter], tup: m.TupleData) -> list[JsonValue]:
    # The event builder's per-row loop in miniature (it also resolves TOAST markers).
    return [
        conv(v) if isinstance(v, str) else None for conv, v in zip(converters, tup, strict=True)
    ]


def _run(payloads: list[bytes], converters: Sequence[Converter] | None) -> float:
    decode = PgOutputDecoder(4).decode
    start = time.perf_counter()
    if converters is None:
        for payload in payloads:
            decode(payload)
    else:
        for payload in payloads:
            msg = decode(payload)
            assert isinstance(msg, m.Insert | m.Update)
            if isinstance(msg, m.Update) and msg.old is not None:
                _typed(converters, msg.old)
            _typed(converters, msg.new)
    return len(payloads) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--profile", choices=sorted(WORKLOADS))
    args = parser.parse_args()

    if args.profile:
        types, make = WORKLOADS[args.profile]
        payloads = [make(i % 1000) for i in range(args.count)]
        converters = [converter_for(t) for t in types]
        profiler = cProfile.Profile()
        profiler.runcall(_run, payloads, converters)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
        return

    print(f"{'workload':28} {'decode msg/s':>14} {'decode+convert msg/s':>22} {'ratio':>7}")
    for name, (types, make) in WORKLOADS.items():
        payloads = [make(i % 1000) for i in range(args.count)]
        converters = [converter_for(t) for t in types]
        decode_rate = max(_run(payloads, None) for _ in range(args.repeat))
        full_rate = max(_run(payloads, converters) for _ in range(args.repeat))
        print(f"{name:28} {decode_rate:14,.0f} {full_rate:22,.0f} {full_rate / decode_rate:7.2f}")


if __name__ == "__main__":
    main()
