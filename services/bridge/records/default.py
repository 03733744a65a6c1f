"""The default record format (``value_format: slotbridge``): typed JSON values in a
Debezium-style envelope (``services.contract.records.ChangeValue``), no headers.

Values are written from templates: what every change record of a relation shares in one
transaction (the ``source`` block but for ``lsn``) is formatted once per relation and
transaction, what it shares in every transaction (the compiled plan's pieces) once per
relation version.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence

import orjson

from services.bridge.decode import messages as m
from services.bridge.records.catalog import RelationCatalog, RelationInfo
from services.bridge.records.events import (
    DEFAULT_CHOICES,
    EventBuilder,
    Record,
    RecordChoices,
    RowPieces,
    Txn,
    whole_row,
)
from services.bridge.records.values import JSON_NULL, JsonValue
from services.common.lsn import PG_EPOCH_UNIX_MS
from services.contract.records import CONNECTOR, VERSION

_dumps = orjson.dumps


class DefaultEventBuilder(EventBuilder):
    """``EventBuilder`` writing the default format's records."""

    def __init__(
        self,
        catalog: RelationCatalog,
        topic_prefix: str,
        db: str,
        max_record_bytes: int,
        *,
        choices: RecordChoices = DEFAULT_CHOICES,
    ) -> None:
        super().__init__(catalog, topic_prefix, db, max_record_bytes, choices=choices)
        # Relation oid -> (the version, its source block's two templates): the same for
        # every transaction, and made again only for a new version.
        self._source_templates: dict[int, tuple[RelationInfo, bytes, bytes]] = {}

    def _run_numbers(self, txn: Txn) -> tuple[bytes, tuple[int, ...]]:
        """The transaction's xid, commit LSN, commit time and processing time, so that a
        relation version's pieces are the same in every transaction."""
        return _SLOTS, (txn.xid, txn.commit_lsn, txn.ts_ms, txn.now_ms)

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
        """The delete, its tombstone (``_tombstone``) and the update under the new key share
        the update's numbers: one change, one place in the transaction's order."""
        total, order = txn.number(info.topic)
        headers = self.headers
        return (
            (
                info.topic,
                old_key,
                self._value(txn, info, lsn, "d", before, None, total, order),
                headers,
            ),
            *self._tombstone(info, old_key, headers),
            (
                info.topic,
                key,
                self._value(txn, info, lsn, "u", before, after, total, order),
                headers,
            ),
        )

    def snapshot_rows(
        self,
        info: RelationInfo,
        rows: Iterable[Sequence[str | None]],
        commit_lsn: int,
        commit_ts: int,
        lsn: int,
    ) -> Iterator[Record]:
        """The chunk's shared pieces formatted once, then a value per row: the compiled
        plan's, or the Python path's for a row it does not build."""
        if not info.published:
            yield self._schema_record(info)
        ts_ms = commit_ts // 1000 + PG_EPOCH_UNIX_MS
        commit = b"%d" % commit_lsn
        source, sequence = self._source(info, b"null", commit, b"%d" % ts_ms, b"true")
        rest = _VALUE_REST % (
            source,
            lsn,
            sequence,
            lsn,
            b"r",
            int(time.time() * 1000),
            f"0:{commit_lsn}".encode(),
        )
        topic, key_names, limit, plan = info.topic, info.key_names, self.max_record_bytes, info.plan
        pieces = (_NO_BEFORE, rest, _ORDER, _END)
        for n, values in enumerate(rows, 1):
            key: bytes | None
            made = plan.record(values, pieces, (n, n)) if plan is not None else None
            if made is not None:
                value, key = made
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
        self, info: RelationInfo, xid: bytes, commit_lsn: bytes, ts_ms: bytes, snapshot: bytes
    ) -> tuple[bytes, bytes]:
        """The ``source`` block before and after its ``lsn`` (see ``_VALUE``), of every
        change of a relation in one transaction; the numbers are given as their text."""
        templates = self._source_templates.get(info.oid)
        if templates is None or templates[0] is not info:
            templates = self._source_templates[info.oid] = (info, *_source_templates(self, info))
        return templates[1] % xid, templates[2] % (commit_lsn, ts_ms, snapshot, commit_lsn)

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

    def _row_pieces(self, info: RelationInfo) -> RowPieces:
        """``_VALUE`` cut at the rows and the numbers, the same for a relation version in
        every transaction."""
        return _compiled_pieces(self, info)

    def _pieces(self, txn: Txn, info: RelationInfo) -> tuple[bytes, bytes]:
        """The ``source`` block of a relation's records in ``txn``, before and after lsn."""
        pieces = txn.templates.get(info.oid)
        if pieces is None:
            numbers = txn.source_numbers
            if numbers is None:
                numbers = txn.source_numbers = (
                    b"%d" % txn.xid,
                    b"%d" % txn.commit_lsn,
                    b"%d" % txn.ts_ms,
                )
            pieces = txn.templates[info.oid] = self._source(info, *numbers, b"false")
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
        source, sequence = self._pieces(txn, info)
        return _VALUE % (
            before,
            after,
            source,
            lsn,
            sequence,
            lsn,
            op.encode(),
            txn.now_ms,
            txn.txid,
            total,
            order,
        )


