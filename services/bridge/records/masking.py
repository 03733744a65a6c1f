"""Column transforms: what a published column's value becomes before it leaves the bridge.

Declared once in the settings (``transforms``, ``pii_columns``) and resolved here per
column by name, so every record built from a relation version (stream, snapshot, both
formats, keys) goes through the same converter: a transform is the column's converter,
the text a row carries in, the value the record holds out. Nothing else sees the raw
value, which is why the record builder needs no knowledge of masking beyond "this
column's converter" and "this column is dropped".

Pure: the keyed hash's key is handed in; reading it is the caller's business.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.common.errors import SlotbridgeError
from services.common.settings import is_pattern, matches_any, qualified_tables

JsonText = str | None


class MaskingRefused(SlotbridgeError):
    """A published column and the transform settings do not fit together."""

    retryable = False  # only the settings or the table can change


class _Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tables: list[str] = Field(
        min_length=1,
        description="schema.table names or patterns (fnmatch: * ? [..]) the rule applies to",
    )
    columns: list[str] = Field(
        min_length=1, description="column names or patterns the rule applies to"
    )

    _tables = field_validator("tables")(qualified_tables)


class HashRule(_Rule):
    """Keyed HMAC-SHA-256 of the value's text: deterministic, so joins still work."""

    transform: Literal["hash"]
    encoding: Literal["hex", "base64"] = "hex"


class RedactRule(_Rule):
    """The value replaced by ``replacement`` (null when unset)."""

    transform: Literal["redact"]
    replacement: str | None = None


class TruncateRule(_Rule):
    """The text cut to its first ``length`` characters."""

    transform: Literal["truncate"]
    length: int = Field(ge=0)


class MaskRule(_Rule):
    """Every character but the last ``keep_last`` replaced by ``mask_char``."""

    transform: Literal["mask"]
    keep_last: int = Field(default=4, ge=0)
    mask_char: str = Field(default="*", min_length=1, max_length=1)


class DropRule(_Rule):
    """The column left out of every record, for publications that cannot exclude it."""

    transform: Literal["drop"]


Rule = HashRule | RedactRule | TruncateRule | MaskRule | DropRule
# How the settings take a rule: the ``transform`` field says which.
TransformRule = Annotated[Rule, Field(discriminator="transform")]

# The output of every transform but drop is text, whatever the column's type.
OUTPUT_TYPE = "text"
OUTPUT_TYPE_OID = 25

# format_type() spellings of the types whose text is a string a person reads, so cutting
# or masking it keeps its meaning; the integer types too for mask (card numbers, phones).
_TEXT_TYPES = ("text", "character varying", "character", "citext", "name", '"char"')
_INTEGER_TYPES = ("smallint", "integer", "bigint", "numeric")
_FITS: dict[str, tuple[str, ...] | None] = {
    "hash": None,  # any type: the hash is of its text
    "redact": None,
    "drop": None,
    "truncate": _TEXT_TYPES,
    "mask": _TEXT_TYPES + _INTEGER_TYPES,
}
# Transforms that keep distinct keys distinct: only these may touch a key column.
_KEY_SAFE = ("hash",)


def drop_column(text: str) -> JsonText:
    """The converter of a dropped column: never called, record builders skip it."""
    raise AssertionError("a dropped column's value is never converted")


@dataclass(frozen=True, slots=True)
class ColumnMask:
    """One column's transform: its converter and how the schema record names it."""

    kind: str
    # The rule's parameters as text; part of the table version's identity, so changing
    # them (or the hash key) mints a new version.
    spec: str
    convert: Callable[[str], JsonText]
    # Whether the output can be null where the column is not (redact to null).
    nulls: bool = False
    # The compiled row builder's own kind for it (see _rowjson.c), and the hash key it
    # needs; None: the builder calls ``convert``.
    compiled: bytes | None = None
    key: bytes | None = None

    @property
    def drops(self) -> bool:
        return self.convert is drop_column


@dataclass(frozen=True, slots=True)
class PublishedColumn:
    """What the start check needs of a published column."""

    name: str
    type_name: str  # format_type()
    key: bool  # in the primary key or the replica identity index


def key_id(key: bytes) -> str:
    """A short name of the hash key for the schema record: changes when the key does,
    tells nothing of it (an HMAC of a fixed text)."""
    return hmac.new(key, b"slotbridge masking key id", hashlib.sha256).hexdigest()[:8]


def _hasher(key: bytes, encoding: str) -> Callable[[str], JsonText]:
    keyed = hmac.new(key, digestmod=hashlib.sha256)

    if encoding == "hex":

        def hashed(text: str) -> JsonText:
            h = keyed.copy()  # the key's pads are computed once, not per value
            h.update(text.encode())
            return h.hexdigest()

    else:

        def hashed(text: str) -> JsonText:
            h = keyed.copy()
            h.update(text.encode())
            return base64.b64encode(h.digest()).decode("ascii")

    return hashed


