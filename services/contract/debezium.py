"""The records of the opt-in Debezium format (``value_format: debezium``), as models.

They are what Debezium's PostgreSQL connector writes through Kafka Connect's JsonConverter
with ``schemas.enable=true``: every key and value is ``{"schema": <Connect schema>,
"payload": <data>}``. The Connect schema describes the payload to schema-aware consumers;
the JSON Schemas generated from these models (``schemas/debezium_*.schema.json``) describe
the whole record to everyone else. The schema and message topics keep the default
format's records (``records``); the transaction topic carries ``TransactionRecord`` as its
payload. With ``debezium_schemas: false`` (``schemas.enable=false``) keys and values are
the payloads alone: ``DebeziumKeyPayload``, ``DebeziumChange`` and ``TransactionRecord``.

``tests/integration/test_debezium_format.py`` validates records the real connector wrote
against these models, and ``tests/unit/test_contract.py`` the bridge's own.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel

from services.contract.records import Op, Row, StrictModel, TransactionBlock, TransactionRecord


class ConnectSchema(BaseModel):
    """A Kafka Connect schema as JsonConverter writes it. Open to fields this model does
    not name (``default``, ``doc``, ...): they belong to Connect, not to us."""

    model_config = ConfigDict(extra="allow")

    type: Literal[
        "int8",
        "int16",
        "int32",
        "int64",
        "float",  # JsonConverter's names for Connect's FLOAT32 and FLOAT64
        "double",
        "boolean",
        "string",
        "bytes",
        "array",
        "map",
        "struct",
    ]
    optional: bool = False
    name: str | None = Field(default=None, description="logical type, e.g. io.debezium.time.Date")
    version: int | None = None
    field: str | None = Field(default=None, description="the field's name, inside a struct")
    parameters: dict[str, str] | None = None
    fields: list[ConnectSchema] | None = Field(default=None, description="a struct's fields")
    items: ConnectSchema | None = Field(default=None, description="an array's elements")
    keys: ConnectSchema | None = None
    values: ConnectSchema | None = None


class DebeziumSource(StrictModel):
    """Debezium's ``io.debezium.connector.postgresql.Source`` block."""

    version: str
    connector: Literal["postgresql"]
    name: str = Field(description="the topic prefix")
    ts_ms: int = Field(description="commit time of the source transaction, ms since epoch")
    snapshot: Literal[
        "true",
        "first",
        "first_in_data_collection",
        "last_in_data_collection",
        "last",
        "false",
        "incremental",
    ]
    db: str
    sequence: str | None = Field(
        description='JSON array ["<end LSN of the previous commit>","<lsn>"], as text'
    )
    ts_us: int | None
    ts_ns: int | None
    schema_: str = Field(alias="schema")
    table: str
    txId: int | None
    lsn: int | None
    xmin: int | None
    origin: str | None = None
    origin_lsn: int | None = None


class DebeziumChange(StrictModel):
    """A change record's value without its Connect schema (``debezium_schemas: false``),
    the ``payload`` of ``DebeziumChangeValue``; a delete's tombstone (unless
    ``tombstones_on_delete: false``) has a null value."""

    before: Row | None
    after: Row | None
    source: DebeziumSource
    transaction: TransactionBlock | None
    op: Op
    ts_ms: int = Field(description="when the record was built, ms since epoch")
    ts_us: int | None
    ts_ns: int | None


class DebeziumKey(StrictModel):
    """Key of a change record: the key columns (a keyless table's records have no key)."""

    schema_: ConnectSchema = Field(alias="schema")
    payload: Row


class DebeziumKeyPayload(RootModel[Row]):
    """Key of a change record without its Connect schema (``debezium_schemas: false``): the
    key columns, the ``payload`` of ``DebeziumKey``."""


class DebeziumChangeValue(StrictModel):
    """Value of a record on a change topic; a delete's tombstone (unless
    ``tombstones_on_delete: false``) has a null value."""

    schema_: ConnectSchema = Field(alias="schema")
    payload: DebeziumChange


class DebeziumTransactionValue(StrictModel):
    """Value on ``{prefix}.transaction``: a BEGIN and an END per source transaction, or only
    the END with ``transaction_begin_records: false`` (the END alone carries the counts);
    none with ``transaction_metadata: false``."""

    schema_: ConnectSchema = Field(alias="schema")
    payload: TransactionRecord
