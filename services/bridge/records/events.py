"""Builds the Kafka records of a sealed transaction: schema, BEGIN (optional), changes, END.

This module decides which records a transaction makes and numbers them; each record format
writes them its own way (``default.py``, ``debezium.py``). This is the hot path with the
decoder: one call per row change, or one compiled call per run of row changes to a table.
It avoids pydantic and builds values as dicts serialised once.

Pure: the relation catalogue gets catalogue facts (nullability, type names, primary key)
through a callback the daemon supplies, so this module never opens a connection.
"""

from __future__ import annotations

import abc
import base64
import functools
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from services.bridge.decode import messages as m
from services.bridge.decode.decoder import change_relid_at, in_place_change_relation
from services.bridge.records.catalog import COMPILED, RelationCatalog, RelationInfo, RowPlan, runs
from services.bridge.records.masking import (
    drop_column,
)
from services.bridge.records.values import (
    JsonValue,
)
from services.common.errors import SlotbridgeError
from services.common.lsn import PG_EPOCH_UNIX_MS, format_lsn
from services.contract.topics import message_topic, schema_topic, transaction_topic

# orjson: several times faster than the standard library's C encoder on row-sized dicts,
# and its Fragment embeds json/jsonb text as is (see values.py).
_dumps = orjson.dumps


class RowTooLarge(SlotbridgeError):
    """A single change record exceeds the configured limit; publishing it would fail."""

    retryable = False  # the same row comes again: max_row_bytes must change


def max_change_bytes(max_row_bytes: int) -> int:
    """The largest pgoutput row change whose record may fit in ``max_row_bytes``.

    A change record is never smaller than a third of its message: the text that shrinks
    most is bytea printed with bytea_output=escape (up to four characters a byte), which
    becomes base64; every other value's text stays as long or grows in JSON.
    """
    return 3 * max_row_bytes


# The bridge aligns the topics' max.message.bytes and its producer with max_row_bytes
# itself; the brokers' socket.request.max.bytes bounds it (checked at start).
_TOO_LARGE_REMEDY = (
    "raise max_row_bytes (below the brokers' socket.request.max.bytes) or "
    "stop publishing that column"
)

# Kafka record headers, as confluent-kafka takes them.
Headers = list[tuple[str, str | bytes | None]]
# One output record: topic, key bytes (or None), value bytes (or None for a tombstone),
# headers (None: none, the default format's case).
Record = tuple[str, bytes | None, bytes | None, Headers | None]


@dataclass(slots=True)
class Txn:
    """What every change record of one transaction shares, the pieces of its values
    serialised once per relation (``templates``: relation oid -> builder's pieces), and
    the numbering of its records so far."""

    xid: int
    commit_lsn: int
    commit_ts: int  # PostgreSQL's microseconds since 2000-01-01
    ts_ms: int
    now_ms: int
    txid: bytes  # "xid:commit_lsn", encoded once for all its records
    templates: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    # Its xid, commit LSN and commit time as text, for the source blocks.
    source_numbers: tuple[bytes, bytes, bytes] | None = None
    # Change records so far: in all (total_order), and per topic (data_collection_order).
    total: int = 0
    per_table: dict[str, int] = field(default_factory=dict)

    def number(self, topic: str) -> tuple[int, int]:
        """The total and per-topic order of the next change record to ``topic``."""
        self.total += 1
        order = self.per_table[topic] = self.per_table.get(topic, 0) + 1
        return self.total, order


# What the compiled runs put around the row and the numbers (``EventBuilder._run_numbers``) of
# an insert's, an update's and a delete's record, and around the rows and the numbers of an
# update's with its old row (REPLICA IDENTITY FULL): a piece more.
RowPieces = tuple[tuple[bytes, ...], tuple[bytes, ...], tuple[bytes, ...], tuple[bytes, ...]]
# A relation version the compiled runs build the records of: itself (the runs check that it
# is still the catalogue's), its plan, its records' pieces and their topic.
CompiledRelation = tuple[RelationInfo, RowPlan, RowPieces, str]


