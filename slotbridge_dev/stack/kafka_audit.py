"""What the broker's own log holds, checked against the bridge's exactly-once promise.

Test and bench tooling. A consumer shows what it happened to read; the log segments show
what the broker stored. KAFKA-15591 lost records that a consumer-side check "explained"
as a read race, so every exactly-once test ends here:

- Kafka's ``DumpLogSegments`` (kafka-tools from the jar cache) gives every
  batch's producer id, epoch and sequences and every COMMIT/ABORT marker;
- a read_uncommitted consumer gives the records themselves, matched by offset;
- then, per partition and producer (id, epoch): sequences start at 0 and are contiguous;
  per producer id: each data record belongs to a committed, aborted or still open Kafka
  transaction; across topics: every source transaction's END record is committed once,
  with its BEGIN (none, for a bridge with ``transaction_begin_records: false``), and the
  change records (and logical messages) committed for it are
  exactly its ``event_count``, none twice. A bridge with ``transaction_metadata: false``
  writes no END to count against: there no record may be on the transaction topic, no
  change committed twice, and each source transaction's changes (one without logical
  messages, whose places in its total order hold no change) must be its total order's
  1..n without a hole; a transaction's lost tail cannot be told from its end there.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from services.common.kafka import END_READER_CONFIG
from services.contract.topics import message_topic, schema_topic, transaction_topic
from slotbridge_dev.stack.kafka import Kafka, dump_log_segments, dump_transaction_log

_PARTITION_DIR = re.compile(r"^(?P<topic>.+)-(?P<partition>\d+)$")
_FIELD = re.compile(r"(\w+): (\S+)")

# What the audit keeps of a record's JSON value, given its topic (see ``read_records``).
Essence = Callable[[str, Any], Any]
# A committed record, as the source-transaction check needs it (see ``_event``).
Event = tuple[Any, ...]


@dataclass
class Batch:
    base_offset: int
    last_offset: int
    count: int
    base_sequence: int
    last_sequence: int
    producer_id: int
    epoch: int
    transactional: bool
    control: bool
    marker: str = ""  # COMMIT or ABORT, for a control batch


@dataclass
class Partition:
    topic: str
    partition: int
    log_start: int = 0
    batches: list[Batch] = field(default_factory=list)


@dataclass
class AuditReport:
    partitions: int = 0
    batches: int = 0
    committed: int = 0
    aborted: int = 0
    open: int = 0
    source_transactions: int = 0
    change_records: int = 0
    snapshot_records: int = 0
    problems: list[str] = field(default_factory=list)
    # What each problem means for exactly-once: lost, duplicated, sequence_gap, open;
    # unexpected: a record the bridge's settings say it does not write.
    kinds: Counter[str] = field(default_factory=Counter)

    def problem(self, kind: str, text: str) -> None:
        self.kinds[kind] += 1
        self.problems.append(text)

    def summary(self) -> str:
        return (
            f"audit: {self.partitions} partitions, {self.batches} batches, records "
            f"committed={self.committed} aborted={self.aborted} open={self.open}; source "
            f"transactions={self.source_transactions}, change records="
            f"{self.change_records}, snapshot records={self.snapshot_records}; "
            f"problems={len(self.problems)}"
        )

    def assert_clean(self) -> None:
        if self.problems:
            shown = "\n".join(self.problems[:40])
            more = len(self.problems) - 40
            raise AssertionError(
                f"{self.summary()}\n{shown}" + (f"\n... and {more} more" if more > 0 else "")
            )


def partition_dirs(data_dir: Path, topics: Iterable[str]) -> list[tuple[str, int, Path]]:
    """The live partition folders of ``topics`` (a deleted topic's folder is renamed)."""
    wanted = set(topics)
    found = []
    for path in data_dir.iterdir():
        match = _PARTITION_DIR.match(path.name)
        if match and match["topic"] in wanted and path.is_dir():
            found.append((match["topic"], int(match["partition"]), path))
    return sorted(found)


def topics_with_prefix(data_dir: Path, prefix: str) -> list[str]:
    names = {
        m["topic"]
        for p in data_dir.iterdir()
        if (m := _PARTITION_DIR.match(p.name)) and m["topic"].startswith(prefix + ".")
    }
    return sorted(names)


def dump_segments(dirs: list[tuple[str, int, Path]]) -> list[Partition]:
    """Batches and markers of every segment, through Kafka's own DumpLogSegments."""
    by_file: dict[str, Partition] = {}
    started: set[int] = set()
    files = []
    for topic, number, path in dirs:
        part = Partition(topic, number)
        for segment in sorted(path.glob("*.log")):
            by_file[str(segment)] = part
            files.append(segment)
    if not files:
        return []
    dump = dump_log_segments(*files, payloads=False)
    current: Partition | None = None
    for line in dump.splitlines():
        if line.startswith("Dumping "):
            current = by_file[line[len("Dumping ") :].strip()]
        elif line.startswith("Log starting offset: ") and current is not None:
            # Segments come oldest first: the first one's base offset is where the log
            # starts (above 0 once retention or compaction removed older segments).
            if id(current) not in started:
                current.log_start = int(line.rsplit(" ", 1)[1])
                started.add(id(current))
        elif line.startswith("baseOffset: ") and current is not None:
            f = dict(_FIELD.findall(line))
            current.batches.append(
                Batch(
                    int(f["baseOffset"]),
                    int(f["lastOffset"]),
                    int(f["count"]),
                    int(f["baseSequence"]),
                    int(f["lastSequence"]),
                    int(f["producerId"]),
                    int(f["producerEpoch"]),
                    f["isTransactional"] == "true",
                    f["isControl"] == "true",
                )
            )
        elif "endTxnMarker: " in line and current is not None and current.batches:
            current.batches[-1].marker = line.split("endTxnMarker: ", 1)[1].split()[0]
        elif line.startswith(("Found ", "Exception")):
            raise AssertionError(f"DumpLogSegments: {line}")
    return list({id(p): p for p in by_file.values()}.values())


def read_records(
    bootstrap: str,
    parts: list[Partition],
    keep: Callable[[str, int, int], bool],
    essence: Essence,
    stall_s: float = 120.0,
) -> dict[tuple[str, int, int], Any]:
    """(topic, partition, offset) -> what ``essence`` makes of each data record's JSON
    value (the bridge writes nothing else) where ``keep`` says so, else None: every record
    is read, aborted ones included, but a long run's records would not all fit in memory.

    ``stall_s``: how long the read may go without a record or an end of partition; never
    a bound on the whole read, which grows with the topics."""
    consumer = Consumer(
        {
            **END_READER_CONFIG,
            "bootstrap.servers": bootstrap,
            "group.id": f"audit-{uuid.uuid4()}",
            "isolation.level": "read_uncommitted",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "log_level": 0,
        }
    )
    out: dict[tuple[str, int, int], Any] = {}
    try:
        assign = [
            TopicPartition(p.topic, p.partition, p.log_start)
            for p in parts
            if any(not b.control for b in p.batches)
        ]
        if not assign:
            return out
        consumer.assign(assign)
        pending = {(tp.topic, tp.partition) for tp in assign}
        stalled_at = time.monotonic() + stall_s
        while pending:
            if time.monotonic() > stalled_at:
                raise AssertionError(
                    f"audit read got nothing from {sorted(pending)} for {stall_s}s before their end"
                )
            messages = consumer.consume(10_000, 0.5)
            if messages:
                stalled_at = time.monotonic() + stall_s  # progress: the clock starts again
            for msg in messages:
                error = msg.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        pending.discard((msg.topic(), msg.partition()))
                        continue
                    raise AssertionError(f"audit read: {error}")
                topic, partition = str(msg.topic()), int(msg.partition() or 0)
                offset, value = int(msg.offset() or 0), msg.value()
                out[(topic, partition, offset)] = (
                    essence(topic, json.loads(value) if value is not None else None)
                    if keep(topic, partition, offset)
                    else None
                )
    finally:
        consumer.close()
    return out


def check_sequences(part: Partition, report: AuditReport) -> None:
    """Per producer (id, epoch): the first batch starts at 0, each next one follows on."""
    last: dict[tuple[int, int], int] = {}
    where = f"{part.topic}-{part.partition}"
    for b in part.batches:
        if b.control or b.producer_id < 0:
            continue
        if b.last_sequence - b.base_sequence + 1 != b.count:
            report.problem(
                "sequence_gap",
                f"{where} offset {b.base_offset}: {b.count} records but "
                f"sequences {b.base_sequence}..{b.last_sequence}",
            )
        producer = (b.producer_id, b.epoch)
        expected = last.get(producer)
        if expected is None:
            if b.base_sequence != 0 and part.log_start == 0:
                report.problem(
                    "lost",
                    f"{where}: producer {b.producer_id} epoch {b.epoch} starts at sequence "
                    f"{b.base_sequence} (offset {b.base_offset}); sequences 0.."
                    f"{b.base_sequence - 1} were acknowledged but never stored",
                )
        elif b.base_sequence != expected + 1:
            report.problem(
                "sequence_gap",
                f"{where}: producer {b.producer_id} epoch {b.epoch} jumps from "
                f"sequence "
                f"{expected} to {b.base_sequence} at offset {b.base_offset}",
            )
        last[producer] = b.last_sequence


def transaction_outcomes(part: Partition) -> dict[int, str]:
    """Offset -> committed / aborted / open for every data record of the partition."""
    outcome: dict[int, str] = {}
    waiting: dict[int, list[int]] = defaultdict(list)  # producer id -> offsets in its txn
    for b in part.batches:
        offsets = list(range(b.base_offset, b.last_offset + 1))
        if b.control:
            verdict = "committed" if b.marker == "COMMIT" else "aborted"
            for offset in waiting.pop(b.producer_id, []):
                outcome[offset] = verdict
        elif b.transactional:
            waiting[b.producer_id].extend(offsets)
        else:
            outcome.update(dict.fromkeys(offsets, "committed"))
    for offsets in waiting.values():
        outcome.update(dict.fromkeys(offsets, "open"))
    return outcome


def _whole(topic: str, value: Any) -> Any:
    return value


def audit_topics(
    kafka: Kafka, topics: Iterable[str], essence: Essence = _whole
) -> tuple[AuditReport, list[tuple[str, Any]]]:
    """The log-level checks over ``topics``; also returns (topic, ``essence`` of its value)
    of every committed record. Run it while nobody writes them: an open transaction is
    reported."""
    parts = dump_segments(partition_dirs(kafka.data_dir, topics))
    outcomes = {(p.topic, p.partition): transaction_outcomes(p) for p in parts}
    contents = read_records(
        kafka.bootstrap,
        parts,
        lambda topic, partition, offset: outcomes[(topic, partition)].get(offset) == "committed",
        essence,
    )
    report = AuditReport(partitions=len(parts))
    committed: list[tuple[str, Any]] = []
    for part in parts:
        report.batches += len(part.batches)
        check_sequences(part, report)
        for offset, verdict in sorted(outcomes[(part.topic, part.partition)].items()):
            setattr(report, verdict, getattr(report, verdict) + 1)
            where = (part.topic, part.partition, offset)
            if where not in contents:
                report.problem(
                    "lost",
                    f"{part.topic}-{part.partition} offset {offset}: in the log but not readable",
                )
            elif verdict == "committed":
                committed.append((part.topic, contents[where]))
    if report.open:
        report.problem("open", f"{report.open} records are in Kafka transactions still open")
    return report, committed


def audit(
    kafka: Kafka,
    prefix: str,
    extra_topics: Iterable[str] = (),
    *,
    begin_records: bool = True,
    end_records: bool = True,
) -> AuditReport:
    """Everything a bridge with topic prefix ``prefix`` wrote (``{prefix}.*`` and
    ``extra_topics``, i.e. its progress topic): the log-level checks, then the source
    transactions against their END records (``begin_records``: the bridge's
    ``transaction_begin_records``, whether each END must have a BEGIN or none may;
    ``end_records``: its ``transaction_metadata``, without which there is no END to count
    against and no record of the transaction topic may be found)."""
    internal = {*extra_topics, schema_topic(prefix)}
    transactions, messages = transaction_topic(prefix), message_topic(prefix)

    def essence(topic: str, value: Any) -> Event | None:
        return None if topic in internal else _event(topic, value, transactions, messages)

    report, committed = audit_topics(
        kafka, sorted({*topics_with_prefix(kafka.data_dir, prefix), *internal}), essence
    )
    events = [e for _, e in committed if e is not None]
    if end_records:
        _check_source_transactions(events, report, begin_records=begin_records)
    else:
        _check_without_transaction_records(events, report)
    return report


@dataclass(frozen=True)
class TransactionAt:
    """A Kafka transaction as a partition's log holds it: whose, and whether its COMMIT or
    ABORT marker is in the log yet."""

    producer_id: int
    ended: bool


def transaction_at(kafka: Kafka, topic: str, partition: int, offset: int) -> TransactionAt | None:
    """The Kafka transaction whose first record in the partition's log is at ``offset``,
    if one's is: the one reason a read_committed reader may stop there, below the high
    watermark (the last stable offset is the first offset of the oldest transaction
    without a marker). It may have ended since the reader stopped."""
    dirs = [d for d in partition_dirs(kafka.data_dir, [topic]) if d[1] == partition]
    [part] = dump_segments(dirs)
    started: dict[int, int] = {}  # producer id -> first offset of its open transaction
    found: int | None = None
    for b in part.batches:
        if b.control:
            if started.pop(b.producer_id, None) == offset:
                return TransactionAt(b.producer_id, ended=True)
        elif b.transactional and b.producer_id not in started:
            started[b.producer_id] = b.base_offset
            if b.base_offset == offset:
                found = b.producer_id
    return None if found is None else TransactionAt(found, ended=False)


# Kafka's ids of a transaction's states in its transaction log: PrepareCommit and
# CompleteCommit, the two that say the coordinator has decided to commit.
_COMMIT_DECIDED = {2, 4}
_TRANSACTION_LOG = "__transaction_state"


def committing_producers(kafka: Kafka) -> set[int]:
    """The producers whose last transaction the coordinator has decided to commit, from
    the transaction log as the broker stored it (PrepareCommit or CompleteCommit).

    A producer's commit returns once the coordinator has written PrepareCommit there: the
    transaction commits from then on, whatever fails, and the coordinator writes the
    COMMIT markers into the transaction's partitions after. A read_committed reader stops
    before a partition's records of that transaction until its marker is in, which can
    take as long as a follower is away: in test_kafka_insync, a transaction committing
    while the follower shut down stayed in PrepareCommit until it was back (31-43 s, in 4
    of 6 runs under load). In one, the follower's shutdown had moved the progress
    partition's leadership 30 ms before PrepareCommit, and that partition's marker was
    missing 14 s later, while the three others had theirs 90 ms after PrepareCommit.
    """
    dirs = partition_dirs(kafka.data_dir, [_TRANSACTION_LOG])
    segments = [s for _, _, path in dirs for s in sorted(path.glob("*.log")) if s.stat().st_size]
    if not segments:
        return set()
    last: dict[str, tuple[int, int]] = {}  # transactional id -> (producer id, state)
    for line in dump_transaction_log(*segments).splitlines():
        if " key: " not in line or " payload: " not in line:
            continue
        key, payload = line.split(" key: ", 1)[1].split(" payload: ", 1)
        transactional_id = json.loads(key)["data"]["transactionalId"]
        if payload.strip() == "<DELETE>":  # expired and removed by the coordinator
            last.pop(transactional_id, None)
            continue
        state = json.loads(payload)["data"]
        # A transactional id lives in one partition of the log, in the order written.
        last[transactional_id] = (int(state["producerId"]), int(state["transactionStatus"]))
    return {producer for producer, status in last.values() if status in _COMMIT_DECIDED}


def _event(topic: str, value: Any, transactions: str, messages: str) -> Event | None:
    """What the source-transaction check needs of a committed record: a few fields, the
    row as a digest (a long run's rows would not all fit in memory); None for a tombstone."""
    if value is None:
        return None
    if "payload" in value and "schema" in value:
        value = value["payload"]  # the Debezium format's Connect JSON
    if topic == transactions:
        if value["status"] == "END":
            return ("end", value["id"], value["event_count"])
        return ("begin", value["id"])
    if topic == messages:
        return ("message", f"{value['txId']}:{value['commit_lsn']}", value["lsn"])
    if value["source"]["snapshot"] != "false":
        return ("snapshot",)
    txn = value["transaction"]
    row = json.dumps(value["after"] or value["before"], sort_keys=True).encode()
    digest = hashlib.blake2b(row, digest_size=16).digest()
    return ("change", txn["id"], txn["total_order"], topic, value["op"], digest)


def _check_source_transactions(
    committed: list[Event], report: AuditReport, *, begin_records: bool = True
) -> None:
    ends: Counter[str] = Counter()
    begins: set[str] = set()
    expected: dict[str, int] = {}
    # Per source transaction, its events: ("change", total_order) or ("message", lsn). A
    # key-changing update is two records (delete, update) of one event.
    events: dict[str, set[tuple[str, int]]] = defaultdict(set)
    seen: Counter[tuple[Any, ...]] = Counter()
    for event in committed:
        kind = event[0]
        if kind == "end":
            ends[event[1]] += 1
            expected[event[1]] = event[2]
        elif kind == "begin":
            begins.add(event[1])
        elif kind == "message":
            events[event[1]].add(("message", event[2]))
        elif kind == "snapshot":
            report.snapshot_records += 1
        else:
            report.change_records += 1
            events[event[1]].add(("change", event[2]))
            seen[event[1:]] += 1
    report.source_transactions = len(ends)
    for txid, count in ends.items():
        if count > 1:
            report.problem("duplicated", f"source transaction {txid}: END committed {count} times")
        if begin_records and txid not in begins:
            report.problem("lost", f"source transaction {txid}: END without BEGIN")
        held = len(events.get(txid, ()))
        if held != expected[txid]:
            report.problem(
                "lost",
                f"source transaction {txid}: END counts "
                f"{expected[txid]} events, the log holds {held}",
            )
    if not begin_records:
        for txid in sorted(begins):
            report.problem("unexpected", f"source transaction {txid}: a BEGIN record")
    for txid in events.keys() - ends.keys():
        report.problem("lost", f"source transaction {txid}: changes committed without its END")
    _report_duplicated_changes(seen, report)


def _report_duplicated_changes(seen: Counter[tuple[Any, ...]], report: AuditReport) -> None:
    """Each change (source transaction, place in its total order, topic, op, row) found
    committed more than once."""
    for (txid, order, topic, op, _row), count in seen.items():
        if count > 1:
            report.problem(
                "duplicated",
                f"{topic}: change {order} ({op}) of source transaction "
                f"{txid} committed {count} times",
            )


def _check_without_transaction_records(committed: list[Event], report: AuditReport) -> None:
    """The source-transaction check of a bridge that writes no transaction topic (see the
    module's docstring)."""
    orders: dict[str, set[int]] = defaultdict(set)
    with_messages: set[str] = set()
    seen: Counter[tuple[Any, ...]] = Counter()
    for event in committed:
        kind = event[0]
        if kind in ("begin", "end"):
            record = "a BEGIN" if kind == "begin" else "an END"
            report.problem("unexpected", f"source transaction {event[1]}: {record} record")
        elif kind == "message":
            with_messages.add(event[1])
        elif kind == "snapshot":
            report.snapshot_records += 1
        else:
            report.change_records += 1
            orders[event[1]].add(event[2])
            seen[event[1:]] += 1
    report.source_transactions = len(orders.keys() | with_messages)
    for txid, held in orders.items():
        if txid not in with_messages and sorted(held) != list(range(1, len(held) + 1)):
            report.problem(
                "lost",
                f"source transaction {txid}: changes {sorted(held)[:10]} are not its total "
                "order's 1..n",
            )
    _report_duplicated_changes(seen, report)
