"""The bridge daemon's settings (file + ``SLOTBRIDGE_*`` environment)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator

from services.bridge.records.masking import HashRule, Masking, MaskingRefused, TransformRule
from services.bridge.records.routing import KeyChoice, Route, Routing
from services.common.pg import check_dsn
from services.common.settings import (
    HTTP_HOST,
    LOG_FORMAT,
    LOG_LEVEL,
    ServiceSettings,
    kafka_topic_name,
    qualified_tables,
    string_values,
)
from services.contract.topics import MAX_PREFIX

# Where the hash transforms' key comes from when masking_key_file is not set.
MASKING_KEY_ENV = "SLOTBRIDGE_MASKING_KEY"
# An HMAC key shorter than this is guessable by brute force over likely values.
_MIN_KEY_BYTES = 16

_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def _user_cache() -> Path:
    # Per user, not a shared temp folder whose name anyone can predict and squat.
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


# librdkafka settings the bridge sets itself: the values that agree with it (none: any value
# is refused), and what to use instead.
_OWNED_KAFKA_KEYS: dict[str, tuple[frozenset[str], str]] = {
    "bootstrap.servers": (frozenset(), "use kafka_bootstrap"),
    "transactional.id": (frozenset(), "use kafka_transactional_id"),
    "transaction.timeout.ms": (frozenset(), "use kafka_transaction_timeout_ms"),
    "enable.idempotence": (frozenset({"true"}), "the bridge always enables it (exactly once)"),
    "acks": (frozenset({"all", "-1"}), "the bridge always uses all (exactly once)"),
    "partitioner": (
        frozenset({"murmur2_random"}),
        "the bridge uses murmur2_random, as Java clients do",
    ),
    "message.max.bytes": (frozenset(), "use max_row_bytes"),
    "allow.auto.create.topics": (
        frozenset({"false"}),
        "the bridge creates its topics itself, with the settings they need",
    ),
}


class BridgeSettings(ServiceSettings):
    """Where to read, where to write, and how hard to batch.

    ``source_dsn`` is a libpq connection string; list several hosts
    (``host=a,b target_session_attrs=read-write``) to follow a promotion. TLS options
    (``sslmode``, ``sslrootcert`` ...) go in the DSN and reach libpq unchanged. The
    password may instead come from ``source_password`` or libpq's own ``PGPASSWORD``/
    ``PGPASSFILE`` so it never sits in a file.
    """

    source_dsn: str = Field(description="libpq connection string of the source database")
    source_password: SecretStr | None = Field(
        default=None,
        description="password added to source_dsn (better from SLOTBRIDGE_SOURCE_PASSWORD or "
        "PGPASSFILE than from the file); never logged",
    )
    slot_name: str = Field(
        default="slotbridge",
        description="the failover logical slot the bridge streams (created if missing); also "
        "names the replication origin slotbridge_<slot_name> and the default transactional id",
    )
    publication_name: str = Field(
        default="slotbridge", description="the publication whose tables and rows are published"
    )
    tables: list[str] | None = Field(
        default=None,
        description="schema.table names to publish; all tables when unset",
    )
    create_publication: bool = Field(
        default=True,
        description="create a missing publication together with a new slot (needs the tables' "
        "owner, or a superuser for all tables); an existing one is never changed",
    )
    streaming: Literal["parallel", "on", "off"] = Field(
        default="parallel",
        description="pgoutput streaming of large in-progress transactions: they arrive while "
        "running, are spooled, and are published at their commit",
    )
    two_phase: bool = Field(
        default=True,
        description="decode prepared transactions at PREPARE (spooled until COMMIT PREPARED); "
        "fixed when the slot is created",
    )
    snapshot_mode: Literal["initial", "never", "initial_only"] = Field(
        default="initial",
        description="initial: snapshot a new slot's tables (chunked, while streaming); never; "
        "initial_only: stream until the initial snapshot is published, then drop the slot",
    )
    snapshot_workers: int = Field(
        default=2,
        ge=1,
        le=16,
        description=(
            "chunk readers, one connection each; each reads a different table; chunks read and "
            "waiting to be published are held up to this many, besides those being read"
        ),
    )
    snapshot_chunk_rows: int = Field(
        default=20_000,
        ge=1,
        description=("rows per snapshot chunk (one watermark, one progress step)"),
    )
    snapshot_stall_s: float = Field(
        default=600.0,
        gt=0,
        description=(
            "/healthz fails when snapshots are under way and no chunk was read or published "
            "for this long"
        ),
    )
    snapshot_chunk_bytes: int = Field(
        default=32 * 1024 * 1024,
        ge=1024,
        description=("a chunk ends early past this much row text, which bounds a reader's memory"),
    )

    kafka_bootstrap: str = Field(description="Kafka bootstrap servers, host:port[,host:port]")
    kafka_config: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "extra librdkafka settings (security.protocol, ssl.*, sasl.mechanism ...); they "
            "override the producer's batching defaults (linger.ms 5, batch.size 1000000, "
            "compression.type lz4, queue.buffering.max.*)"
        ),
    )
    kafka_sasl_password: SecretStr | None = Field(
        default=None,
        description="sasl.password of the Kafka clients (better from "
        "SLOTBRIDGE_KAFKA_SASL_PASSWORD than from the file); never logged",
    )
    topic_prefix: str = Field(
        default="slotbridge",
        max_length=MAX_PREFIX,
        description="first part of every topic name: <prefix>.<schema>.<table>, "
        "<prefix>.transaction, <prefix>.schema, <prefix>.message",
    )
    value_format: Literal["slotbridge", "debezium"] = Field(
        default="slotbridge",
        description=(
            "slotbridge: typed JSON values; debezium: the keys, values and headers Debezium's "
            "PostgreSQL connector writes with its defaults through Kafka Connect's JsonConverter "
            "(schemas.enable=true), for consumers built for Debezium"
        ),
    )
    debezium_schemas: bool = Field(
        default=True,
        description="with value_format debezium: every key and value as {schema, payload}, "
        "as Kafka Connect's JsonConverter writes them with schemas.enable=true (Debezium's "
        "default); false: the payload alone (schemas.enable=false), a much smaller record "
        "for consumers that do not read the Connect schema",
    )
    debezium_context_headers: bool = Field(
        default=True,
        description="with value_format debezium: the __debezium.context.* headers on every "
        "change record, as with Debezium's extended.headers.enabled=true (its default); "
        "false: none (a key change's __debezium.newkey/oldkey stay), and the records go to "
        "Kafka in batches, which cannot carry headers",
    )
    transaction_metadata: bool = Field(
        default=True,
        description="write the transaction topic <prefix>.transaction: an END record per "
        "source transaction with its event count and tables (and a BEGIN, see "
        "transaction_begin_records), as Debezium's provide.transaction.metadata=true; "
        "false: no transaction topic, as Debezium's default (the change records keep their "
        "transaction block), two records fewer per OLTP transaction",
    )
    transaction_begin_records: bool = Field(
        default=True,
        description="with transaction_metadata: a BEGIN record per source transaction on "
        "<prefix>.transaction besides its END (which alone carries the event count and the "
        "tables): false saves a record per transaction, a sixth of an OLTP transaction's "
        "records",
    )
    tombstones_on_delete: bool = Field(
        default=True,
        description="follow each delete's record (and a key change's delete) with a "
        "tombstone, a record of the same key and a null value, as Debezium's "
        "tombstones.on.delete=true (its default) does: what lets a compacted topic drop the "
        "key and a JDBC sink delete the row; false: the delete's record alone, half the "
        "records of a purge (the Spark consumers need no tombstones)",
    )
    progress_topic: str = Field(
        default="__slotbridge_progress",
        description="compacted topic of each slot's last published position (one key per slot)",
    )
    topic_partitions: int = Field(
        default=1,
        ge=1,
        description="partitions of the change topics the bridge creates (records of one key "
        "stay in one partition, in order)",
    )
    topic_replication_factor: int = Field(default=-1, description="-1: the broker's default")
    kafka_transaction_timeout_ms: int = Field(
        default=300_000,
        ge=1_000,
        description="transaction.timeout.ms of the producer: the broker aborts a Kafka "
        "transaction open longer (at most the broker's transaction.max.timeout.ms)",
    )
    kafka_transactional_id: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "the slot's Kafka transactional.id (default slotbridge-<slot_name>); bridges of "
            "different databases on one Kafka cluster need different ones, or each start of one "
            "fences the other. The Helm chart sets slotbridge.<namespace>.<release>.<slot>"
        ),
    )

    spool_dir: Path = Field(
        default_factory=lambda: _user_cache() / "slotbridge" / "spool",
        description="folder for transactions too large to hold in memory (row data: created "
        "0700, refused if other users can write to it); default ~/.cache/slotbridge/spool",
    )
    spool_memory_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=0,
        description="bytes of one transaction kept in memory before it spills to spool_dir",
    )
    batch_max_events: int = Field(
        default=20_000,
        ge=1,
        description=("a Kafka transaction is committed once it holds this many change records"),
    )
    batch_max_ms: int = Field(
        default=200,
        ge=1,
        description=(
            "a Kafka transaction is committed once it has been open this long, also while source "
            "transactions keep arriving (a backlog)"
        ),
    )
    batch_linger_ms: int = Field(
        default=0,
        ge=0,
        description=(
            "when no further source transaction is ready, a Kafka transaction is committed once "
            "it has been open this long: 0 commits a quiet stream's transactions at once; "
            "batch_max_ms or more batches by time alone"
        ),
    )
    status_interval_s: float = Field(
        default=10.0,
        gt=0,
        description="seconds between standby status updates to the walsender when nothing "
        "else prompts one (below wal_sender_timeout)",
    )
    max_row_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=1024,
        description="a change record larger than this stops the bridge with a clear error;"
        " topics the bridge creates accept records this large (max.message.bytes)",
    )
    transforms: list[TransformRule] = Field(
        default_factory=list,
        description="column transforms applied to every record, key and snapshot row "
        "(docs/masking.md): each has tables and columns (names or patterns) and a transform: "
        "hash (encoding hex|base64), redact (replacement, null when unset), truncate "
        "(length), mask (keep_last, mask_char) or drop",
    )
    pii_columns: list[str] = Field(
        default_factory=list,
        description="column names or patterns (email, *_ssn) that must have a transform: "
        "the bridge refuses to start, and stops mid-stream, while a published table has "
        "one without",
    )
    masking_key_file: Path | None = Field(
        default=None,
        description=f"file holding the hash transforms' key (at least {_MIN_KEY_BYTES} "
        f"bytes); or set {MASKING_KEY_ENV}; the key is never taken from this file and "
        "never logged",
    )
    routes: list[Route] = Field(
        default_factory=list,
        description="tables (names or patterns) whose change records go to one topic "
        "instead of each its own: {tables: [public.orders_2025_*], topic: app.public.orders}; "
        "the source block names each record's table; tables sharing a topic must share "
        "their key columns",
    )
    keys: list[KeyChoice] = Field(
        default_factory=list,
        description="the message key columns of tables (names or patterns): {tables: [...], "
        "columns: [...]}; other than the replica identity's only under REPLICA IDENTITY "
        "FULL, and the columns of a unique index of NOT NULL columns (any columns for a "
        "table without one)",
    )

    http_host: str = HTTP_HOST
    http_port: int = Field(default=9187, ge=0, le=65535, description="0 disables the server")
    log_format: Literal["json", "text"] = LOG_FORMAT
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = LOG_LEVEL

    @field_validator("slot_name", "publication_name")
    @classmethod
    def _identifier(cls, value: str) -> str:
        if not _IDENT.match(value):
            raise ValueError(
                "must be a lower-case PostgreSQL identifier (a-z, 0-9, _; at most 63 chars)"
            )
        return value

    _dsn = field_validator("source_dsn")(check_dsn)
    _topic = field_validator("topic_prefix", "progress_topic")(kafka_topic_name)
    _qualified = field_validator("tables")(qualified_tables)
    _strings = field_validator("kafka_config", mode="before")(string_values)

    @field_validator("kafka_config")
    @classmethod
    def _not_exactly_once(cls, value: dict[str, str]) -> dict[str, str]:
        # The producer's exactly-once settings are the bridge's: changed, a replay could
        # duplicate or lose records without any error. So is the creation of its topics.
        owned = sorted(
            k
            for k, v in value.items()
            if k in _OWNED_KAFKA_KEYS and v.lower() not in _OWNED_KAFKA_KEYS[k][0]
        )
        if owned:
            raise ValueError(
                f"{', '.join(owned)} cannot be set here: "
                + "; ".join(_OWNED_KAFKA_KEYS[k][1] for k in owned)
            )
        return value

    @field_validator("tables")
    @classmethod
    def _not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value == []:
            # An empty list once meant "all tables" by accident; say which one is meant.
            raise ValueError(
                "an empty list publishes no table; omit tables to publish all "
                "tables, or list schema.table names"
            )
        return value

    @field_validator("debezium_schemas", "debezium_context_headers")
    @classmethod
    def _of_debezium(cls, value: bool, info: ValidationInfo) -> bool:
        # With the default format it would change nothing, silently: the operator meant
        # the Debezium format, or a setting of a consumer.
        if not value and info.data.get("value_format") != "debezium":
            raise ValueError(
                "false applies only with value_format: debezium; set value_format: "
                f"debezium, or leave {info.field_name} out"
            )
        return value

    def routing(self) -> Routing | None:
        """The routes and key choices, None without any."""
        return Routing(self.routes, self.keys) if self.routes or self.keys else None

    def masking(self) -> Masking | None:
        """The transform settings resolved (the hash key read), None without any; read
        when the daemon starts, so commands that never build a record need no key."""
        if not self.transforms and not self.pii_columns:
            return None
        return Masking(self.transforms, self.pii_columns, self.masking_key())

    def masking_key(self) -> bytes | None:
        """The hash transforms' key: the environment's, else masking_key_file's (its
        trailing newline dropped); None when neither is set and no hash needs one."""
        key: bytes | None = None
        if os.environ.get(MASKING_KEY_ENV):
            key = os.environ[MASKING_KEY_ENV].encode()
        elif self.masking_key_file is not None:
            try:
                key = self.masking_key_file.read_bytes().rstrip(b"\r\n")
            except OSError as exc:
                raise MaskingRefused(
                    f"cannot read masking_key_file {self.masking_key_file}: {exc.strerror}"
                ) from None
        elif any(isinstance(rule, HashRule) for rule in self.transforms):
            raise MaskingRefused(
                f"a hash transform needs a key: set {MASKING_KEY_ENV} or masking_key_file"
            )
        if key is not None and len(key) < _MIN_KEY_BYTES:
            raise MaskingRefused(
                f"the masking key has {len(key)} bytes; use at least {_MIN_KEY_BYTES} random "
                "bytes (openssl rand -hex 32)"
            )
        return key

    @property
    def origin_name(self) -> str:
        """The replication origin that records this slot's published progress."""
        return f"slotbridge_{self.slot_name}"

    @property
    def transactional_id(self) -> str:
        """One id per slot: a second bridge on the same slot fences the first."""
        return self.kafka_transactional_id or f"slotbridge-{self.slot_name}"
