"""The JSON Schemas of the records, as ``schemas/`` holds them for consumers.

    python -m services.contract.schemas [folder]    (default: schemas)

A unit test regenerates them and fails when ``schemas/`` differs, so a change to a model
ships with its schema.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from services.contract.debezium import (
    DebeziumChange,
    DebeziumChangeValue,
    DebeziumKey,
    DebeziumKeyPayload,
    DebeziumTransactionValue,
)
from services.contract.records import (
    TOAST_PLACEHOLDER,
    ChangeValue,
    GapRecord,
    MessageRecord,
    ProgressRecord,
    TableSchemaRecord,
    TransactionRecord,
)

# File name stem -> model, one per kind of record.
SCHEMAS: dict[str, type[BaseModel]] = {
    "change_value": ChangeValue,
    "transaction": TransactionRecord,
    "table_schema": TableSchemaRecord,
    "message": MessageRecord,
    "progress": ProgressRecord,
    "gap": GapRecord,
    "debezium_key": DebeziumKey,
    "debezium_change_value": DebeziumChangeValue,
    "debezium_transaction": DebeziumTransactionValue,
    # debezium_schemas: false (its transaction records are "transaction").
    "debezium_payload_key": DebeziumKeyPayload,
    "debezium_payload_change_value": DebeziumChange,
}


def json_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    if model is ChangeValue:
        schema["description"] = (
            schema.get("description", "") + "\n\nUnchanged TOAST marker: "
            f'a column value equal to "{TOAST_PLACEHOLDER}".'
        ).strip()
    return schema


def schema_texts() -> dict[str, str]:
    """File name -> text of every schema file."""
    return {
        f"{name}.schema.json": json.dumps(json_schema(model), indent=2, sort_keys=True) + "\n"
        for name, model in SCHEMAS.items()
    }


def write_schemas(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in schema_texts().items():
        (folder / name).write_text(text)


if __name__ == "__main__":
    write_schemas(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("schemas"))
