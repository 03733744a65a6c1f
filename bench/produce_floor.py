"""The cost of handing records to librdkafka alone: the floor under any bridge built on it.

    python bench/produce_floor.py [--records 500000] [--compression lz4] [--stack-dir DIR]
                                  [--keep-stack]

Pre-built records (a typical 1000-row-transaction change record and its key) go to a fresh
one-partition topic of the local stack, in Kafka transactions of 20,000 records as the bridge
commits under backlog, two ways, each with the bridge's own producer settings
(``sink.producer_config``):

- ``produce()``: one confluent-kafka ``Producer.produce`` call per record;
- ``sink``: the bridge's ``KafkaSink.produce_all``, which hands runs of records to
  librdkafka in one call each (confluent-kafka's public ``Producer.produce_batch``);

and each again with the four ``__debezium.context.*`` headers the Debezium format puts on
every change record (``--headers``): ``produce_batch`` takes no headers, so the sink hands
such records over with a ``produce()`` call each.

``--c`` adds a third way, what a producer of our own could reach: ``bench/produce_floor.c``,
a C program owning its producer with the same settings, handing each record over with
librdkafka's public ``rd_kafka_produceva`` (headers included). It is built here against
librdkafka's public header (Debian's ``librdkafka-dev``) and the librdkafka of
confluent-kafka's wheel (the library the bridge runs; the system's if the wheel has none).

Printed for each: records/s, this process's CPU microseconds per record (the calls plus
librdkafka's own threads: batching, compression, the network) and the microseconds spent
handing records over (inside produce(), or produce_all()); then the sink's ratios to
produce(). The broker's CPU is not in it; bridge_bench prints that separately.

Figures, not assertions: run it a few times on a quiet machine.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import confluent_kafka
from confluent_kafka import Producer

# NewTopic's public home (the stubs do not declare the re-export).
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from bench.bridge_bench import add_stack_arguments, bench_stack
from services.bridge.records.debezium import context_headers_of
from services.bridge.records.events import Headers
from services.bridge.settings import BridgeSettings
from services.bridge.sink.kafka import KafkaSink, producer_config
from slotbridge_dev.stack.stack import Stack

BATCH = 20_000  # batch_max_events' default
VALUE = (
    b'{"before":null,"after":{"id":123456,"a":42,"b":"customer 123456 note","c":"1543.75",'
    b'"d":"2024-01-02T10:17:36Z"},"source":{"connector":"slotbridge","version":"0.1.0",'
    b'"name":"bench","db":"postgres","schema":"public","table":"bench","txId":1234,'
    b'"lsn":5412376,"commit_lsn":5412999,"ts_ms":1700000000000,"snapshot":"false",'
    b'"schema_version":1,"sequence":"[\\"5412999\\",\\"5412376\\"]"},"op":"c",'
    b'"ts_ms":1700000000001,"transaction":{"id":"1234:5412999","total_order":1,'
    b'"data_collection_order":1}}'
)


# A way of handing records over: its name, the function, the records' headers.
Way = tuple[
    str,
    Callable[[BridgeSettings, str, list[bytes], Headers | None], dict[str, float]],
    Headers | None,
]


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _produce_calls(
    settings: BridgeSettings, topic: str, keys: list[bytes], headers: Headers | None
) -> dict[str, float]:
    """One ``Producer.produce`` call per record."""
    producer = Producer(
        {
            **producer_config(settings, 1_000_000),
            "on_delivery": lambda err, msg: None,
            "delivery.report.only.error": True,
        }
    )
    producer.init_transactions()
    send = producer.produce
    cpu_began, began = _cpu_s(), time.perf_counter()
    inside = 0.0
    producer.begin_transaction()
    for i, key in enumerate(keys):
        if i and i % BATCH == 0:
            producer.flush()
            producer.commit_transaction()
            producer.begin_transaction()
        called = time.perf_counter()
        while True:
            try:
                send(topic, VALUE, key, headers=headers)
                break
            except BufferError:
                producer.poll(0.05)
        inside += time.perf_counter() - called
    producer.flush()
    producer.commit_transaction()
    return {"seconds": time.perf_counter() - began, "cpu": _cpu_s() - cpu_began, "inside": inside}


def _sink_runs(
    settings: BridgeSettings, topic: str, keys: list[bytes], headers: Headers | None
) -> dict[str, float]:
    """The bridge's sink: ``produce_all`` over each Kafka transaction's records."""
    sink = KafkaSink(settings)
    try:
        sink.start()
        sink.topics.ensure({topic: False})
        sink.begin()
        sink.produce(topic, b"{}", VALUE)  # the partition's first write, alone (FirstWrites)
        sink.commit()
        records = [(topic, key, VALUE, headers) for key in keys]
        cpu_began, began = _cpu_s(), time.perf_counter()
        inside = 0.0
        for first in range(0, len(records), BATCH):
            sink.begin()
            called = time.perf_counter()
            sink.produce_all(iter(records[first : first + BATCH]), ())
            inside += time.perf_counter() - called
            sink.commit()
        return {
            "seconds": time.perf_counter() - began,
            "cpu": _cpu_s() - cpu_began,
            "inside": inside,
        }
    finally:
        sink.close()


def _c_produceva(
    settings: BridgeSettings, topic: str, keys: list[bytes], headers: Headers | None
) -> dict[str, float]:
    """``produce_floor.c``: the same records from C through ``rd_kafka_produceva``."""
    folder = Path(tempfile.mkdtemp(prefix="produce-floor-"))
    try:
        program = _build_c_floor(folder)
        value = folder / "value"
        value.write_bytes(VALUE)
        config = [
            f"c:{name}={str(setting).lower() if isinstance(setting, bool) else setting}"
            for name, setting in producer_config(settings, 1_000_000).items()
            if isinstance(setting, str | int)
        ]
        header_args = [
            f"h:{name}={data.decode() if isinstance(data, bytes) else data}"
            for name, data in headers or []
            if data is not None
        ]
        out = subprocess.run(
            [str(program), topic, str(len(keys)), str(BATCH), str(value), *config, *header_args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        print(f"(produce_floor.c ran librdkafka {out[3]})")
        return {"seconds": float(out[0]), "cpu": float(out[1]), "inside": float(out[2])}
    finally:
        shutil.rmtree(folder)


def _build_c_floor(folder: Path) -> Path:
    """``produce_floor.c`` compiled into ``folder``, linked to the wheel's librdkafka."""
    if not Path("/usr/include/librdkafka/rdkafka.h").exists() or shutil.which("cc") is None:
        sys.exit("--c needs cc and librdkafka's public header: apt install librdkafka-dev")
    libs = Path(confluent_kafka.__file__).resolve().parents[1] / "confluent_kafka.libs"
    bundled = sorted(libs.glob("librdkafka*.so*"))
    link = (
        [f"-L{libs}", f"-l:{bundled[0].name}", f"-Wl,-rpath,{libs}"] if bundled else ["-lrdkafka"]
    )
    program = folder / "produce_floor"
    source = Path(__file__).with_name("produce_floor.c")
    subprocess.run(["cc", "-O2", "-o", str(program), str(source), *link], check=True)
    return program


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--compression", default="lz4", help="compression.type")
    add_stack_arguments(parser)
    parser.add_argument(
        "--headers",
        action="store_true",
        help="also each way with the Debezium format's four context headers on every record",
    )
    parser.add_argument(
        "--c",
        action="store_true",
        help="also from C through librdkafka's public API (bench/produce_floor.c)",
    )
    args = parser.parse_args()
    with bench_stack(args) as stack:
        _compare(args, stack)


