"""Spark types of the record contract (``services.contract``), derived from its JSON Schema.

The consumer parses records with a schema computed here, not written by hand, so it reads
what the bridge writes: a renamed or retyped field changes both, and a field the consumer
names that the contract lacks fails at import. The JSON Schema, not the models, is the
input: it is what ``schemas/`` publishes, with the integer ranges that pick a Spark type.

- an object with ``properties`` (a nested model): a struct, fields in the model's order;
- an object of anything (a row image): one ``variant``, cast to the table's columns where
  its rows are typed (see ``parse.py``);
- an array: an array of its items' type;
- a string, with or without ``enum``: a string; a boolean: a boolean;
- an integer: an int when the contract bounds it to 32 bits, a bigint otherwise.

Every field is nullable: the parse of a record that lacks one yields null, which
``parse.py`` reports as a reason instead of failing the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    VariantType,
)

from services.contract.schemas import json_schema

_REF = "#/$defs/"


def spark_schema(
    model: type[BaseModel], only: Mapping[str, Sequence[str]] | None = None
) -> StructType:
    """The struct a record of ``model`` parses into.

    ``only`` keeps, of the nested struct at a field path (``"source"``), the named fields
    alone: a reader names what it uses and parses no more. A name the contract does not
    have raises ``KeyError``.
    """
    schema = json_schema(model)
    return _Derivation(schema.get("$defs", {}), only or {}).struct(schema, "")


@dataclass(frozen=True, slots=True)
class _Derivation:
    defs: dict[str, Any]  # the JSON Schema's named definitions (the nested models)
    only: Mapping[str, Sequence[str]]

    def struct(self, node: dict[str, Any], path: str) -> StructType:
        properties: dict[str, Any] = node["properties"]
        fields = []
        for name in self.only.get(path, list(properties)):
            where = f"{path}.{name}" if path else name
            if name not in properties:
                raise KeyError(f"the record contract has no field {where}")
            fields.append(StructField(name, self.type(properties[name], where)))
        return StructType(fields)

    def type(self, node: dict[str, Any], path: str) -> DataType:
        if "$ref" in node:
            return self.type(self.defs[node["$ref"].removeprefix(_REF)], path)
        if "anyOf" in node:
            # Optional fields: X or null.
            (present,) = [n for n in node["anyOf"] if n.get("type") != "null"]
            return self.type(present, path)
        kind = node.get("type")
        if kind == "object":
            if "properties" in node:
                return self.struct(node, path)
            return VariantType()
        if kind == "array":
            return ArrayType(self.type(node["items"], path))
        if kind == "string":
            return StringType()
        if kind == "boolean":
            return BooleanType()
        if kind == "integer":
            low, high = node.get("minimum"), node.get("maximum")
            int32 = low is not None and high is not None and low >= -(2**31) and high < 2**31
            return IntegerType() if int32 else LongType()
        raise ValueError(f"no Spark type for field {path} of the record contract: {node}")
