"""The Debezium record format (``value_format: debezium``): change records as Debezium's
PostgreSQL connector writes them with its defaults through Kafka Connect's JsonConverter.

Keys and values are ``{"schema": <Connect schema>, "payload": <value>}``, or with
``debezium_schemas: false`` the payload alone (JsonConverter's ``schemas.enable=false``,
which many Debezium users run with: the schema is most of a narrow table's record); every
change record and tombstone carries the ``__debezium.context.*`` headers (``extended.headers.
enabled`` defaults to true; ``debezium_context_headers: false`` leaves them out), a key
change's records ``__debezium.newkey``/``oldkey``. The column values come from
``connect_values.py``. Topics, keys' columns, transactions, the exactly-once machinery and
the schema topic are those of the default format; the transaction topic's records get
Debezium's Connect schemas too (with schemas on).

Where this deliberately differs from Debezium 3.7 with defaults (all seen on the real
connector, see ``tests/integration/test_debezium_format.py``):

- ``transaction`` is filled as with ``provide.transaction.metadata=true`` (the bridge always
  writes the transaction topic), and its ``id`` is ``<xid>:<commit LSN>`` for every record
  of a transaction (Debezium puts the current event's LSN there, so BEGIN, END and the
  events of one transaction carry different ids);
- truncates are published (``op: "t"``, as with ``skipped.operations=none``);
- types the connector leaves out are published as strings (see ``connect_values.py``), and
  a ``name`` column holds its text (the connector writes null);
- ``source.version`` is the bridge's version; ``xmin``, ``origin`` and ``origin_lsn`` are
  null (Debezium's defaults leave them null too, but for replicated origins);
- snapshot records (``op: "r"``) carry ``snapshot: "true"``, never ``first``/``last``: the
  chunked snapshot does not know which row is the last one.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import orjson

from services.bridge.decode import messages as m
from services.bridge.records.catalog import RelationCatalog, RelationInfo, TableFacts, row_plan
from services.bridge.records.connect_values import (
    COMPILED_KINDS,
    ColumnType,
    Schema,
    column_encoding,
    placeholder,
)
from services.bridge.records.events import (
    DEFAULT_CHOICES,
    EventBuilder,
    Headers,
    Record,
    RecordChoices,
    RowPieces,
    Txn,
    key_row,
    status_value,
    whole_row,
)
from services.bridge.records.masking import OUTPUT_TYPE_OID
from services.bridge.records.values import JsonValue
from services.common.lsn import PG_EPOCH_UNIX_US
from services.contract.records import VERSION

_dumps = orjson.dumps
CONNECTOR = "postgresql"

_SOURCE_SCHEMA: Schema = {
    "type": "struct",
    "fields": [
        {"type": "string", "optional": False, "field": "version"},
        {"type": "string", "optional": False, "field": "connector"},
        {"type": "string", "optional": False, "field": "name"},
        {"type": "int64", "optional": False, "field": "ts_ms"},
        {
            "type": "string",
            "optional": True,
            "name": "io.debezium.data.Enum",
            "version": 1,
            "parameters": {
                "allowed": "true,first,first_in_data_collection,"
                "last_in_data_collection,last,false,incremental"
            },
            "default": "false",
            "field": "snapshot",
        },
        {"type": "string", "optional": False, "field": "db"},
        {"type": "string", "optional": True, "field": "sequence"},
        {"type": "int64", "optional": True, "field": "ts_us"},
        {"type": "int64", "optional": True, "field": "ts_ns"},
        {"type": "string", "optional": False, "field": "schema"},
        {"type": "string", "optional": False, "field": "table"},
        {"type": "int64", "optional": True, "field": "txId"},
        {"type": "int64", "optional": True, "field": "lsn"},
        {"type": "int64", "optional": True, "field": "xmin"},
        {"type": "string", "optional": True, "field": "origin"},
        {"type": "int64", "optional": True, "field": "origin_lsn"},
    ],
    "optional": False,
    "name": "io.debezium.connector.postgresql.Source",
    "version": 1,
    "field": "source",
}
_TRANSACTION_SCHEMA: Schema = {
    "type": "struct",
    "fields": [
        {"type": "string", "optional": False, "field": "id"},
        {"type": "int64", "optional": False, "field": "total_order"},
        {"type": "int64", "optional": False, "field": "data_collection_order"},
    ],
    "optional": True,
    "name": "event.block",
    "version": 1,
    "field": "transaction",
}
_TXN_KEY_SCHEMA = _dumps(
    {
        "type": "struct",
        "fields": [{"type": "string", "optional": False, "field": "id"}],
        "optional": False,
        "name": "io.debezium.connector.common.TransactionMetadataKey",
        "version": 1,
    }
)
_TXN_VALUE_SCHEMA = _dumps(
    {
        "type": "struct",
        "fields": [
            {"type": "string", "optional": False, "field": "status"},
            {"type": "string", "optional": False, "field": "id"},
            {"type": "int64", "optional": True, "field": "event_count"},
            {
                "type": "array",
                "items": {
                    "type": "struct",
                    "fields": [
                        {"type": "string", "optional": False, "field": "data_collection"},
                        {"type": "int64", "optional": False, "field": "event_count"},
                    ],
                    "optional": True,
                    "name": "event.collection",
                    "version": 1,
                },
                "optional": True,
                "field": "data_collections",
            },
            {"type": "int64", "optional": False, "field": "ts_ms"},
        ],
        "optional": False,
        "name": "io.debezium.connector.common.TransactionMetadataValue",
        "version": 1,
    }
)


@dataclass(frozen=True, slots=True)
class ConnectShape:
    """How one relation version's keys and values start and end: with Connect schemas
    (``schemas.enable=true``) each is ``{"schema":<schema>,"payload":<payload>}``; without
    them (``schemas.enable=false``) the payload alone."""

    key_head: bytes  # b'{"schema":<key schema>,"payload":', or nothing
    value_head: bytes  # b'{"schema":<envelope schema>,"payload":{"before":', or b'{"before":'
    close: bytes  # what closes the schema/payload pair: b"}", or nothing

    @classmethod
    def of(
        cls, name: str, columns: Sequence[tuple[str, Schema, bool]], key: Sequence[str]
    ) -> ConnectShape:
        """With the Connect schemas of a table (see ``connect_schemas``)."""
        key_schema, envelope = connect_schemas(name, columns, key)
        return cls(
            b'{"schema":%b,"payload":' % _dumps(key_schema),
            b'{"schema":%b,"payload":{"before":' % _dumps(envelope),
            b"}",
        )


# Without schemas every relation version's keys and values are framed alike.
PAYLOAD_ONLY = ConnectShape(b"", b'{"before":', b"")


def connect_schemas(
    name: str, columns: Sequence[tuple[str, Schema, bool]], key: Sequence[str]
) -> tuple[Schema, Schema]:
    """The key schema and the envelope schema of a table, named after its topic ``name``;
    ``columns`` are (name, schema, nullable)."""
    fields = {n: {**schema, "optional": nullable, "field": n} for n, schema, nullable in columns}
    # Connect prints a field's keys in its own order: type, fields/items, optional, name...
    ordered = {n: _connect_order(f) for n, f in fields.items()}
    key_schema = {
        "type": "struct",
        "fields": [ordered[n] for n in key],
        "optional": False,
        "name": f"{name}.Key",
    }
    row = {
        "type": "struct",
        "fields": list(ordered.values()),
        "optional": True,
        "name": f"{name}.Value",
    }
    envelope = {
        "type": "struct",
        "fields": [
            {**row, "field": "before"},
            {**row, "field": "after"},
            _SOURCE_SCHEMA,
            _TRANSACTION_SCHEMA,
            {"type": "string", "optional": False, "field": "op"},
            {"type": "int64", "optional": True, "field": "ts_ms"},
            {"type": "int64", "optional": True, "field": "ts_us"},
            {"type": "int64", "optional": True, "field": "ts_ns"},
        ],
        "optional": False,
        "name": f"{name}.Envelope",
        "version": 2,
    }
    return key_schema, envelope


_ORDER = (
    "type",
    "fields",
    "items",
    "optional",
    "name",
    "version",
    "doc",
    "parameters",
    "default",
    "field",
)


def _connect_order(schema: Schema) -> Schema:
    return {k: schema[k] for k in _ORDER if k in schema}


def encode_relation(
    info: RelationInfo, rel: m.Relation, facts: TableFacts | None, *, schemas: bool = True
) -> None:
    """``RelationCatalog.encoder`` of this format: Connect converters, TOAST placeholders and
    (with ``schemas``) Connect schemas for a new relation version."""
    converters = []
    placeholders = []
    columns = []
    for c, mask in zip(rel.columns, info.masks, strict=True):
        fact = facts.columns.get(c.name) if facts is not None else None
        kind = ColumnType(
            c.type_oid,
            c.type_modifier,
            fact.enum_labels if fact is not None else None,
            fact.enum_array if fact is not None else False,
        )
        if mask is not None:
            # A transform's output is text, whatever the column's type.
            kind = ColumnType(OUTPUT_TYPE_OID, -1)
        schema, convert = column_encoding(kind)
        converters.append(convert if mask is None else mask.convert)
        placeholders.append(placeholder(kind))
        if mask is None or not mask.drops:
            nullable = fact.nullable if fact is not None else True
            columns.append((c.name, schema, nullable or (mask is not None and mask.nulls)))
    info.converters = tuple(converters)
    info.placeholders = tuple(placeholders)
    shape = info.encoded = (
        ConnectShape.of(info.topic, columns, info.key_names) if schemas else PAYLOAD_ONLY
    )
    # Connect writes a struct's every field: a delete's old key is a whole row of nulls but
    # for its key columns (which pgoutput sends as such).
    info.plan = row_plan(
        info, (shape.key_head, shape.close), whole_old_key=True, own_kinds=COMPILED_KINDS
    )


def run_id(now_ms: int, random: bytes) -> str:
    """A UUID version 7 (what the connector's runId header holds), from a time and 10
    random bytes."""
    value = (
        (now_ms << 80)
        | (0x7 << 76)
        | (int.from_bytes(random[:2], "big") & 0xFFF) << 64
        | 0b10 << 62
        | (int.from_bytes(random[2:10], "big") & ((1 << 62) - 1))
    )
    hexed = f"{value:032x}"
    return f"{hexed[:8]}-{hexed[8:12]}-{hexed[12:16]}-{hexed[16:20]}-{hexed[20:]}"


def context_headers_of(topic_prefix: str, run: str) -> Headers:
    """The ``__debezium.context.*`` headers of every change record (SimpleHeaderConverter:
    the strings' UTF-8 bytes)."""
    return [
        ("__debezium.context.connectorLogicalName", topic_prefix.encode()),
        ("__debezium.context.taskId", b"0"),
        ("__debezium.context.connectorName", CONNECTOR.encode()),
        ("__debezium.context.runId", run.encode()),
    ]


_TXN_KEY = b'{"schema":%b,"payload":{"id":"%%b"}}' % _TXN_KEY_SCHEMA
# The pieces of the compiled plan's records (see ``DebeziumEventBuilder._row_pieces``).
_AFTER = b',"after":'
_NULL_AFTER = _AFTER + b"null"
_COLLECTION_ORDER = b',"data_collection_order":'
# A compiled record's numbers, as indexes into (lsn, total_order, data_collection_order,
# *DebeziumEventBuilder._run_numbers): the source block's ts_ms, its sequence's previous
# commit and lsn, its ts_us, ts_ns, txId and lsn, the transaction id's xid and commit LSN,
# the orders, then the processing times; in the first transaction, the sequence has no
# previous commit.
_SLOTS = bytes((3, 4, 0, 5, 6, 7, 0, 7, 8, 1, 2, 9, 10, 11))
_FIRST_SLOTS = bytes((3, 0, 5, 6, 7, 0, 7, 8, 1, 2, 9, 10, 11))


@dataclass(frozen=True, slots=True)
class _RelationShape:
    """A relation version's pieces of its change records, the same in every transaction:
    the value's start (Connect schema) before the before row, with and without a null before
    row, the ``source`` block as two templates for the records built in Python, up to its
    sequence's first LSN (taking ts_ms, the snapshot flag and that LSN) and from its second
    LSN to its ``lsn`` (taking ts_us, ts_ns and txId), and the compiled plan's pieces."""

    info: RelationInfo
    framed: bytes
    created: bytes
    head: bytes
    middle: bytes
    # The compiled plan's pieces (``DebeziumEventBuilder._row_pieces``).
    compiled: RowPieces
    compiled_first: RowPieces

    @classmethod
    def of(cls, info: RelationInfo, topic_prefix: str, db: str) -> _RelationShape:
        value_head: bytes = info.encoded.value_head
        created = value_head + b'null,"after":'
        name, database = _dumps(topic_prefix), _dumps(db)
        relation = b',"schema":%b,"table":%b' % (_dumps(info.schema), _dumps(info.table))
        source = b',"source":{"version":"%b","connector":"%b","name":%b,"ts_ms":' % (
            VERSION.encode(),
            CONNECTOR.encode(),
            name,
        )

        end = b"}" + info.encoded.close

        def compiled(sequence: tuple[bytes, ...]) -> RowPieces:
            """The pieces with ``sequence``, those from the snapshot flag to the lsn of the
            sequence's second element."""

            def after(op: bytes) -> tuple[bytes, ...]:
                return (
                    source,
                    *sequence,
                    b'\\"]","ts_us":',
                    b',"ts_ns":',
                    relation + b',"txId":',
                    b',"lsn":',
                    b',"xmin":null,"origin":null,"origin_lsn":null},"transaction":{"id":"',
                    b":",
                    b'","total_order":',
                    _COLLECTION_ORDER,
                    # After the orders: the op, then between the processing times.
                    b'},"op":"%b","ts_ms":' % op,
                    b',"ts_us":',
                    b',"ts_ns":',
                    end,
                )

            deleted = after(b"d")
            return (
                (created, *after(b"c")),
                (created, *after(b"u")),
                (value_head, _NULL_AFTER + deleted[0], *deleted[1:]),
                # With its old row: the before row, then this piece, then the after row.
                (value_head, _AFTER, *after(b"u")),
            )

        flag = b',"snapshot":"false","db":%b,"sequence":"[' % database

        def named(value: bytes) -> bytes:
            # Names may hold a %: the templates' own are the only ones left.
            return value.replace(b"%", b"%%")

        return cls(
            info,
            value_head,
            created,
            source.replace(b"%", b"%%")
            + b'%d,"snapshot":"%b","db":'
            + named(database)
            + b',"sequence":"[%b,\\"',
            b'\\"]","ts_us":%d,"ts_ns":%d' + named(relation) + b',"txId":%b,"lsn":',
            compiled((flag + b'\\"', b'\\",\\"')),
            compiled((flag + b'null,\\"',)),
        )


class DebeziumEventBuilder(EventBuilder):
    """``EventBuilder`` writing Debezium's records; one per bridge run (the run id).

    ``schemas``: keys and values carry their Connect schemas, as JsonConverter writes them
    with ``schemas.enable=true`` (Debezium's default); without, the payloads alone
    (``schemas.enable=false``), a fifth of the bytes of a narrow table's record.
    ``context_headers``: the ``__debezium.context.*`` headers on every change record
    (``extended.headers.enabled``, Debezium's default); without, none but a key change's
    (the sink then sends the records in batches, which take no headers)."""

    def __init__(
        self,
        catalog: RelationCatalog,
        topic_prefix: str,
        db: str,
        max_record_bytes: int,
        last_end_lsn: int | None,
        *,
        choices: RecordChoices = DEFAULT_CHOICES,
        schemas: bool = True,
        context_headers: bool = True,
    ) -> None:
        catalog.encoder = functools.partial(encode_relation, schemas=schemas)
        super().__init__(
            catalog,
            topic_prefix,
            db,
            max_record_bytes,
            choices=choices,
            last_end_lsn=last_end_lsn,
        )
        self.schemas = schemas
        if context_headers:
            self.headers = context_headers_of(
                topic_prefix, run_id(int(time.time() * 1000), os.urandom(10))
            )
        # Relation oid -> its version's pieces (see ``_RelationShape``).
        self._shapes: dict[int, _RelationShape] = {}

    def _transaction_record(self, status: str, txn: Txn) -> Record:
        # Debezium writes no context headers on its transaction topic; without schemas its
        # records there are the default format's.
        if not self.schemas:
            return super()._transaction_record(status, txn)
        return (
            self.transaction_topic,
            _TXN_KEY % txn.txid,
            b'{"schema":%b,"payload":%b}' % (_TXN_VALUE_SCHEMA, status_value(status, txn)),
            None,
        )

    def _key_of(self, info: RelationInfo, row: dict[str, JsonValue]) -> bytes | None:
        if not info.key_names:
            return None
        shape: ConnectShape = info.encoded
        return shape.key_head + _dumps({n: row[n] for n in info.key_names}) + shape.close

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
        """Debezium's key change: the old key's delete and tombstone carry the new key in a
        header, then a create (no ``before``) of the new key carries the old one; the
        delete and the create are counted apart."""
        assert msg.old is not None  # a key change has the old key
        headers = self.headers or []
        # The other key's payload, as SimpleHeaderConverter prints a Struct.
        old_headers: Headers = [("__debezium.newkey", _dumps(key_row(info, msg.new))), *headers]
        new_headers: Headers = [("__debezium.oldkey", _dumps(key_row(info, msg.old))), *headers]
        total, order = txn.number(info.topic)
        deleted = self._value(txn, info, lsn, "d", before, None, total, order)
        total, order = txn.number(info.topic)
        created = self._value(txn, info, lsn, "c", None, after, total, order)
        return (
            (info.topic, old_key, deleted, old_headers),
            *self._tombstone(info, old_key, old_headers),
            (info.topic, key, created, new_headers),
        )

    def _source_pieces(
        self, info: RelationInfo, xid: int | None, commit_ts: int, snapshot: bytes
    ) -> tuple[bytes, bytes]:
        """The ``source`` block around its sequence's LSN and its ``lsn``, constant for a
        relation in one transaction: the relation version's templates (``_shape``) with the
        transaction's numbers."""
        us = commit_ts + PG_EPOCH_UNIX_US
        # The sequence's first element is the previous transaction's end: null before the
        # first one, as for a connector without an offset.
        prev = b"null" if self.last_end_lsn is None else b'\\"%d\\"' % self.last_end_lsn
        shape = self._shape(info)
        return (
            shape.head % (us // 1000, snapshot, prev),
            shape.middle % (us, us * 1000, b"null" if xid is None else b"%d" % xid),
        )

    def _shape(self, info: RelationInfo) -> _RelationShape:
        """What a relation version's change records share in every transaction, made once."""
        shape = self._shapes.get(info.oid)
        if shape is None or shape.info is not info:
            shape = self._shapes[info.oid] = _RelationShape.of(info, self.topic_prefix, self.db)
        return shape

    def _templates(self, txn: Txn, info: RelationInfo) -> tuple[bytes, bytes]:
        """The ``source`` pieces of a relation's records in ``txn`` (see ``_source_pieces``)."""
        return txn.templates.get(info.oid) or txn.templates.setdefault(
            info.oid, self._source_pieces(info, txn.xid, txn.commit_ts, b"false")
        )

    def _row_pieces(self, info: RelationInfo) -> RowPieces:
        """What the compiled plan puts around the rows and the numbers (``_run_numbers``)
        of an insert, of an update without an old tuple, of a delete and of an update with
        its old row: ``_envelope``'s bytes cut at them, the same for a relation version in
        every transaction but the first (whose sequence names no previous commit)."""
        shape = self._shape(info)
        return shape.compiled if self.last_end_lsn is not None else shape.compiled_first

    def _run_numbers(self, txn: Txn) -> tuple[bytes, tuple[int, ...]]:
        """The slots and numbers of ``_row_pieces``' records: the transaction's (its
        commit time in three units, the previous commit, xid, commit LSN) and the processing
        times."""
        us = txn.commit_ts + PG_EPOCH_UNIX_US
        trailing = (
            us // 1000,
            self.last_end_lsn or 0,
            us,
            us * 1000,
            txn.xid,
            txn.commit_lsn,
            *self._now(),
        )
        return (_SLOTS if self.last_end_lsn is not None else _FIRST_SLOTS), trailing

    @staticmethod
    def _now() -> tuple[int, int, int]:
        """The processing time a record carries (ts_ms, ts_us, ts_ns): read once for the
        records of consecutive compiled runs, as a record built alone reads it once."""
        now = time.time_ns()
        return now // 1_000_000, now // 1000, now

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
        head, middle = self._templates(txn, info)
        return self._envelope(
            info,
            head,
            middle,
            lsn,
            op,
            before,
            after,
            b'{"id":"%b","total_order":%d,"data_collection_order":%d}' % (txn.txid, total, order),
        )

    def _envelope(
        self,
        info: RelationInfo,
        head: bytes,
        middle: bytes,
        lsn: int,
        op: str,
        before: dict[str, JsonValue] | None,
        after: dict[str, JsonValue] | None,
        transaction: bytes,
    ) -> bytes:
        now_ms, now_us, now_ns = self._now()
        out = b"".join(
            (
                info.encoded.value_head,
                self._full(info, before),
                b',"after":',
                self._full(info, after),
                head,
                b"%d" % lsn,
                middle,
                b'%d,"xmin":null,"origin":null,"origin_lsn":null},"transaction":%b,"op":"%b",'
                b'"ts_ms":%d,"ts_us":%d,"ts_ns":%d}%b'
                % (lsn, transaction, op.encode(), now_ms, now_us, now_ns, info.encoded.close),
            )
        )
        if len(out) > self.max_record_bytes:
            raise self._too_large(info, lsn, len(out))
        return out

    @staticmethod
    def _full(info: RelationInfo, row: dict[str, JsonValue] | None) -> bytes:
        """A row with every column (Connect writes a struct's every field): a key-only old
        row gets nulls for the others."""
        if row is None:
            return b"null"
        if len(row) != len(info.published_names):
            row = {n: row.get(n) for n in info.published_names}
        return _dumps(row)

    def snapshot_rows(
        self,
        info: RelationInfo,
        rows: Iterable[Sequence[str | None]],
        commit_lsn: int,
        commit_ts: int,
        lsn: int,
    ) -> Iterator[Record]:
        if not info.published:
            yield self._schema_record(info)
        head, middle = self._source_pieces(info, None, commit_ts, b"true")
        topic, headers, plan = info.topic, self.headers, info.plan
        pieces = (
            info.encoded.value_head + b'null,"after":',
            head,
            middle,
            b',"xmin":null,"origin":null,"origin_lsn":null},"transaction":null,"op":"r","ts_ms":',
            b',"ts_us":',
            b',"ts_ns":',
            b"}" + info.encoded.close,
        )
        for values in rows:
            made = (
                plan.record(values, pieces, (lsn, lsn, *self._now())) if plan is not None else None
            )
            if made is not None:
                value, key = made
                if len(value) > self.max_record_bytes:
                    raise self._too_large(info, lsn, len(value))
                yield topic, key, value, headers
                continue
            row = whole_row(info, values)
            yield (
                topic,
                self._key_of(info, row),
                self._envelope(info, head, middle, lsn, "r", None, row, b"null"),
                headers,
            )
