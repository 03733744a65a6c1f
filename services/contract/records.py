"""The records the bridge writes to Kafka, as pydantic models.

These models are the contract with consumers: ``schemas/*.json`` is generated from them
(``python -m services.contract.schemas``) and a test keeps the two equal. The bridge's
record builders do not instantiate them on the hot path (building bytes directly is
several times faster); tests validate what the builders produce against them instead.

Column values are typed JSON by PostgreSQL type (see ``services/bridge/records/values.py``):
integers as numbers, numeric and money as exact decimal strings, timestamps as ISO 8601
strings, json/jsonb as the very JSON text PostgreSQL printed (embedded, not re-encoded:
duplicate keys, number precision and whitespace kept), bytea as base64, arrays as JSON
arrays, anything unknown as text. A TOASTed value the server did not send because it did
not change is the string ``TOAST_PLACEHOLDER`` below (Debezium's placeholder, so existing
Debezium consumers already recognise it).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator

TOAST_PLACEHOLDER = "__debezium_unavailable_value"
CONNECTOR = "slotbridge"
# ``source.version`` of every record: the release that wrote it (pyproject.toml's version;
# tests/unit/test_contract.py keeps the two equal).
VERSION = "0.1.0"

Row = dict[str, Any]
# c: insert, u: update, d: delete, r: snapshot read, t: truncate (Debezium's letters).
Op = Literal["c", "u", "d", "r", "t"]
OPS: tuple[str, ...] = get_args(Op)
# A table schema version counts up from 1; consumers may hold it in 32 bits (Spark does).
SchemaVersion = Annotated[int, Field(ge=1, le=2**31 - 1)]


class StrictModel(BaseModel):
    """A record model: a field it does not name is an error, not silently kept."""

    model_config = ConfigDict(extra="forbid")


class Source(StrictModel):
    """Where a change came from; ``commit_lsn`` then ``lsn`` orders changes totally."""

    connector: Literal["slotbridge"]
    version: str
    name: str = Field(description="the topic prefix of the bridge that wrote it")
    db: str
    schema_: str = Field(alias="schema")
    table: str
    txId: int | None = Field(description="source transaction id; null in a snapshot")
    lsn: int | None = Field(description="WAL position of the change")
    commit_lsn: int | None = Field(
        description=(
            "WAL position of the transaction's commit; in a snapshot record (op r), the commit "
            "of the watermark transaction that closed its chunk: it sorts after every change its "
            "rows contain and before every change they do not"
        )
    )
    ts_ms: int = Field(description="commit time of the source transaction, ms since epoch")
    snapshot: Literal["true", "last", "false"]
    sequence: str = Field(description='JSON array ["<commit_lsn>","<lsn>"] (Debezium style)')
    schema_version: SchemaVersion = Field(
        description="version of the table schema record it was built with"
    )


class TransactionBlock(StrictModel):
    id: str = Field(description="'<txId>:<commit_lsn>'")
    total_order: int = Field(description="1-based position of the change in its transaction")
    data_collection_order: int = Field(description="1-based position within its table")


class JsonNulls(StrictModel):
    """Per row image, the json/jsonb columns whose value is JSON ``null``, not SQL NULL."""

    before: list[str] | None = None
    after: list[str] | None = None


class ChangeValue(StrictModel):
    """Value of a record on a change topic ``{prefix}.{schema}.{table}``.

    A schema or table name Kafka would refuse in a topic name (characters outside
    ``[A-Za-z0-9_-]``, a ``.``, more than 63 characters) appears there mapped, as
    ``<name with those characters replaced by _>--<8 hex digits of its SHA-256>``;
    ``source.schema`` and ``source.table`` always hold the real names.

    The key is a JSON object of the key columns (primary key or replica identity). A delete
    is followed by a record with the same key and a null value (tombstone), unless the
    bridge runs with ``tombstones_on_delete: false``. A truncate has a null key and
    ``op: "t"``.
    """

    before: Row | None = Field(
        description="old row: the key columns by default, every column with REPLICA IDENTITY FULL"
    )
    after: Row | None
    source: Source
    op: Op
    ts_ms: int = Field(description="when the bridge built the record, ms since epoch")
    transaction: TransactionBlock | None
    json_nulls: JsonNulls | None = Field(
        default=None,
        description="json/jsonb columns holding JSON null (embedded, it reads "
        "like SQL NULL); absent when there is none",
    )


class DataCollection(StrictModel):
    data_collection: str = Field(
        description="the table as its change topic names it: ``{schema}.{table}``, each name "
        "mapped if Kafka would refuse it (see ChangeValue)"
    )
    event_count: int


class TransactionRecord(StrictModel):
    """Value on ``{prefix}.transaction``: a BEGIN and an END per source transaction, or only
    the END with ``transaction_begin_records: false`` (the END alone carries the counts);
    none with ``transaction_metadata: false``."""

    status: Literal["BEGIN", "END"]
    id: str
    event_count: int | None = None
    data_collections: list[DataCollection] | None = None
    ts_ms: int


class MessageRecord(StrictModel):
    """Value on ``{prefix}.message``: a ``pg_logical_emit_message`` message written in a
    published transaction, keyed by ``{"prefix": <prefix>}``.

    It sits in the source transaction's Kafka transaction, between that transaction's
    BEGIN (if written) and END, and counts in its END's ``event_count``. A transaction
    holding nothing but one of the bridge's own messages (a snapshot watermark or signal)
    publishes nothing.
    """

    prefix: str
    content: str = Field(description="the message's bytes, base64")
    transactional: bool
    lsn: int = Field(description="WAL position of the message")
    txId: int = Field(description="source transaction id")
    commit_lsn: int = Field(description="WAL position of the transaction's commit")
    ts_ms: int = Field(description="commit time of the source transaction, ms since epoch")


class ColumnTransform(StrictModel):
    """A transform the bridge applies to a column's values (its settings' ``transforms``):
    the column's ``type`` is then what the transform outputs (text)."""

    kind: Literal["hash", "redact", "truncate", "mask"]
    spec: str = Field(
        description="the transform's parameters; a new spec (or hash key) is a new version"
    )
    source_type: str = Field(description="the column's PostgreSQL type, as format_type() prints it")
    source_type_oid: int
    source_type_modifier: int