@dataclass(frozen=True, slots=True)
class Undecoded:
    """How ``EventBuilder.transaction`` reads the messages it is given undecoded: whether
    they come from a streamed transaction (where their relation oid is), and how to decode
    what the compiled plan does not read."""

    streamed: bool
    decode: Callable[[bytes], m.Message]


@dataclass(frozen=True, slots=True)
class RecordChoices:
    """Which records a transaction makes besides its change records, as the settings
    choose (``transaction_metadata``, ``transaction_begin_records``,
    ``tombstones_on_delete``): the same for either record format."""

    # A BEGIN record on the transaction topic before the transaction's records.
    begin_records: bool = True
    # An END record on the transaction topic after them, counting them.
    end_records: bool = True
    # A tombstone (the key, a null value) after each delete's record.
    tombstones: bool = True


# The settings' defaults: BEGIN and END records and tombstones, as Debezium writes them
# with provide.transaction.metadata on.
DEFAULT_CHOICES = RecordChoices()

# Most records one compiled ``runs`` call builds: a run of inserts waits in memory as records
# until the sink takes them, so this bounds that memory (about 0.5 MB of 500-byte values).
_RUN = 1024


class EventBuilder(abc.ABC):
    """Turns decoded messages of one sealed transaction into Kafka records: which records a
    transaction makes, in which order and with which numbers. How a record is written is
    its record format's, one subclass each (``default.DefaultEventBuilder``,
    ``debezium.DebeziumEventBuilder``)."""

    def __init__(
        self,
        catalog: RelationCatalog,
        topic_prefix: str,
        db: str,
        max_record_bytes: int,
        *,
        choices: RecordChoices = DEFAULT_CHOICES,
        last_end_lsn: int | None = None,
    ) -> None:
        """``choices``: whether a transaction's records start with a BEGIN record on the
        transaction topic and end with an END record there (which carries what a consumer
        of that topic needs), and whether a delete's record is followed by a tombstone of
        its key.
        ``last_end_lsn``: where the last transaction published before this builder's first
        ended (None: none was)."""
        self.catalog = catalog
        # The end of the last transaction built (see ``transaction``), or ``last_end_lsn``.
        self.last_end_lsn = last_end_lsn
        self.begin_records = choices.begin_records
        self.end_records = choices.end_records
        self.tombstones = choices.tombstones
        self.topic_prefix = topic_prefix
        self.db = db
        self.max_record_bytes = max_record_bytes
        self.schema_topic = schema_topic(topic_prefix)
        self.transaction_topic = transaction_topic(topic_prefix)
        self.message_topic = message_topic(topic_prefix)
        # Relation oid -> what the compiled runs build its records with (``_compiled``).
        self._compiled_relations: dict[int, CompiledRelation] = {}
        # One handler per message class: a dict lookup rather than an isinstance chain,
        # which every row change would walk.
        self._handlers: dict[type, Callable[[Txn, int, Any], Sequence[Record]]] = {
            m.Insert: self._insert,
            m.Update: self._update,
            m.Delete: self._delete,
            m.Relation: self._relation,
            m.TypeMsg: lambda txn, lsn, msg: (),
            m.Truncate: self._truncate,
            m.LogicalMessage: self._logical_message,
            m.OversizedChange: self._oversized,
        }

    # The record headers of change records and tombstones: none in the default format.
    headers: Headers | None = None
    # Whether the publisher may hand ``transaction`` its messages undecoded (see
    # ``Undecoded``): worth it only where the compiled row builder reads the row changes.
    reads_undecoded = COMPILED

    def transaction(
        self,
        xid: int,
        commit_lsn: int,
        commit_ts: int,
        changes: Iterator[tuple[int, m.Message | bytes]],
        end_lsn: int | None = None,
        undecoded: Undecoded | None = None,
    ) -> Iterator[Record]:
        """Records for one transaction: BEGIN (unless ``begin_records`` is off), schema
        versions as needed, changes, END (unless ``end_records`` is off).

        ``end_lsn`` (the end of its commit record) is what the Debezium format's next
        transaction names as the previous commit in ``source.sequence``. ``changes`` may
        hold messages as their raw payloads when ``undecoded`` says how to read them (see
        ``reads_undecoded``)."""
        txn = Txn(
            xid,
            commit_lsn,
            commit_ts,
            commit_ts // 1000 + PG_EPOCH_UNIX_MS,
            int(time.time() * 1000),
            f"{xid}:{commit_lsn}".encode(),
        )
        if self.begin_records:
            yield self._transaction_record("BEGIN", txn)
        handlers = self._handlers
        changes = iter(changes)  # a compiled run reads on from where this loop is
        for lsn, msg in changes:
            if msg.__class__ is bytes:
                assert undecoded is not None
                left = yield from self._compiled_runs(txn, changes, lsn, msg, undecoded)
                if left is None:
                    continue
                lsn, msg = left
            yield from handlers[msg.__class__](txn, lsn, msg)
        if self.end_records:
            yield self._transaction_record("END", txn)
        if (end_lsn is None) != (self.last_end_lsn is None):
            # A format's pieces may name the previous transaction (Debezium's sequence).
            self._compiled_relations.clear()
        self.last_end_lsn = end_lsn

    def _compiled_runs(
        self,
        txn: Txn,
        changes: Iterator[tuple[int, m.Message | bytes]],
        lsn: int,
        payload: bytes,
        undecoded: Undecoded,
    ) -> Generator[Record, None, tuple[int, m.Message] | None]:
        """Records of runs of row changes to tables the compiled plan covers, as many runs
        as follow each other in one call that reads their TupleData in place (``runs``).
        Returns the first message no run takes (another kind, a row the plan does not read,
        a record over the limit), decoded, with its LSN, to be handled as any decoded
        message; None when the runs ended with nothing left over (the caller's loop goes on
        with ``changes``)."""
        streamed = undecoded.streamed
        relid_at = change_relid_at(streamed)
        by_oid, compiled = self.catalog.by_oid, self._compiled_relations
        slots, trailing = self._run_numbers(txn)
        while True:
            built, txn.total, leftover = runs(
                changes,
                lsn,
                payload,
                relid_at,
                compiled,
                by_oid,
                txn.per_table,
                txn.total,
                self.headers,
                self.max_record_bytes,
                _RUN,
                trailing,
                slots,
                self.tombstones,
            )
            if not built:
                # A relation whose plan the runs do not know yet takes them on its first
                # change; anything else is the decoder's.
                oid = in_place_change_relation(payload, streamed)
                target = by_oid.get(oid) if oid is not None else None
                known = compiled.get(oid) if oid is not None else None
                if target is None or target.plan is None or (known and known[0] is target):
                    return lsn, undecoded.decode(payload)
                self._compiled(target)
                continue
            yield from built
            if leftover is None:
                return None
            lsn, payload = leftover

    def _compiled(self, info: RelationInfo) -> CompiledRelation:
        """What the compiled runs build ``info``'s records with, made once per relation
        version (and again after the first transaction: see ``transaction``)."""
        made = self._compiled_relations.get(info.oid)
        if made is None or made[0] is not info:
            assert info.plan is not None
            made = self._compiled_relations[info.oid] = (
                info,
                info.plan,
                self._row_pieces(info),
                info.topic,
            )
        return made

    # -- what a record format writes -----------------------------------------------------

    @abc.abstractmethod
    def _value(
        self,
        txn: Txn,
        info: RelationInfo,
        lsn: int,
        op: str,
        before: dict[str, JsonValue] | None,
        after: dict[str, JsonValue] | None,
        total: int,
        order: int,
    ) -> bytes:
        """A change record's value (``op`` c, u, d or t), at most ``max_record_bytes``."""

    @abc.abstractmethod
    def _row_pieces(self, info: RelationInfo) -> RowPieces:
        """What the compiled runs put around the rows and the numbers (``_run_numbers``)
        of an insert, of an update without an old tuple, of a delete and of an update with
        its old row; kept per relation version (``_compiled``)."""

    @abc.abstractmethod
    def _run_numbers(self, txn: Txn) -> tuple[bytes, tuple[int, ...]]:
        """Which number goes between each two pieces of a compiled record of ``txn`` (see
        ``_row_pieces``), as indexes into (lsn, total_order, data_collection_order, *the
        numbers its run's records share), and those numbers."""

    @abc.abstractmethod
    def _key_change(
        self,
        txn: Txn,
        lsn: int,
        info: RelationInfo,
        msg: m.Update,
        before: dict[str, JsonValue] | None,
        after: dict[str, JsonValue],
        old_key: bytes | None,
        key: bytes | None,
    ) -> Sequence[Record]:
        """An update that changed the row's key: consumers of a compacted topic must forget
        the old key, so a delete and a tombstone for it come first (as Debezium does; the
        tombstone only with ``tombstones``), then the row under the new key."""

    @abc.abstractmethod
    def snapshot_rows(
        self,
        info: RelationInfo,
        rows: Iterable[Sequence[str | None]],
        commit_lsn: int,
        commit_ts: int,
        lsn: int,
    ) -> Iterator[Record]:
        """Records (op ``r``) of the rows one snapshot chunk read, in their text form.

        They sit at the chunk's watermark: ``lsn`` is its message, ``commit_lsn`` its
        transaction's commit. A chunk is no source transaction, so it has no BEGIN/END;
        ``total_order`` still numbers its rows, so each has a position of its own. Built
        apart from ``transaction`` because everything but the row is the same for the
        whole chunk.
        """

    # -- the walk --------------------------------------------------------------------------

    def _numbers(self, txn: Txn, lsn: int, total: int, order: int) -> tuple[int, ...]:
        """A compiled record's numbers (``_run_numbers``) when it is built alone."""
        slots, trailing = self._run_numbers(txn)
        numbers = (lsn, total, order, *trailing)
        return tuple(numbers[i] for i in slots)

    def _insert(self, txn: Txn, lsn: int, msg: m.Insert) -> Sequence[Record]:
        info = self.catalog.by_oid[msg.relation_oid]
        total, order = txn.number(info.topic)
        plan = info.plan
        if plan is not None:
            pieces = self._compiled(info)[2]
            numbers = self._numbers(txn, lsn, total, order)
            made = plan.record(msg.new, pieces[0], numbers)  # type: ignore[arg-type]
            if made is not None:
                out, key_json = made
                if len(out) > self.max_record_bytes:
                    raise self._too_large(info, lsn, len(out))
                return ((info.topic, key_json, out, self.headers),)
        # An insert has no unchanged-TOAST value: its key is already in the row,
        # converted once.
        row = whole_row(info, msg.new)  # type: ignore[arg-type]
        value = self._value(txn, info, lsn, "c", None, row, total, order)
        return ((info.topic, self._key_of(info, row), value, self.headers),)

    def _update(self, txn: Txn, lsn: int, msg: m.Update) -> Sequence[Record]:
        info = self.catalog.by_oid[msg.relation_oid]
        before = None
        if msg.old is not None:
            before = (
                key_row(info, msg.old)
                if msg.old_is_key_only
                else _row(info, msg.old, None, info.placeholders)
            )
        after = _row(info, msg.new, None if msg.old_is_key_only else msg.old, info.placeholders)
        key = self._key_of(info, key_row(info, msg.new))
        if msg.old is not None:
            # An old key is sent when the replica identity changed; the whole old row
            # (REPLICA IDENTITY FULL) with every update, the key changed or not.
            old_key = self._key_of(info, key_row(info, msg.old))
            if old_key != key:
                return self._key_change(txn, lsn, info, msg, before, after, old_key, key)
        total, order = txn.number(info.topic)
        value = self._value(txn, info, lsn, "u", before, after, total, order)
        return ((info.topic, key, value, self.headers),)

    def _delete(self, txn: Txn, lsn: int, msg: m.Delete) -> Sequence[Record]:
        info = self.catalog.by_oid[msg.relation_oid]
        total, order = txn.number(info.topic)
        before = (
            key_row(info, msg.old)
            if msg.old_is_key_only
            else _row(info, msg.old, None, info.placeholders)
        )
        key = self._key_of(info, key_row(info, msg.old))
        value = self._value(txn, info, lsn, "d", before, None, total, order)
        return ((info.topic, key, value, self.headers), *self._tombstone(info, key, self.headers))

    def _relation(self, txn: Txn, lsn: int, msg: m.Relation) -> Sequence[Record]:
        info = self.catalog.apply(msg)
        txn.templates.pop(info.oid, None)
        return () if info.published else (self._schema_record(info),)

    def _truncate(self, txn: Txn, lsn: int, msg: m.Truncate) -> Sequence[Record]:
        records = []
        for oid in msg.relation_oids:
            info = self.catalog.by_oid[oid]
            total, order = txn.number(info.topic)
            value = self._value(txn, info, lsn, "t", None, None, total, order)
            records.append((info.topic, None, value, self.headers))
        return records

    def _logical_message(self, txn: Txn, lsn: int, msg: m.LogicalMessage) -> Sequence[Record]:
        # A message has a place in the transaction's total order but no table's.
        txn.total += 1
        value = {
            "prefix": msg.prefix,
            "content": base64.b64encode(msg.content).decode(),
            "transactional": msg.transactional,
            "lsn": lsn,
            "txId": txn.xid,
            "commit_lsn": txn.commit_lsn,
            "ts_ms": txn.ts_ms,
        }
        return ((self.message_topic, _dumps({"prefix": msg.prefix}), _dumps(value), None),)

    def _oversized(self, txn: Txn, lsn: int, msg: m.OversizedChange) -> Sequence[Record]:
        self.refuse_oversized(lsn, msg.relation_oid, msg.size)
        return ()

    def _transaction_record(self, status: str, txn: Txn) -> Record:
        """The transaction topic's BEGIN or END record (END counts the change records):
        the default format's, and the Debezium format's without Connect schemas."""
        return self.transaction_topic, b'{"id":"%b"}' % txn.txid, status_value(status, txn), None

    def _tombstone(
        self, info: RelationInfo, key: bytes | None, headers: Headers | None
    ) -> tuple[Record, ...]:
        """What follows the record of a delete of ``key``: its tombstone, which lets a
        compacted topic drop the key and tells a JDBC sink to delete the row, unless
        ``tombstones`` is off."""
        return ((info.topic, key, None, headers),) if self.tombstones else ()

    def _key_of(self, info: RelationInfo, row: dict[str, JsonValue]) -> bytes | None:
        """The record key of a row holding (at least) the key columns: the key columns'
        object (a format that frames it overrides this)."""
        return _dumps({n: row[n] for n in info.key_names}) if info.key_names else None

    def refuse_oversized(self, lsn: int, relation_oid: int, size: int) -> None:
        """A row change whose pgoutput message alone proves its record too large (see
        ``max_change_bytes``): refused without decoding or building anything of it."""
        info = self.catalog.by_oid.get(relation_oid)
        name = f"{info.schema}.{info.table}" if info is not None else f"relation {relation_oid}"
        raise RowTooLarge(
            f"a change of {name} at LSN {format_lsn(lsn)} is {size} bytes in the replication "
            f"stream, so its record is over the limit of {self.max_record_bytes} "
            f"(max_row_bytes); refused before building it; {_TOO_LARGE_REMEDY}"
        )

    def _schema_record(self, info: RelationInfo) -> Record:
        info.published = True
        key = _dumps({"schema": info.schema, "table": info.table, "version": info.version})
        return self.schema_topic, key, _dumps(info.schema_record), None

    def _too_large(self, info: RelationInfo, lsn: int, size: int) -> RowTooLarge:
        return RowTooLarge(
            f"a change of {info.schema}.{info.table} at LSN {format_lsn(lsn)} is "
            f"{size} bytes, over the limit of {self.max_record_bytes} (max_row_bytes); "
            f"{_TOO_LARGE_REMEDY}"
        )


