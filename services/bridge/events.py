"""Builds the Kafka records of a sealed transaction: schema, BEGIN, changes, END.

This is the hot path with the decoder: one call per row change. It avoids pydantic and
builds values as dicts serialised once; what is constant for a whole transaction (the
``source`` block but for ``lsn``) is computed once per relation per transaction.

Pure: the relation catalogue gets catalogue facts (nullability, type names, primary key)
through a callback the daemon supplies, so this module never opens a connection.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from services.bridge import messages as m
from services.bridge.values import (
    JSON_NULL,
    TYPE_NAMES,
    JsonValue,
    bool_from_text,
    converter_for,
    timestamp_iso,
    timestamptz_iso,
)
from services.common.errors import SlotbridgeError
from services.common.lsn import format_lsn
from services.contract.records import CONNECTOR, TOAST_PLACEHOLDER, VERSION
from services.contract.topics import message_topic, schema_topic, table_topic, transaction_topic

_PG_EPOCH_MS = m.PG_EPOCH_UNIX_US // 1000

# orjson: several times faster than the standard library's C encoder on row-sized dicts,
# and its Fragment embeds json/jsonb text as is (see values.py).
_dumps = orjson.dumps

try:
    from services.bridge._rowjson import RowPlan
except ImportError:  # installed where no C compiler was at hand: rows are built in Python
    RowPlan = None  # type: ignore[assignment,misc]
COMPILED = RowPlan is not None


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


@dataclass(frozen=True, slots=True)
class ColumnFacts:
    """What the catalogue knows of a column that a Relation message does not carry."""

    type_name: str
    nullable: bool
    # The labels of an enum type (of the element type for an array of enums), in order.
    enum_labels: tuple[str, ...] | None = None
    enum_array: bool = False
    # An array column's declared dimensions (``int[][]``: 2); PostgreSQL does not enforce
    # them, but consumers that store arrays typed (Spark) need a number of levels.
    dimensions: int = 0


@dataclass(frozen=True, slots=True)
class TableFacts:
    columns: dict[str, ColumnFacts]
    primary_key: tuple[str, ...]


CatalogLookup = Callable[[int], TableFacts | None]
# A record format other than the default sets a new relation version's converters,
# placeholders and ``encoded`` pieces.
RelationEncoder = Callable[["RelationInfo", m.Relation, TableFacts | None], None]


@dataclass(slots=True)
class RelationInfo:
    """One version of a table's shape, ready for building records fast."""

    oid: int
    schema: str
    table: str
    topic: str
    version: int
    names: tuple[str, ...]
    converters: tuple[Callable[[str], JsonValue], ...]
    key_idx: tuple[int, ...]
    key_names: tuple[str, ...]
    replica_identity: str
    schema_record: dict[str, Any]
    # What an unchanged TOAST value becomes, per column.
    placeholders: tuple[JsonValue, ...]
    # The json and jsonb columns: a JSON null in them is named in ``json_nulls``.
    json_names: tuple[str, ...] = ()
    published: bool = False
    # The record format's own per-version pieces (the Debezium format's Connect schemas).
    encoded: Any = None
    # The compiled row builder (see row_plan), when there is one for this version.
    plan: RowPlan | None = None


@dataclass(slots=True)
class KnownVersion:
    version: int
    fingerprint: tuple[Any, ...]


