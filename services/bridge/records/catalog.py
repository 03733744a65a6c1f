"""Relation messages in, versioned table shapes out: what a table version's records are
made of (names, converters, key, topic, transforms, the compiled row plan).

A table's version is what consumers type its records by (the schema topic): it goes up
when its columns, replica identity, transforms, route or key change, and a restart that
sees the same shape again reuses the version the schema topic already holds.

Pure: catalogue facts the Relation message does not carry (type names, nullability,
primary and unique keys) come through a callback the daemon supplies.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from services.bridge.decode import messages as m
from services.bridge.records.masking import (
    OUTPUT_TYPE,
    OUTPUT_TYPE_OID,
    ColumnMask,
    Masking,
    MaskingRefused,
    PublishedColumn,
    drop_column,
)
from services.bridge.records.routing import Routing, RoutingRefused, TableShape
from services.bridge.records.values import (
    TYPE_NAMES,
    ArrayOf,
    Converter,
    JsonValue,
    bool_from_text,
    bytea_base64,
    converter_for,
    float_or_text,
    raw_json,
    timestamp_iso,
    timestamptz_iso,
)
from services.contract.records import TOAST_PLACEHOLDER
from services.contract.topics import table_topic

try:
    # Re-exported (``as``): the builder runs the compiled runs over these plans.
    from services.bridge.records._rowjson import RowPlan as RowPlan
    from services.bridge.records._rowjson import runs as runs
except ImportError:  # installed where no C compiler was at hand: rows are built in Python
    RowPlan = None  # type: ignore[assignment,misc]
    runs = None  # type: ignore[assignment]
COMPILED = RowPlan is not None

_dumps = orjson.dumps

_JSON_OIDS = frozenset((114, 3802))


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
    # Each unique index of NOT NULL columns, its columns in order (for a chosen key).
    unique_keys: tuple[tuple[str, ...], ...] = ()


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
    # Each column's transform (see masking.py), None where it is published as it is.
    masks: tuple[ColumnMask | None, ...] = ()
    # The columns the records hold: all but the dropped ones.
    published_names: tuple[str, ...] = ()
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
    masking: Masking | None = None
    routing: Routing | None = None
    # The routed tables' shapes so far, for the key check of tables sharing a topic.
    _routed: dict[tuple[str, str], TableShape] = field(default_factory=dict, init=False)

    def _routing_of(self, schema: str, table: str) -> dict[str, Any] | None:
        """The schema record's ``routing``: the route and key choice of the table."""
        if self.routing is None:
            return None
        topic, key = self.routing.topic(schema, table), self.routing.key(schema, table)
        if topic is None and key is None:
            return None
        return {"topic": topic, "key_columns": list(key) if key is not None else None}

    def _masks(self, rel: m.Relation) -> tuple[ColumnMask | None, ...]:
        if self.masking is None:
            return (None,) * len(rel.columns)
        return tuple(self.masking.mask(rel.namespace, rel.name, c.name) for c in rel.columns)

    def apply(self, rel: m.Relation) -> RelationInfo:
        masks = self._masks(rel)
        fingerprint = _fingerprint(
            rel.replica_identity,
            (
                (c.name, c.type_oid, c.type_modifier, c.is_key, mask.spec if mask else None)
                for c, mask in zip(rel.columns, masks, strict=True)
                if mask is None or not mask.drops
            ),
            self._routing_of(rel.namespace, rel.name),
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
        info = self._build(rel, version, masks)
        info.published = published
        self.known[name] = KnownVersion(version, fingerprint)
        self.by_oid[rel.oid] = info
        return info

    def _routed_key(
        self, rel: m.Relation, facts: TableFacts | None, key_idx: tuple[int, ...]
    ) -> tuple[int, ...]:
        """The key columns of a routed or re-keyed table version (``key_idx``: its replica
        identity's), checked as at start: a table added to the publication, or a table
        altered, mid-stream stops the bridge before a record of it is built."""
        assert self.routing is not None
        names = tuple(c.name for c in rel.columns)
        shape = TableShape(
            rel.namespace,
            rel.name,
            names,
            rel.replica_identity,
            tuple(names[i] for i in key_idx),
            facts.unique_keys if facts is not None else (),
        )
        self._routed[(rel.namespace, rel.name)] = shape
        refusal = self.routing.refusal(shape) or self.routing.collision(self._routed.values())
        if refusal is not None:
            raise RoutingRefused(refusal)
        return tuple(names.index(c) for c in self.routing.key_of(shape))

    def _check_masking(
        self, rel: m.Relation, type_names: tuple[str, ...], key_idx: tuple[int, ...]
    ) -> None:
        """Refuse a version whose columns the masking settings cannot transform. Checked
        per version, so a column added mid-stream stops the bridge before any record of it
        is built."""
        if self.masking is None:
            return
        refusal = self.masking.refusal(
            rel.namespace,
            rel.name,
            [
                PublishedColumn(c.name, t, i in key_idx)
                for i, (c, t) in enumerate(zip(rel.columns, type_names, strict=True))
            ],
        )
        if refusal is not None:
            raise MaskingRefused(refusal)

    def _build(
        self, rel: m.Relation, version: int, masks: tuple[ColumnMask | None, ...]
    ) -> RelationInfo:
        facts = self.lookup(rel.oid)
        names = tuple(c.name for c in rel.columns)
        routing = self._routing_of(rel.namespace, rel.name)
        key_idx = _identity_key(rel, facts)
        if routing is not None:
            key_idx = self._routed_key(rel, facts, key_idx)
        type_names = tuple(
            fact.type_name
            if facts is not None and (fact := facts.columns.get(c.name)) is not None
            else TYPE_NAMES.get(c.type_oid, "text")
            for c in rel.columns
        )
        self._check_masking(rel, type_names, key_idx)
        record = {
            "schema": rel.namespace,
            "table": rel.name,
            "version": version,
            "relation_oid": rel.oid,
            "replica_identity": rel.replica_identity,
            "columns": [
                _schema_column(
                    c,
                    type_name,
                    facts.columns.get(c.name) if facts is not None else None,
                    c.is_key if rel.replica_identity != "f" else i in key_idx,
                    mask,
                )
                for i, (c, type_name, mask) in enumerate(
                    zip(rel.columns, type_names, masks, strict=True)
                )
                if mask is None or not mask.drops
            ],
            "key_columns": [names[i] for i in key_idx],
            "ts_ms": int(time.time() * 1000),
        }
        if routing is not None:
            record["routing"] = routing
        info = RelationInfo(
            oid=rel.oid,
            schema=rel.namespace,
            table=rel.name,
            topic=(routing or {}).get("topic")
            or table_topic(self.topic_prefix, rel.namespace, rel.name),
            version=version,
            names=names,
            converters=tuple(
                mask.convert if mask is not None else converter_for(c.type_oid)
                for c, mask in zip(rel.columns, masks, strict=True)
            ),
            key_idx=key_idx,
            key_names=tuple(names[i] for i in key_idx),
            replica_identity=rel.replica_identity,
            schema_record=record,
            placeholders=(TOAST_PLACEHOLDER,) * len(names),
            json_names=tuple(
                n
                for n, c, mask in zip(names, rel.columns, masks, strict=True)
                if c.type_oid in _JSON_OIDS and mask is None
            ),
            masks=masks,
            published_names=tuple(
                n for n, mask in zip(names, masks, strict=True) if mask is None or not mask.drops
            ),
        )
        if self.encoder is not None:
            self.encoder(info, rel, facts)
        else:
            info.plan = row_plan(info)
        return info


def _identity_key(rel: m.Relation, facts: TableFacts | None) -> tuple[int, ...]:
    """The key columns of a version by its replica identity: the columns the Relation
    message flags, or, with REPLICA IDENTITY FULL (which flags every column), the primary
    key: the key consumers expect, and the one Debezium uses."""
    if rel.replica_identity == "f" and facts is not None and facts.primary_key:
        return tuple(i for i, c in enumerate(rel.columns) if c.name in facts.primary_key)
    return tuple(i for i, c in enumerate(rel.columns) if c.is_key)


def _schema_column(
    column: m.Column,
    type_name: str,
    fact: ColumnFacts | None,
    is_key: bool,
    mask: ColumnMask | None,
) -> dict[str, Any]:
    """One column of a version's schema record; a transformed column is typed by what its
    transform outputs."""
    described: dict[str, Any] = {
        "name": column.name,
        "type": type_name,
        "type_oid": column.type_oid,
        "type_modifier": column.type_modifier,
        "nullable": fact.nullable if fact else True,
        "key": is_key,
    }
    if mask is not None:
        # The source type stays for the version's identity (and the curious).
        described["transform"] = {
            "kind": mask.kind,
            "spec": mask.spec,
            "source_type": type_name,
            "source_type_oid": column.type_oid,
            "source_type_modifier": column.type_modifier,
        }
        described.update(
            type=OUTPUT_TYPE,
            type_oid=OUTPUT_TYPE_OID,
            type_modifier=-1,
            nullable=described["nullable"] or mask.nulls,
        )
    elif fact is not None and fact.dimensions > 1:
        described["dimensions"] = fact.dimensions
    return described


# How the compiled builder writes each converter's values; any other converter is called
# from it. Keyed by the converter itself, so the two cannot disagree on a type.
_KINDS: dict[Callable[[str], JsonValue], bytes] = {
    int: b"i",
    str: b"s",
    bool_from_text: b"b",
    timestamp_iso: b"t",
    timestamptz_iso: b"z",
    # Written as it is; a row with a JSON null, which the record names (``json_nulls``),
    # is left to the Python path.
    raw_json: b"j",
    # Printed in hex (bytea_output's default; escape: the converter's).
    bytea_base64: b"B",
    # In fixed notation (exponents, NaN and Infinity: the converter's).
    float_or_text: b"f",
    # Left out of the row (a transform's other converters are called: 'p').
    drop_column: b"x",
}
# The kinds an array's elements may have for the builder to write the array itself ('a',
# its param the element's kind): those that need no param, whose elements array_out never
# escapes in the usual case (json's and bytea's it always does).
_ELEMENT_KINDS = frozenset(b"isbtzfMmdUuV")


def _kind(conv: Converter, own: Mapping[Converter, tuple[bytes, int]]) -> tuple[bytes, int]:
    """How the compiled builder writes a converter's values: its kind and the kind's param."""
    if isinstance(conv, ArrayOf):
        element, param = _kind(conv.element, own)
        return (b"a", element[0]) if element[0] in _ELEMENT_KINDS and not param else (b"p", 0)
    return own.get(conv) or (_KINDS.get(conv, b"p"), 0)


def row_plan(
    info: RelationInfo,
    key_frame: tuple[bytes, bytes] = (b"", b""),
    whole_old_key: bool = False,
    own_kinds: Mapping[Converter, tuple[bytes, int]] | None = None,
) -> RowPlan | None:
    """The compiled builder of a relation version's row and key JSON (the key object
    between ``key_frame``): the same bytes as ``_dumps`` of the row and key dicts the
    Python path builds with ``info.converters``, several times faster, an unchanged TOAST
    value as its ``info.placeholders`` JSON. ``whole_old_key``: a delete's old key is
    written as a whole row (its other columns null). ``own_kinds``: a record format's own
    converters the builder writes itself, with their kind and its parameter. None without
    the extension."""
    if RowPlan is None:
        return None
    masks = info.masks or (None,) * len(info.names)
    own = own_kinds or {}
    kinds = [
        (mask.compiled, 0) if mask is not None and mask.compiled else _kind(conv, own)
        for conv, mask in zip(info.converters, masks, strict=True)
    ]
    return RowPlan(
        tuple(_dumps(name) + b":" for name in info.names),
        b"".join(kind for kind, _ in kinds),
        info.key_idx,
        info.converters,
        _dumps,
        *key_frame,
        whole_old_key,
        tuple(_dumps(placeholder) for placeholder in info.placeholders),
        # Every hash transform of a plan has the settings' one key.
        next((mask.key for mask in masks if mask is not None and mask.key), None),
        tuple(param for _, param in kinds),
    )


Column = tuple[str, int, int, bool, str | None]


def _fingerprint(
    identity: str, columns: Iterable[Column], routing: dict[str, Any] | None
) -> tuple[Any, ...]:
    """What makes a table version: its replica identity, (name, type, typmod, key flag,
    transform) per published column, as a Relation message gives them, and the route and
    key chosen for it."""
    route = (routing["topic"], tuple(routing["key_columns"] or ())) if routing else None
    return (identity, route, *columns)


def _column_identity(identity: str, column: dict[str, Any]) -> Column:
    """A schema record column's part of the fingerprint: a transformed column's record
    names its output type, so the source type comes from the transform."""
    transform = column.get("transform")
    if transform is None:
        return (
            column["name"],
            column["type_oid"],
            column["type_modifier"],
            identity == "f" or column["key"],
            None,
        )
    return (
        column["name"],
        transform["source_type_oid"],
        transform["source_type_modifier"],
        identity == "f" or column["key"],
        transform["spec"],
    )


def known_versions(schema_records: Iterable[dict[str, Any]]) -> dict[tuple[str, str], KnownVersion]:
    """The newest version per table among schema records (``RelationCatalog.known``)."""
    known: dict[tuple[str, str], KnownVersion] = {}
    for rec in schema_records:
        ident = rec["replica_identity"]
        # A Relation message flags every column as key under REPLICA IDENTITY FULL; the
        # record flags the primary key instead.
        fingerprint = _fingerprint(
            ident, (_column_identity(ident, c) for c in rec["columns"]), rec.get("routing")
        )
        name = (rec["schema"], rec["table"])
        if name not in known or known[name].version < rec["version"]:
            known[name] = KnownVersion(rec["version"], fingerprint)
    return known
