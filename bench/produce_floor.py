"""The cost of handing records to librdkafka alone: the floor under any bridge built on it.

    python bench/produce_floor.py [--records 500000] [--compression lz4] [--stack-dir DIR]

Pre-built records (a typical 1000-row-transaction change record and its key) go to a fresh
one-partition topic of the local stack, in Kafka transactions of 20,000 records as the bridge
commits under backlog, two ways, each with the bridge's own producer settings
(``sink.producer_config``):

- ``produce()``: one confluent-kafka ``Producer.produce`` call per record;
- ``sink``: the bridge's ``KafkaSink.produce_all``, which hands runs of records to
  librdkafka in one call each (confluent-kafka's public ``Producer.produce_batch``).

Printed for each: records/s, this process's CPU microseconds per record (the calls plus
librdkafka's own threads: batching, compression, the network) and the microseconds spent
handing records over (inside produce(), or produce_all()); then the sink's ratios to
produce(). The broker's CPU is not in it; bridge_bench prints that separately.

Figures, not assertions: run it a few times on a quiet machine.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from confluent_kafka import Producer

# NewTopic's public home (the stubs do not declare the re-export).
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from services.bridge.settings import BridgeSettings
from services.bridge.sink import KafkaSink, producer_config
from slotbridge_dev.stack.stack import Stack

ROOT = Path(__file__).resolve().parents[1]
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


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _produce_calls(settings: BridgeSettings, topic: str, keys: list[bytes]) -> dict[str, float]:
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
                send(topic, VALUE, key)
                break
            except BufferError:
                producer.poll(0.05)
        inside += time.perf_counter() - called
    producer.flush()
    producer.commit_transaction()
    return {"seconds": time.perf_counter() - began, "cpu": _cpu_s() - cpu_began, "inside": inside}


def _sink_runs(settings: BridgeSettings, topic: str, keys: list[bytes]) -> dict[str, float]:
    """The bridge's sink: ``produce_all`` over each Kafka transaction's records."""
    sink = KafkaSink(settings)
    try:
        sink.start()
        sink.ensure_topics({topic: False})
        sink.begin()
        sink.produce(topic, b"{}", VALUE)  # the partition's first write, alone (FirstWrites)
        sink.commit()
        records = [(topic, key, VALUE, None) for key in keys]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--compression", default="lz4", help="compression.type")
    parser.add_argument("--stack-dir", type=Path, default=ROOT / ".stack" / "bench")
    args = parser.parse_args()
    stack = Stack(args.stack_dir)
    stack.up()
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    keys = [b'{"id":%d}' % i for i in range(args.records)]
    results = {}
    for name, run in (("produce()", _produce_calls), ("sink", _sink_runs)):
        topic = f"produce-floor-{uuid.uuid4().hex[:8]}"
        admin.create_topics([NewTopic(topic, 1, 1)])[topic].result()
        settings = BridgeSettings(
            source_dsn="host=unused",
            kafka_bootstrap=stack.kafka_bootstrap,
            slot_name=topic.replace("-", "_"),
            kafka_transactional_id=topic,
            kafka_config={"compression.type": args.compression},
        )
        results[name] = figures = run(settings, topic, keys)
        admin.delete_topics([topic])
        print(
            f"{name:<9} {args.records:,} records of {len(VALUE)} B, compression "
            f"{args.compression}: {args.records / figures['seconds']:,.0f} records/s, process "
            f"CPU {figures['cpu'] / args.records * 1e6:.2f} us/record, handing over "
            f"{figures['inside'] / args.records * 1e6:.2f} us/record"
        )
    calls, sink = results["produce()"], results["sink"]
    print(
        f"sink / produce(): records/s {calls['seconds'] / sink['seconds']:.2f}x, CPU "
        f"{sink['cpu'] / calls['cpu']:.2f}x, handing over {sink['inside'] / calls['inside']:.2f}x"
    )


if __name__ == "__main__":
    main()
