"""Changes applied per second into current-state tables, next to a plain Kafka->Parquet append.

    .venv/bin/python bench/spark_merge_bench.py --bootstrap HOST:PORT [--changes 1000000]

Publishes ``--changes`` synthetic changes (inserts, updates, deletes over a key space of a
tenth of that) in the bridge's format, then times, in the same Spark session and on the
same records: (1) the consumer (history + current-state MERGE) and (2) an append of the raw
records to Parquet. Prints both rates and their ratio.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
import uuid
from pathlib import Path

from spark_consumers.job import build_session, start_query
from spark_consumers.kafka import kafka_options
from spark_consumers.settings import ConsumerSettings
from spark_consumers.status import Status
from spark_consumers.synthetic import SynthColumn, SynthTable, TransactionalWriter

NUM = ((12 << 16) | 2) + 4


def publish(bootstrap: str, prefix: str, changes: int) -> None:
    table = SynthTable(prefix, "public", "bench", (
        SynthColumn("id", "bigint", 20, key=True), SynthColumn("name", "text", 25),
        SynthColumn("amount", "numeric(12,2)", 1700, NUM),
        SynthColumn("at", "timestamp with time zone", 1184)))
    writer = TransactionalWriter(bootstrap, f"{prefix}-bench")
    writer.create_topics([table.topic], compacted=[f"{prefix}.schema"])
    writer.send([table.schema_record()])
    rng = random.Random(1)
    keys = max(1, changes // 10)
    live: set[int] = set()
    batch = []
    for n in range(changes):
        key = rng.randrange(keys)
        if key in live and rng.random() < 0.1:
            batch += table.change("d", {"id": key}, 1000 + n, 1, n)
            live.discard(key)
        else:
            batch += table.change("u" if key in live else "c",
                                  {"id": key, "name": f"name {n}", "amount": f"{n % 100000}.50",
                                   "at": "2024-05-01T10:00:00.000001Z"}, 1000 + n, 1, n)
            live.add(key)
        if len(batch) >= 20_000:
            writer.send(batch)
            batch = []
    writer.send(batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--changes", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=200_000, help="max records per batch")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="spark-bench-"))
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    publish(args.bootstrap, prefix, args.changes)
    print(f"published {args.changes} changes in {time.monotonic() - started:.1f}s")
    settings = ConsumerSettings(kafka_bootstrap=args.bootstrap, topic_prefix=prefix,
                                warehouse=str(root / "wh"), checkpoint_dir=str(root / "ck"),
                                spark_master="local[2]", max_offsets_per_trigger=args.batch,
                                log_format="text")
    spark = build_session(settings)
    started = time.monotonic()
    query = start_query(spark, settings, Status(), once=True)
    query.awaitTermination()
    merge_s = time.monotonic() - started
    started = time.monotonic()
    plain = (spark.readStream.format("kafka").options(**kafka_options(settings))
             .option("subscribe", f"{prefix}.public.bench").option("startingOffsets", "earliest")
             .option("maxOffsetsPerTrigger", str(args.batch)).load()
             .selectExpr("CAST(key AS STRING) key", "CAST(value AS STRING) value")
             .writeStream.format("parquet").option("path", str(root / "parquet"))
             .option("checkpointLocation", str(root / "ck-parquet"))
             .trigger(availableNow=True).start())
    plain.awaitTermination()
    append_s = time.monotonic() - started
    merge_rate, append_rate = args.changes / merge_s, args.changes / append_s
    print(f"delta merge (history + current state): {merge_rate:,.0f} changes/s ({merge_s:.1f}s)")
    print(f"plain kafka -> parquet append:         {append_rate:,.0f} records/s "
          f"({append_s:.1f}s)")
    print(f"ratio merge/append: {merge_rate / append_rate:.2f}")
    spark.stop()


if __name__ == "__main__":
    main()