def _masker(keep: int, char: str) -> Callable[[str], JsonText]:
    def masked(text: str) -> JsonText:
        hidden = max(0, len(text) - keep)
        return char * hidden + text[hidden:]

    return masked


def column_mask(rule: Rule, key: bytes | None) -> ColumnMask:
    """The transform a rule applies to each column it matches."""
    if isinstance(rule, HashRule):
        if key is None:
            raise MaskingRefused(
                "a hash transform needs a key: set SLOTBRIDGE_MASKING_KEY or masking_key_file"
            )
        return ColumnMask(
            "hash",
            f"hmac-sha256 {rule.encoding} key {key_id(key)}",
            _hasher(key, rule.encoding),
            compiled=b"h" if rule.encoding == "hex" else b"H",
            key=key,
        )
    if isinstance(rule, RedactRule):
        replacement = rule.replacement
        return ColumnMask(
            "redact",
            "null" if replacement is None else f"text {len(replacement)}",
            lambda text: replacement,
            nulls=replacement is None,
        )
    if isinstance(rule, TruncateRule):
        length = rule.length
        return ColumnMask("truncate", f"{length} characters", lambda text: text[:length])
    if isinstance(rule, MaskRule):
        return ColumnMask(
            "mask",
            f"keep last {rule.keep_last} {rule.mask_char}",
            _masker(rule.keep_last, rule.mask_char),
        )
    return ColumnMask("drop", "", drop_column)


class Masking:
    """The transform settings, resolved per column by name.

    ``rules`` apply in the order given; a column matched by two is refused (the operator
    meant one of them, and which one must not depend on the order of a list).
    ``pii_columns``: names or patterns that must be transformed in every published table.
    """

    def __init__(
        self, rules: Sequence[Rule], pii_columns: Sequence[str], key: bytes | None
    ) -> None:
        self.rules = tuple(rules)
        self.pii_columns = tuple(pii_columns)
        self._masks = tuple(column_mask(r, key) for r in self.rules)

    def _rules_of(self, schema: str, table: str, column: str) -> list[int]:
        qualified = f"{schema}.{table}"
        return [
            i
            for i, r in enumerate(self.rules)
            if matches_any(qualified, r.tables) and matches_any(column, r.columns)
        ]

    def mask(self, schema: str, table: str, column: str) -> ColumnMask | None:
        """The transform of a column (by name alone: a table version's identity depends
        on it, before its types are known), or None to publish it as it is."""
        found = self._rules_of(schema, table, column)
        if not found:
            return None
        return self._masks[found[0]]

    def refusal(self, schema: str, table: str, columns: Sequence[PublishedColumn]) -> str | None:
        """Why a table cannot be published with these settings (one line), or None."""
        for c in columns:
            where = f"{schema}.{table}.{c.name}"
            found = self._rules_of(schema, table, c.name)
            if len(found) > 1:
                numbers = " and ".join(str(i + 1) for i in found)
                return (
                    f"column {where} is matched by transforms {numbers}; "
                    "make only one of them match it"
                )
            if not found:
                if matches_any(c.name, self.pii_columns):
                    return (
                        f"column {where} matches pii_columns but no transform: add a transform "
                        f"for it (or drop it from the publication)"
                    )
                continue
            rule = self.rules[found[0]]
            fits = _FITS[rule.transform]
            base = c.type_name.split("(")[0].strip()
            if fits is not None and base not in fits:
                return (
                    f"transform {rule.transform} does not fit column {where} of type "
                    f"{c.type_name}: it takes {', '.join(fits)}; use hash, redact or drop"
                )
            if c.key and rule.transform not in _KEY_SAFE:
                return (
                    f"transform {rule.transform} cannot apply to key column {where}: keys "
                    f"would collide or vanish; use hash, which keeps distinct keys distinct"
                )
        return None

    def unmatched(self, tables: Mapping[tuple[str, str], Sequence[PublishedColumn]]) -> str | None:
        """A name in a rule that is not published (a typo, most likely), as one line: a
        table named without a pattern, a column named without one in none of the rule's
        tables, or a rule matching no column at all."""
        published = {f"{schema}.{table}": columns for (schema, table), columns in tables.items()}
        for i, rule in enumerate(self.rules):
            where = f"transform {i + 1} ({rule.transform} of {', '.join(rule.columns)})"
            missing = [t for t in rule.tables if not is_pattern(t) and t not in published]
            if missing:
                return f"{where} names {', '.join(missing)}, which the publication does not publish"
            columns = {
                c.name for t, cs in published.items() if matches_any(t, rule.tables) for c in cs
            }
            absent = [c for c in rule.columns if not is_pattern(c) and c not in columns]
            if absent or not any(matches_any(c, rule.columns) for c in columns):
                return (
                    f"{where} matches no published column"
                    f"{' ' + ', '.join(absent) if absent else ''} in {', '.join(rule.tables)}; "
                    "fix its tables or columns"
                )
        return None