def status_value(status: str, txn: Txn) -> bytes:
    """The transaction topic's value of ``txn``'s BEGIN or END record."""
    if status == "BEGIN":
        return begin_value(txn.txid, txn.ts_ms)
    return end_value(txn.txid, txn.ts_ms, txn.total, txn.per_table)


def begin_value(txid: bytes, ts_ms: int) -> bytes:
    """A BEGIN record of the transaction topic: ``TransactionRecord`` as JSON, written from
    a template (two of them per source transaction: a dict through the encoder was a tenth
    of a small transaction's cost). ``txid`` is "xid:commit_lsn", which needs no escaping."""
    return _BEGIN_VALUE % (txid, ts_ms)


def end_value(txid: bytes, ts_ms: int, total: int, per_table: dict[str, int]) -> bytes:
    """An END record of the transaction topic: its change records, in all and per table.
    Written from a template per sequence of tables: an OLTP stream's transactions name the
    same few (0.71 against 1.07 us for four tables with a template per table)."""
    return _end_template(tuple(per_table)) % (txid, total, *per_table.values(), ts_ms)


@functools.lru_cache(maxsize=4096)
def _end_template(topics: tuple[str, ...]) -> bytes:
    """The template of an END naming ``topics``, in that order: its id, total, each
    table's count and time to fill in."""
    collections = b",".join([_collection(t) for t in topics])
    return _END_VALUE.replace(b"[%b]", b"[" + collections + b"]")