# The numbers of a compiled record (see ``DefaultEventBuilder._run_numbers``): the source block's
# txId, lsn, commit_lsn, ts_ms and its sequence's two LSNs, the record's ts_ms, the
# transaction id's xid and commit LSN, then the orders.
_SLOTS = bytes((3, 0, 4, 5, 4, 0, 6, 3, 4, 1, 2))
# A change record's value is these pieces around, in turn, its after row, its lsn (twice),
# total_order and data_collection_order; the pieces' own fields are the transaction's.
_BEFORE_FIELD = b'{"before":'
_AFTER_FIELD = b',"after":'
_BEFORE = _BEFORE_FIELD + b"%b" + _AFTER_FIELD  # the before row
_NO_BEFORE = _BEFORE % b"null"
_NULL_AFTER = _AFTER_FIELD + b"null"
_TRANSACTION = b'\\"]"},"op":"%b","ts_ms":%d,"transaction":{"id":"%b","total_order":'
_ORDER = b',"data_collection_order":'
_END = b"}}"
# After the rows: the source block up to its lsn, the lsn, the rest of the source block up
# to the sequence's second LSN (see ``_source_templates``), the lsn again.
_VALUE = _BEFORE + b"%b%b%d%b%d" + _TRANSACTION + b"%d" + _ORDER + b"%d" + _END
# Where a snapshot chunk's records differ from one another: the row and the orders.
_VALUE_REST = b"%b%d%b%d" + _TRANSACTION
_SNAPSHOT_VALUE = _NO_BEFORE + b"%b%b%d" + _ORDER + b"%d" + _END


def _source_templates(builder: EventBuilder, info: RelationInfo) -> tuple[bytes, bytes]:
    """The ``source`` block of a relation version's records, as two templates: up to its
    ``lsn`` (taking the transaction id), and from after the ``lsn`` to the sequence's
    second LSN (taking the commit LSN, the commit time, the snapshot flag and the commit
    LSN again). Only numbers are formatted per transaction."""
    # Names may hold a %: the template's own are escaped.
    fields = _source_fields(builder, info).replace(b"%", b"%%")
    head = b',"source":' + fields + b',"txId":%b,"lsn":'
    tail = b',"commit_lsn":%%b,"ts_ms":%%b,"snapshot":"%%b","schema_version":%d' % info.version
    return head, tail + b',"sequence":"[\\"%b\\",\\"'


def _source_fields(builder: EventBuilder, info: RelationInfo) -> bytes:
    """The ``source`` block's fields that name the relation, as an unclosed JSON object."""
    return _dumps(
        {
            "connector": CONNECTOR,
            "version": VERSION,
            "name": builder.topic_prefix,
            "db": builder.db,
            "schema": info.schema,
            "table": info.table,
        }
    )[:-1]


def _compiled_pieces(builder: EventBuilder, info: RelationInfo) -> RowPieces:
    """``_VALUE`` of a relation version's insert, update, delete and update with its old
    row, cut at the rows and at the numbers (``_SLOTS``)."""
    source = b',"source":' + _source_fields(builder, info) + b',"txId":'
    numbers = (
        b',"lsn":',
        b',"commit_lsn":',
        b',"ts_ms":',
        b',"snapshot":"false","schema_version":%d,"sequence":"[\\"' % info.version,
        b'\\",\\"',
    )

    def tail(op: bytes) -> tuple[bytes, ...]:
        return (
            b'\\"]"},"op":"%b","ts_ms":' % op,
            b',"transaction":{"id":"',
            b":",
            b'","total_order":',
            _ORDER,
            _END,
        )

    return (
        (_NO_BEFORE, source, *numbers, *tail(b"c")),
        (_NO_BEFORE, source, *numbers, *tail(b"u")),
        (_BEFORE_FIELD, _NULL_AFTER + source, *numbers, *tail(b"d")),
        (_BEFORE_FIELD, _AFTER_FIELD, source, *numbers, *tail(b"u")),
    )


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