def _compare(args: argparse.Namespace, stack: Stack) -> None:
    """Each way over the same records, then the ratios."""
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    keys = [b'{"id":%d}' % i for i in range(args.records)]
    results = {}
    ways: list[Way] = [("produce()", _produce_calls, None), ("sink", _sink_runs, None)]
    if args.c:
        ways.append(("C", _c_produceva, None))
    if args.headers:
        headers = context_headers_of("bench", "0190a3b4-0000-7000-8000-000000000000")
        ways += [("produce()+h", _produce_calls, headers), ("sink+h", _sink_runs, headers)]
        if args.c:
            ways.append(("C+h", _c_produceva, headers))
    for name, run, with_headers in ways:
        topic = f"produce-floor-{uuid.uuid4().hex[:8]}"
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result()
        settings = BridgeSettings(
            source_dsn="host=unused",
            kafka_bootstrap=stack.kafka_bootstrap,
            slot_name=topic.replace("-", "_"),
            kafka_transactional_id=topic,
            kafka_config={"compression.type": args.compression},
        )
        results[name] = figures = run(settings, topic, keys, with_headers)
        admin.delete_topics([topic])
        print(
            f"{name:<11} {args.records:,} records of {len(VALUE)} B, compression "
            f"{args.compression}: {args.records / figures['seconds']:,.0f} records/s, process "
            f"CPU {figures['cpu'] / args.records * 1e6:.2f} us/record, handing over "
            f"{figures['inside'] / args.records * 1e6:.2f} us/record"
        )
    for way, base in (
        ("sink", "produce()"),
        ("produce()+h", "produce()"),
        ("sink+h", "sink"),
        ("sink", "C"),
        ("sink+h", "C+h"),
    ):
        if way not in results or base not in results:
            continue
        tried, against = results[way], results[base]
        print(
            f"{way} / {base}: records/s {against['seconds'] / tried['seconds']:.2f}x, CPU "
            f"{tried['cpu'] / against['cpu']:.2f}x, handing over "
            f"{tried['inside'] / against['inside']:.2f}x"
        )


if __name__ == "__main__":
    main()