def _collection(topic: str) -> bytes:
    """The template of ``topic``'s entry of an END's data_collections, but for the count:
    its ``data_collection`` is the topic's name less the topic prefix (less its first part:
    a route may name a topic of one part, or under another prefix), as JSON."""
    name = _dumps(topic.split(".", 1)[-1]).replace(b"%", b"%%")
    return b'{"data_collection":%b,"event_count":%%d}' % name


_BEGIN_VALUE = b'{"status":"BEGIN","id":"%b","event_count":null,"data_collections":null,"ts_ms":%d}'
_END_VALUE = b'{"status":"END","id":"%b","event_count":%d,"data_collections":[%b],"ts_ms":%d}'


def whole_row(info: RelationInfo, values: Sequence[str | None]) -> dict[str, JsonValue]:
    """A row with every value sent (no unchanged TOAST): an insert's, a snapshot's."""
    return {
        name: None if v is None else conv(v)
        for name, conv, v in zip(info.names, info.converters, values, strict=False)
        if conv is not drop_column
    }


def _row(
    info: RelationInfo,
    tup: m.TupleData,
    old: m.TupleData | None,
    placeholders: tuple[JsonValue, ...],
) -> dict[str, JsonValue]:
    row: dict[str, JsonValue] = {}
    for i, (name, conv, value) in enumerate(zip(info.names, info.converters, tup, strict=False)):
        if conv is drop_column:
            continue
        if value is None:
            row[name] = None
        elif value.__class__ is str:
            row[name] = conv(value)
        else:
            # Unchanged TOAST: the old full tuple (REPLICA IDENTITY FULL) has the value.
            prior = old[i] if old is not None else None
            row[name] = conv(prior) if prior.__class__ is str else placeholders[i]
    return row


def key_row(info: RelationInfo, tup: m.TupleData) -> dict[str, JsonValue]:
    return {info.names[i]: _typed(info, i, tup[i]) for i in info.key_idx}


def _typed(info: RelationInfo, i: int, value: m.TupleValue) -> JsonValue:
    return info.converters[i](value) if isinstance(value, str) else None