@dataclass
class RelationCatalog:
    """Relation messages in, versioned relation shapes out.

    A table's version goes up when its columns (names, types, key flags) or replica
    identity change. ``known`` is recovered from the schema topic at start, so a restart
    that sees the same shape again reuses the version instead of minting a new one.
    """

    topic_prefix: str
    lookup: CatalogLookup
    known: dict[tuple[str, str], KnownVersion] = field(default_factory=dict)
    by_oid: dict[int, RelationInfo] = field(default_factory=dict)
    encoder: RelationEncoder | None = None

    def apply(self, rel: m.Relation) -> RelationInfo:
        fingerprint = _fingerprint(
            rel.replica_identity,
            ((c.name, c.type_oid, c.type_modifier, c.is_key) for c in rel.columns),
        )
        name = (rel.namespace, rel.name)
        known = self.known.get(name)
        current = self.by_oid.get(rel.oid)
        if known is not None and known.fingerprint == fingerprint:
            if (
                current is not None
                and current.version == known.version
                and current.schema == rel.namespace
                and current.table == rel.name
            ):
                return current
            version, published = known.version, True
        else:
            version = known.version + 1 if known is not None else 1
            published = False
        info = self._build(rel, version)
        info.published = published
        self.known[name] = KnownVersion(version, fingerprint)
        self.by_oid[rel.oid] = info
        return info

    def _build(self, rel: m.Relation, version: int) -> RelationInfo:
        facts = self.lookup(rel.oid)
        names = tuple(c.name for c in rel.columns)
        flagged = tuple(i for i, c in enumerate(rel.columns) if c.is_key)
        key_idx = flagged
        if rel.replica_identity == "f" and facts is not None and facts.primary_key:
            # With REPLICA IDENTITY FULL every column is flagged; the primary key is the
            # key consumers expect (and the one Debezium uses).
            key_idx = tuple(i for i, n in enumerate(names) if n in facts.primary_key)
        columns = []
        for c in rel.columns:
            fact = facts.columns.get(c.name) if facts is not None else None
            column = {
                "name": c.name,
                "type": fact.type_name if fact else TYPE_NAMES.get(c.type_oid, "text"),
                "type_oid": c.type_oid,
                "type_modifier": c.type_modifier,
                "nullable": fact.nullable if fact else True,
                "key": c.is_key
                if rel.replica_identity != "f"
                else c.name in [names[i] for i in key_idx],
            }
            if fact is not None and fact.dimensions > 1:
                column["dimensions"] = fact.dimensions
            columns.append(column)
        record = {
            "schema": rel.namespace,
            "table": rel.name,
            "version": version,
            "relation_oid": rel.oid,
            "replica_identity": rel.replica_identity,
            "columns": columns,
            "key_columns": [names[i] for i in key_idx],
            "ts_ms": int(time.time() * 1000),
        }
        info = RelationInfo(
            oid=rel.oid,
            schema=rel.namespace,
            table=rel.name,
            topic=table_topic(self.topic_prefix, rel.namespace, rel.name),
            version=version,
            names=names,
            converters=tuple(converter_for(c.type_oid) for c in rel.columns),
            key_idx=key_idx,
            key_names=tuple(names[i] for i in key_idx),
            replica_identity=rel.replica_identity,
            schema_record=record,
            placeholders=(TOAST_PLACEHOLDER,) * len(names),
            json_names=tuple(
                n for n, c in zip(names, rel.columns, strict=True) if c.type_oid in _JSON_OIDS
            ),
        )
        if self.encoder is not None:
            self.encoder(info, rel, facts)
        else:
            info.plan = row_plan(info)
        return info


# How the compiled builder writes each converter's values; any other converter is called
# from it. Keyed by the converter itself, so the two cannot disagree on a type.
_KINDS: dict[Callable[[str], JsonValue], bytes] = {
    int: b"i",
    str: b"s",
    bool_from_text: b"b",
    timestamp_iso: b"t",
    timestamptz_iso: b"z",
}


def row_plan(info: RelationInfo) -> RowPlan | None:
    """The compiled builder of a relation version's row and key JSON: the same bytes as
    ``_dumps(whole_row(...))`` and ``_key_of``, several times faster. None without the
    extension, and for tables with json or jsonb columns (their JSON nulls are named in the
    record, which takes the rows as dicts)."""
    if RowPlan is None or info.json_names:
        return None
    return RowPlan(
        tuple(_dumps(name) + b":" for name in info.names),
        b"".join(_KINDS.get(conv, b"p") for conv in info.converters),
        info.key_idx,
        info.converters,
        _dumps,
    )


def _fingerprint(identity: str, columns: Iterable[tuple[str, int, int, bool]]) -> tuple[Any, ...]:
    """What makes a table version: its replica identity and (name, type, typmod, key flag)
    per column, as a Relation message gives them."""
    return (identity, *columns)


