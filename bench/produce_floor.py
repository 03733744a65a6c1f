"""The cost of handing records to librdkafka alone: the floor under any bridge built on it.

    python bench/produce_floor.py [--records 500000] [--compression lz4] [--stack-dir DIR]

A transactional producer with the bridge's own producer settings (``sink.producer_config``)
sends ``--records`` pre-built records (a typical 1000-row-transaction change record and its
key) to a fresh one-partition topic of the local stack, committing every 20,000 records as
the bridge does under backlog. Printed: records/s, this process's CPU microseconds per record
(the produce() calls plus librdkafka's own threads: batching, compression, the network) and
the microseconds spent inside produce() itself. The broker's CPU is not in it; bridge_bench
prints that separately.

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
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from services.bridge.settings import BridgeSettings
from services.bridge.sink import producer_config
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=500_000)
    parser.add_argument("--compression", default="lz4", help="compression.type")
    parser.add_argument("--stack-dir", type=Path, default=ROOT / ".stack" / "bench")
    args = parser.parse_args()
    stack = Stack(args.stack_dir)
    stack.up()
    topic = f"produce-floor-{uuid.uuid4().hex[:8]}"
    settings = BridgeSettings(
        source_dsn="host=unused",
        kafka_bootstrap=stack.kafka_bootstrap,
        kafka_transactional_id=topic,
        kafka_config={"compression.type": args.compression},
    )
    admin = AdminClient({"bootstrap.servers": stack.kafka_bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result()
    producer = Producer(
        {
            **producer_config(settings, 1_000_000),
            "on_delivery": lambda err, msg: None,
            "delivery.report.only.error": True,
        }
    )
    producer.init_transactions()
    keys = [b'{"id":%d}' % i for i in range(args.records)]
    send = producer.produce
    cpu_began, began = _cpu_s(), time.perf_counter()
    in_produce = 0.0
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
        in_produce += time.perf_counter() - called
    producer.flush()
    producer.commit_transaction()
    seconds, cpu = time.perf_counter() - began, _cpu_s() - cpu_began
    admin.delete_topics([topic])
    print(
        f"{args.records:,} records of {len(VALUE)} B, compression {args.compression}: "
        f"{args.records / seconds:,.0f} records/s, process CPU {cpu / args.records * 1e6:.2f} "
        f"us/record, inside produce() {in_produce / args.records * 1e6:.2f} us/record"
    )


if __name__ == "__main__":
    main()