class ColumnSchema(StrictModel):
    name: str
    type: str = Field(description="PostgreSQL type as format_type() prints it")
    type_oid: int
    type_modifier: int
    nullable: bool
    key: bool
    dimensions: int | None = Field(
        default=None,
        description="an array column's declared dimensions (int[][]: 2), when "
        "more than one; PostgreSQL does not enforce them",
    )
    transform: ColumnTransform | None = Field(
        default=None, description="how the bridge transforms the column's values, if it does"
    )


class TableRouting(StrictModel):
    """A route or key choice of the bridge's settings that applies to the table."""

    topic: str | None = Field(
        description="the topic a route sends its change records to (None: its own)"
    )
    key_columns: list[str] | None = Field(
        description="the key columns chosen in the settings (None: the replica identity's)"
    )


class TableSchemaRecord(StrictModel):
    """Value on the compacted ``{prefix}.schema`` topic, keyed by schema, table and version.

    Published inside the same Kafka transaction as, and before, the first change record
    built with that version.
    """

    schema_: str = Field(alias="schema")
    table: str
    version: SchemaVersion
    relation_oid: int
    replica_identity: Literal["d", "n", "f", "i"]
    columns: list[ColumnSchema]
    key_columns: list[str]
    ts_ms: int
    routing: TableRouting | None = Field(
        default=None, description="set when a route or a key choice applies to the table"
    )


class TableSnapshot(StrictModel):
    """A table snapshot under way: how far its chunks got, as of the progress record.

    Chunks follow the table's key (``cursor``: the text of the last key read) or, for a
    table without one, its heap pages (``cursor``: the next page). A restart resumes after
    ``cursor``; a table whose last chunk is published leaves the list.
    """

    schema_: str = Field(alias="schema")
    table: str
    id: str = Field(
        description="the request: 'initial', 'added', 'resync', or an on-demand request id"
    )
    where: str | None = Field(default=None, description="the on-demand condition, SQL")
    cursor: list[str | None] | None = Field(default=None, description="null before the first chunk")
    chunks: int = 0
    rows: int = Field(default=0, description="rows published so far")
    started_ms: int


class EndedSnapshot(TableSnapshot):
    """A table snapshot that ended, as far as it got: what its request published.

    The progress record keeps the last few, so ``slotbridge snapshot`` reports what Kafka
    holds once the request's entry has left ``snapshots``.
    """

    outcome: Literal["done", "cancelled", "failed"]
    reason: str | None = Field(default=None, description="why it failed")
    ended_ms: int


class GapRecord(StrictModel):
    """Value on the progress topic and on the schema topic, keyed by slot and ``after_lsn``
    (``{"slot": ..., "gap_after_lsn": ...}``): changes Kafka does not hold, as ``slotbridge
    resync`` recorded them when it published the tables again. The Spark consumers keep
    each gap they read on the schema topic in their ``_gaps`` table.

    ``kind`` ``source``: the source lost the changes committed after ``after_lsn`` (an
    invalidated or dropped slot) until the new slot's start. ``topic``: Kafka lost what the
    topics named in ``reason`` held up to ``after_lsn`` (deleted under the bridge). Every
    table in ``tables`` is snapshotted again (snapshot id ``resync``) in stream order, so a
    key's last record is its current state again once that snapshot ended. A row deleted
    during a source gap has no record saying so: a consumer may drop the keys the resync
    snapshot did not publish again.
    """

    slot: str
    kind: Literal["source", "topic"]
    after_lsn: int = Field(description="end of the last source transaction Kafka holds")
    reason: str = Field(description="why, e.g. 'slot invalidated (wal_removed)'")
    tables: list[str] = Field(description="schema.table of every table snapshotted again")
    ts_ms: int


class ProgressRecord(StrictModel):
    """Value on the compacted progress topic, keyed by slot name.

    ``end_lsn`` is the end of the last source transaction whose records are committed in
    Kafka; with the replication origin it forms the bridge's high-water mark.
    ``snapshots`` lists the table snapshots not finished yet, as far as they got;
    ``ended`` the last ones that ended (the bridge keeps 16), oldest first.
    """

    slot: str
    end_lsn: int
    commit_lsn: int
    system_identifier: str
    timeline: int
    ts_ms: int
    snapshots: list[TableSnapshot] = Field(default_factory=list)
    ended: list[EndedSnapshot] = Field(default_factory=list)
    topic_ids: dict[str, str] = Field(
        default_factory=dict,
        description="topic name -> Kafka topic id of every topic the bridge wrote: one "
        "deleted and recreated since has another id",
    )

    @field_validator("snapshots", mode="before")
    @classmethod
    def _drop_old_entries(cls, value: Any) -> Any:
        # Before chunked snapshots an entry was a point until which the stream's older
        # changes were dropped; the stream has long passed it.
        if not isinstance(value, list):
            return value
        return [e for e in value if not (isinstance(e, dict) and "lsn" in e)]
