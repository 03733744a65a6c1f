"""Where a table's records go and what keys them: ``routes`` and ``keys`` of the settings.

By default each table has its own topic (``<prefix>.<schema>.<table>``) and its records are
keyed by its replica identity (the primary key, or the primary key under REPLICA IDENTITY
FULL). A route sends several tables to one topic (partitions of one logical table, say);
consumers tell them apart by the ``source`` block, which names the table. A key choice
keys a table's records by other columns.

A record's key decides what a compacted topic keeps, so the choices are checked where they
could silently lose rows: a chosen key must be unique (the columns of a unique index of
NOT NULL columns, or any columns of a table that has none) and its old values must reach
the bridge when they change (REPLICA IDENTITY FULL, unless the choice is the replica
identity itself), and the tables sharing a topic must share their key columns.

Pure: the table facts are handed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.common.errors import SlotbridgeError
from services.common.settings import (
    is_pattern,
    kafka_topic_name,
    matches_any,
    qualified_tables,
)


class RoutingRefused(SlotbridgeError):
    """The routes or keys of the settings do not fit the published tables."""

    retryable = False  # only the settings or the tables can change


class Route(BaseModel):
    """The tables (names or fnmatch patterns) whose records go to ``topic``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tables: list[str] = Field(min_length=1, description="schema.table names or patterns")
    topic: str = Field(description="the whole topic name (the prefix is not added)")

    _tables = field_validator("tables")(qualified_tables)
    _topic = field_validator("topic")(kafka_topic_name)


class KeyChoice(BaseModel):
    """The columns whose values key the records of the tables it names."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tables: list[str] = Field(min_length=1, description="schema.table names or patterns")
    columns: list[str] = Field(min_length=1, description="the key columns, in key order")

    _tables = field_validator("tables")(qualified_tables)


@dataclass(frozen=True, slots=True)
class TableShape:
    """What the checks need of a published table."""

    schema: str
    table: str
    columns: tuple[str, ...]
    replica_identity: str  # pg_class.relreplident: d, f, i, n
    identity_key: tuple[str, ...]  # the key the bridge uses by default
    # Each unique index of NOT NULL columns (the primary key too), its columns in order.
    unique_keys: tuple[tuple[str, ...], ...]
    types: tuple[str, ...] = ()  # the columns' format_type(), when known

    @property
    def name(self) -> str:
        return f"{self.schema}.{self.table}"


class Routing:
    """The routes and key choices of the settings, resolved per table."""

    def __init__(self, routes: Sequence[Route], keys: Sequence[KeyChoice]) -> None:
        self.routes = tuple(routes)
        self.keys = tuple(keys)

    def topic(self, schema: str, table: str) -> str | None:
        """The topic a route sends the table to, or None for its own."""
        found = [r for r in self.routes if matches_any(f"{schema}.{table}", r.tables)]
        return found[0].topic if found else None

    def key(self, schema: str, table: str) -> tuple[str, ...] | None:
        """The key columns chosen for the table, or None for its replica identity's."""
        found = [k for k in self.keys if matches_any(f"{schema}.{table}", k.tables)]
        return tuple(found[0].columns) if found else None

    def refusal(self, shape: TableShape) -> str | None:
        """Why the table's route or key cannot work, in one line, or None."""
        name = shape.name
        routes = [i + 1 for i, r in enumerate(self.routes) if matches_any(name, r.tables)]
        keys = [i + 1 for i, k in enumerate(self.keys) if matches_any(name, k.tables)]
        for what, found in (("routes", routes), ("keys", keys)):
            if len(found) > 1:
                numbers = " and ".join(map(str, found))
                return f"table {name} is matched by {what} {numbers}; make only one match it"
        chosen = self.key(shape.schema, shape.table)
        if chosen is None or chosen == shape.identity_key:
            return None
        missing = [c for c in chosen if c not in shape.columns]
        if missing:
            return f"key of {name}: no published column {', '.join(missing)}"
        if shape.replica_identity != "f":
            return (
                f"key ({', '.join(chosen)}) of {name} needs REPLICA IDENTITY FULL: only then "
                f"do the old values of those columns reach the bridge when they change, so "
                f"the old key can be deleted; run ALTER TABLE {name} REPLICA IDENTITY FULL"
            )
        if shape.unique_keys and set(chosen) not in [set(u) for u in shape.unique_keys]:
            keys_text = "; ".join(", ".join(u) for u in shape.unique_keys)
            return (
                f"key ({', '.join(chosen)}) of {name} is not unique: choose the columns of a "
                f"unique index of NOT NULL columns ({keys_text})"
            )
        return None

    def key_of(self, shape: TableShape) -> tuple[str, ...]:
        """The key columns the table's records will have."""
        return self.key(shape.schema, shape.table) or shape.identity_key

    def collision(self, shapes: Iterable[TableShape]) -> str | None:
        """Tables routed to one topic with different key columns, in one line, or None:
        a compacted topic would keep one table's row under another table's key."""
        by_topic: dict[str, TableShape] = {}
        for shape in shapes:
            topic = self.topic(shape.schema, shape.table)
            if topic is None:
                continue
            first = by_topic.setdefault(topic, shape)
            if self.key_of(first) != self.key_of(shape):
                return (
                    f"tables {first.name} (key {', '.join(self.key_of(first)) or 'none'}) and "
                    f"{shape.name} (key {', '.join(self.key_of(shape)) or 'none'}) are routed "
                    f"to topic {topic} with different keys; route them apart or choose the "
                    f"same key columns"
                )
        return None

    def unmatched(self, names: Iterable[str]) -> str | None:
        """A route or key choice that matches no published table (a typo, most likely)."""
        published = list(names)
        patterns = [("route", i, r.tables) for i, r in enumerate(self.routes)]
        patterns += [("key", i, k.tables) for i, k in enumerate(self.keys)]
        for kind, i, tables in patterns:
            missing = [t for t in tables if not is_pattern(t) and t not in published]
            if missing:
                return (
                    f"{kind} {i + 1} names {', '.join(missing)}, which the publication does "
                    "not publish"
                )
            if not any(matches_any(n, tables) for n in published):
                return (
                    f"{kind} {i + 1} ({', '.join(tables)}) matches no table of the "
                    f"publication; fix its tables"
                )
        return None

    def check(self, shapes: Sequence[TableShape]) -> str | None:
        """Everything above for the published tables at start, the first problem found."""
        problem = self.unmatched(s.name for s in shapes)
        for shape in shapes:
            problem = problem or self.refusal(shape)
        return problem or self.collision(shapes)
