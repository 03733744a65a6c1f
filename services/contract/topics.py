"""Topic names: ``{prefix}.{schema}.{table}`` per table, made valid for Kafka, and the
prefix's ``schema``, ``transaction`` and ``message`` topics beside them.

PostgreSQL allows any character in a quoted name (``"bad name"``, ``"a.b"``, ``"ümlaut"``);
Kafka allows only ``[A-Za-z0-9._-]`` and at most 249 characters. A name Kafka would refuse
must neither wedge the bridge nor share a topic with another table, so each segment
(schema, table) is mapped on its own:

- kept as it is when it is 1-63 characters of ``[A-Za-z0-9_-]`` and does not end in
  ``--`` and 8 lower-case hex digits;
- otherwise its first 63 characters with every character outside ``[A-Za-z0-9_-]``
  (``.`` included, so a topic always has exactly three segments) replaced by ``_``, then
  ``--`` and the first 8 hex digits of the SHA-256 of the name's UTF-8 bytes:
  ``"bad name"`` -> ``bad_name--<8 hex>``.

Two tables never share a topic: a kept segment never ends the way a mapped one does, and
two mapped ones differ in their digest unless SHA-256's first 32 bits collide between two
names of one schema that also read alike once mapped. The longest topic is the prefix
(at most 100 characters, see ``MAX_PREFIX``) plus two segments of at most 73.

``_`` is kept although Kafka warns that ``.`` and ``_`` collide in its metric names:
snake_case is how PostgreSQL tables are named, and mapping it would rename nearly every
topic. The broker refuses a topic whose name differs from an existing one only by ``.``
against ``_`` (``app.sales.order_items`` next to ``app.sales_order.items``); the bridge
then stops with a line naming both (``TopicRefused``).

The Spark consumers name their tables by the same segments (``table_key``), so a topic and
the consumer's table for it always agree. The prefix's other topics never collide with a
table's: they have one segment after the prefix, a table's topic two.
"""

from __future__ import annotations

import hashlib
import re

MAX_TOPIC = 249
MAX_PREFIX = 100
_SEGMENT_CHARS = 63  # PostgreSQL's NAMEDATALEN - 1
_KEEP = re.compile(rf"[A-Za-z0-9_-]{{1,{_SEGMENT_CHARS}}}")
_MAPPED = re.compile(r".*--[0-9a-f]{8}")
_OUTSIDE = re.compile(r"[^A-Za-z0-9_-]")


def segment(name: str) -> str:
    """One topic segment for a schema or table name (module docstring)."""
    if _KEEP.fullmatch(name) and not _MAPPED.fullmatch(name):
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{_OUTSIDE.sub('_', name[:_SEGMENT_CHARS])}--{digest}"


def table_key(schema: str, table: str) -> str:
    """``schema.table`` as it appears in topic names (and the consumers' table paths)."""
    return f"{segment(schema)}.{segment(table)}"


def table_topic(prefix: str, schema: str, table: str) -> str:
    return f"{prefix}.{table_key(schema, table)}"


def schema_topic(prefix: str) -> str:
    """The compacted topic of ``TableSchemaRecord``s."""
    return f"{prefix}.schema"


def transaction_topic(prefix: str) -> str:
    """The topic of ``TransactionRecord``s (BEGIN/END)."""
    return f"{prefix}.transaction"


def message_topic(prefix: str) -> str:
    """The topic of ``MessageRecord``s."""
    return f"{prefix}.message"