def known_versions(schema_records: Iterable[dict[str, Any]]) -> dict[tuple[str, str], KnownVersion]:
    """The newest version per table among schema records (``RelationCatalog.known``)."""
    known: dict[tuple[str, str], KnownVersion] = {}
    for rec in schema_records:
        ident = rec["replica_identity"]
        # A Relation message flags every column as key under REPLICA IDENTITY FULL; the
        # record flags the primary key instead.
        fingerprint = _fingerprint(
            ident,
            (
                (c["name"], c["type_oid"], c["type_modifier"], ident == "f" or c["key"])
                for c in rec["columns"]
            ),
        )
        name = (rec["schema"], rec["table"])
        if name not in known or known[name].version < rec["version"]:
            known[name] = KnownVersion(rec["version"], fingerprint)
    return known


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
    """What every change record of one transaction shares, and the pieces of its values
    serialised once per relation (``templates``: relation oid -> builder's pieces)."""

    xid: int
    commit_lsn: int
    commit_ts: int  # PostgreSQL's microseconds since 2000-01-01
    ts_ms: int
    snapshot: str
    now_ms: int
    txid: bytes  # "xid:commit_lsn", encoded once for all its records
    templates: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    # Relation oid -> the pieces of its insert records for the compiled builder.
    insert_pieces: dict[int, tuple[bytes, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Undecoded:
    """How ``EventBuilder.transaction`` reads the messages it is given undecoded: where an
    Insert's relation oid starts (``decoder.insert_relid_at``; the 'N' marker and the
    TupleData follow it), and how to decode, at its LSN, what the compiled plan does not
    read."""

    relid_at: int
    decode: Callable[[int, bytes], m.Message]


# Most records one RowPlan.records call builds: a run of inserts waits in memory as records
# until the sink takes them, so this bounds that memory (about 0.5 MB of 500-byte values).
_RUN = 1024


class EventBuilder:
    """Turns decoded messages of one sealed transaction into Kafka records."""

    def __init__(
        self, catalog: RelationCatalog, topic_prefix: str, db: str, max_record_bytes: int
    ) -> None:
        self.catalog = catalog
        self.topic_prefix = topic_prefix
        self.db = db
        self.max_record_bytes = max_record_bytes
        self.schema_topic = schema_topic(topic_prefix)
        self.transaction_topic = transaction_topic(topic_prefix)
        self.message_topic = message_topic(topic_prefix)

    # The record headers of change records and tombstones: none in the default format.
    headers: Headers | None = None
    # The op of the new key's record after a key change: an update here, a create (with no
    # ``before``) in Debezium's records.
    key_change_op = "u"
    # Whether the publisher may hand ``transaction`` its messages undecoded (see
    # ``Undecoded``): worth it only where the compiled row builder reads the inserts.
    reads_undecoded = COMPILED

    def transaction(
        self,
        xid: int,
        commit_lsn: int,
        commit_ts: int,
        changes: Iterator[tuple[int, m.Message | bytes]],
        snapshot: str = "false",
        end_lsn: int | None = None,
        undecoded: Undecoded | None = None,
    ) -> Iterator[Record]:
        """Records for one transaction: BEGIN, schema versions as needed, changes, END.

        ``end_lsn`` (the end of its commit record) is what the Debezium format's next
        transaction names as the previous commit in ``source.sequence``. ``changes`` may
        hold messages as their raw payloads when ``undecoded`` says how to read them (see
        ``reads_undecoded``)."""
        ts_ms = commit_ts // 1000 + _PG_EPOCH_MS
        txid = f"{xid}:{commit_lsn}"
        now_ms = int(time.time() * 1000)
        txn = Txn(xid, commit_lsn, commit_ts, ts_ms, snapshot, now_ms, txid.encode())
        value = self._value
        insert_op = "r" if snapshot != "false" else "c"
        yield self._transaction_record("BEGIN", txid, ts_ms, None, None)
        total = 0
        per_table: dict[str, int] = {}
        catalog = self.catalog
        insert = m.Insert
        key_of = self._key_of
        headers = self.headers
        changes = iter(changes)  # records() reads on from where this loop is
        for lsn, msg in changes:
            if isinstance(msg, bytes):
                # Undecoded: a run of inserts into a table the compiled plan covers becomes
                # records in one call, which reads their TupleData in place. What a run
                # stops at (another message, a row the plan does not read, a record over the
                # limit, an insert into another table) is decoded and built below.
                assert undecoded is not None
                at = undecoded.relid_at
                target = (
                    catalog.by_oid.get(int.from_bytes(msg[at : at + 4], "big"))
                    if msg[0] == 0x49  # 'I'
                    else None
                )
                if target is not None and target.plan is not None and msg[at + 4 : at + 5] == b"N":
                    topic = target.topic
                    built, total, order, leftover = target.plan.records(
                        changes,
                        lsn,
                        msg,
                        at,
                        txn.insert_pieces.get(target.oid)
                        or self._insert_pieces(txn, target, insert_op),
                        total,
                        per_table.get(topic, 0),
                        topic,
                        headers,
                        self.max_record_bytes,
                        _RUN,
                    )
                    if built:
                        per_table[topic] = order
                        yield from built
                        if leftover is None:
                            continue
                        lsn, msg = leftover
                if isinstance(msg, bytes):
                    msg = undecoded.decode(lsn, msg)
            if msg.__class__ is insert:  # the common case first, ahead of the isinstance chain
                info = catalog.by_oid[msg.relation_oid]
                total += 1
                order = per_table[info.topic] = per_table.get(info.topic, 0) + 1
                plan = info.plan
                if plan is not None:
                    pieces = txn.insert_pieces.get(info.oid) or self._insert_pieces(
                        txn, info, insert_op
                    )
                    out, key_json = plan.record(
                        msg.new,  # type: ignore[arg-type]
                        pieces,
                        (lsn, lsn, total, order),
                    )
                    if len(out) > self.max_record_bytes:
                        raise self._too_large(info, lsn, len(out))
                    yield info.topic, key_json, out, headers
                    continue
                # An insert has no unchanged-TOAST value: its key is already in the row,
                # converted once.
                row = whole_row(info, msg.new)  # type: ignore[arg-type]
                yield (
                    info.topic,
                    key_of(info, row),
                    value(txn, info, lsn, insert_op, None, row, total, order),
                    headers,
                )
                continue
            if isinstance(msg, m.Relation):
                info = catalog.apply(msg)
                txn.templates.pop(info.oid, None)
                txn.insert_pieces.pop(info.oid, None)
                if not info.published:
                    yield self._schema_record(info)
                continue
            if isinstance(msg, m.TypeMsg):
                continue
            if isinstance(msg, m.Truncate):
                for oid in msg.relation_oids:
                    info = catalog.by_oid[oid]
                    total += 1
                    order = per_table[info.topic] = per_table.get(info.topic, 0) + 1
                    truncate = value(txn, info, lsn, "t", None, None, total, order)
                    yield info.topic, None, truncate, headers
                continue
            if isinstance(msg, m.LogicalMessage):
                total += 1
                yield (
                    self.message_topic,
                    _dumps({"prefix": msg.prefix}),
                    _dumps(
                        {
                            "prefix": msg.prefix,
                            "content": base64.b64encode(msg.content).decode(),
                            "transactional": msg.transactional,
                            "lsn": lsn,
                            "txId": xid,
                            "commit_lsn": commit_lsn,
                            "ts_ms": ts_ms,
                        }
                    ),
                    None,
                )
                continue
            info = catalog.by_oid[msg.relation_oid]  # type: ignore[union-attr]
            total += 1
            order = per_table[info.topic] = per_table.get(info.topic, 0) + 1
            if isinstance(msg, m.Update):
                before = None
                if msg.old is not None:
                    before = (
                        key_row(info, msg.old)
                        if msg.old_is_key_only
                        else _row(info, msg.old, None, info.placeholders)
                    )
                after = _row(
                    info, msg.new, msg.old if not msg.old_is_key_only else None, info.placeholders
                )
                key = key_of(info, key_row(info, msg.new))
                if msg.old is not None and msg.old_is_key_only:
                    old_key = key_of(info, key_row(info, msg.old))
                    if old_key != key:
                        # The key changed: consumers of a compacted topic must forget the
                        # old key, so publish a delete + tombstone for it first (Debezium
                        # does the same).
                        old_headers, new_headers = self._key_change_headers(info, msg.old, msg.new)
                        yield (
                            info.topic,
                            old_key,
                            value(txn, info, lsn, "d", before, None, total, order),
                            old_headers,
                        )
                        yield info.topic, old_key, None, old_headers
                        op = self.key_change_op
                        if op == "c":  # Debezium counts the delete and the create apart
                            total += 1
                            order = per_table[info.topic] = order + 1
                        yield (
                            info.topic,
                            key,
                            value(
                                txn,
                                info,
                                lsn,
                                op,
                                before if op == "u" else None,
                                after,
                                total,
                                order,
                            ),
                            new_headers,
                        )
                        continue
                yield (
                    info.topic,
                    key,
                    value(txn, info, lsn, "u", before, after, total, order),
                    headers,
                )
            elif isinstance(msg, m.Delete):
                before = (
                    key_row(info, msg.old)
                    if msg.old_is_key_only
                    else _row(info, msg.old, None, info.placeholders)
                )
                key = key_of(info, key_row(info, msg.old))
                yield (
                    info.topic,
                    key,
                    value(txn, info, lsn, "d", before, None, total, order),
                    headers,
                )
                yield info.topic, key, None, headers
        yield self._transaction_record("END", txid, ts_ms, total, per_table)

    def _transaction_record(
        self,
        status: str,
        txid: str,
        ts_ms: int,
        total: int | None,
        per_table: dict[str, int] | None,
    ) -> Record:
        """A BEGIN (``total`` None) or END record of the transaction topic."""
        return (
            self.transaction_topic,
            _dumps({"id": txid}),
            transaction_value(status, txid, ts_ms, total, per_table),
            None,
        )

    def _key_of(self, info: RelationInfo, row: dict[str, JsonValue]) -> bytes | None:
        """The record key of a row holding (at least) the key columns."""
        return _dumps({n: row[n] for n in info.key_names}) if info.key_names else None

    def _key_change_headers(
        self,
        info: RelationInfo,
        old: m.TupleData,
        new: m.TupleData,
    ) -> tuple[Headers | None, Headers | None]:
        """Headers of the delete + tombstone of the old key, and of the new key's record."""
        return self.headers, self.headers

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
        here rather than through ``transaction`` because everything but the row is the
        same for the whole chunk.
        """
        if not info.published:
            yield self._schema_record(info)
        ts_ms = commit_ts // 1000 + _PG_EPOCH_MS
        head, tail = self._source(info, None, commit_lsn, ts_ms, b"true")
        rest = _VALUE_REST % (
            head,
            lsn,
            tail,
            commit_lsn,
            lsn,
            b"r",
            int(time.time() * 1000),
            f"0:{commit_lsn}".encode(),
        )
        topic, key_names, limit, plan = info.topic, info.key_names, self.max_record_bytes, info.plan
        pieces = (_SNAPSHOT_BEFORE, rest, _ORDER, _END)
        for n, values in enumerate(rows, 1):
            key: bytes | None
            if plan is not None:
                value, key = plan.record(values, pieces, (n, n))
            else:
                row = whole_row(info, values)
                value = _SNAPSHOT_VALUE % (_dumps(row), rest, n, n)
                if info.json_names:
                    value = _with_json_nulls(value, info, None, row)
                key = _dumps({k: row[k] for k in key_names}) if key_names else None
            if len(value) > limit:
                raise self._too_large(info, lsn, len(value))
            yield topic, key, value, None

    def _source(
        self, info: RelationInfo, xid: int | None, commit_lsn: int, ts_ms: int, snapshot: bytes
    ) -> tuple[bytes, bytes]:
        """The ``source`` block before and after its ``lsn``: the same for every change of
        a relation in one transaction."""
        head = _dumps(
            {
                "connector": CONNECTOR,
                "version": VERSION,
                "name": self.topic_prefix,
                "db": self.db,
                "schema": info.schema,
                "table": info.table,
                "txId": xid,
            }
        )[:-1]
        tail = b',"commit_lsn":%d,"ts_ms":%d,"snapshot":"%b","schema_version":%d' % (
            commit_lsn,
            ts_ms,
            snapshot,
            info.version,
        )
        return head, tail

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
        """A change record's value: its rows and the transaction's shared pieces."""
        out = self._join(
            txn,
            info,
            lsn,
            op,
            _dumps(before) if before is not None else b"null",
            _dumps(after) if after is not None else b"null",
            total,
            order,
        )
        if info.json_names:
            out = _with_json_nulls(out, info, before, after)
        if len(out) > self.max_record_bytes:
            raise self._too_large(info, lsn, len(out))
        return out

    def _insert_pieces(self, txn: Txn, info: RelationInfo, op: str) -> tuple[bytes, ...]:
        """What ``RowPlan.record`` puts around an insert's row, lsn and orders (``_VALUE``
        cut at them), made once per relation per transaction."""
        head, tail = self._pieces(txn, info)
        pieces = txn.insert_pieces[info.oid] = (
            _BEFORE % b"null",
            _SOURCE % head,
            _SEQUENCE % (tail, txn.commit_lsn),
            _TRANSACTION % (op.encode(), txn.now_ms, txn.txid),
            _ORDER,
            _END,
        )
        return pieces

    def _pieces(self, txn: Txn, info: RelationInfo) -> tuple[bytes, bytes]:
        """The ``source`` block of a relation's records in ``txn``, before and after lsn."""
        pieces = txn.templates.get(info.oid)
        if pieces is None:
            xid = txn.xid if txn.snapshot == "false" else None
            pieces = txn.templates[info.oid] = self._source(
                info, xid, txn.commit_lsn, txn.ts_ms, txn.snapshot.encode()
            )
        return pieces

    def _join(
        self,
        txn: Txn,
        info: RelationInfo,
        lsn: int,
        op: str,
        before: bytes,
        after: bytes,
        total: int,
        order: int,
    ) -> bytes:
        """A change record's value around its serialised rows."""
        head, tail = self._pieces(txn, info)
        return _VALUE % (
            before,
            after,
            head,
            lsn,
            tail,
            txn.commit_lsn,
            lsn,
            op.encode(),
            txn.now_ms,
            txn.txid,
            total,
            order,
        )

    def _too_large(self, info: RelationInfo, lsn: int, size: int) -> RowTooLarge:
        return RowTooLarge(
            f"a change of {info.schema}.{info.table} at LSN {format_lsn(lsn)} is "
            f"{size} bytes, over the limit of {self.max_record_bytes} (max_row_bytes); "
            f"{_TOO_LARGE_REMEDY}"
        )


# A change record's value is these pieces around, in turn, its after row, its lsn (twice),
# total_order and data_collection_order; the pieces' own fields are the transaction's.
_BEFORE = b'{"before":%b,"after":'  # the before row
_SOURCE = b',"source":%b,"lsn":'  # the source block up to its lsn
_SEQUENCE = b'%b,"sequence":"[\\"%d\\",\\"'  # the rest of source, the commit LSN
_TRANSACTION = b'\\"]"},"op":"%b","ts_ms":%d,"transaction":{"id":"%b","total_order":'
_ORDER = b',"data_collection_order":'
_END = b"}}"
_VALUE = _BEFORE + b"%b" + _SOURCE + b"%d" + _SEQUENCE + b"%d" + _TRANSACTION
_VALUE += b"%d" + _ORDER + b"%d" + _END
# Where a snapshot chunk's records differ from one another: the row and the orders.
_VALUE_REST = _SOURCE + b"%d" + _SEQUENCE + b"%d" + _TRANSACTION
_SNAPSHOT_BEFORE = _BEFORE % b"null"
_SNAPSHOT_VALUE = _SNAPSHOT_BEFORE + b"%b%b%d" + _ORDER + b"%d" + _END


_JSON_OIDS = frozenset((114, 3802))


def _with_json_nulls(
    value: bytes,
    info: RelationInfo,
    before: dict[str, JsonValue] | None,
    after: dict[str, JsonValue] | None,
) -> bytes:
    """``value`` with ``"json_nulls": {"before": [...], "after": [...]}`` naming the json
    and jsonb columns whose value is JSON ``null`` (embedded, it reads like SQL NULL);
    ``value`` unchanged when there is none, the usual case."""
    nulls: dict[str, list[str]] = {}
    for image, row in (("before", before), ("after", after)):
        if row is not None:
            names = [n for n in info.json_names if row.get(n) is JSON_NULL]
            if names:
                nulls[image] = names
    if not nulls:
        return value
    return value[:-1] + b',"json_nulls":' + _dumps(nulls) + b"}"


def transaction_value(
    status: str, txid: str, ts_ms: int, total: int | None, per_table: dict[str, int] | None
) -> bytes:
    collections = (
        None
        if per_table is None
        else [
            {"data_collection": topic.split(".", 1)[1], "event_count": n}
            for topic, n in per_table.items()
        ]
    )
    return _dumps(
        {
            "status": status,
            "id": txid,
            "event_count": total,
            "data_collections": collections,
            "ts_ms": ts_ms,
        }
    )


def whole_row(info: RelationInfo, values: Sequence[str | None]) -> dict[str, JsonValue]:
    """A row with every value sent (no unchanged TOAST): an insert's, a snapshot's."""
    return {
        name: None if v is None else conv(v)
        for name, conv, v in zip(info.names, info.converters, values, strict=False)
    }


def _row(
    info: RelationInfo,
    tup: m.TupleData,
    old: m.TupleData | None,
    placeholders: tuple[JsonValue, ...],
) -> dict[str, JsonValue]:
    row: dict[str, JsonValue] = {}
    for i, (name, conv, value) in enumerate(zip(info.names, info.converters, tup, strict=False)):
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
