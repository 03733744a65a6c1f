"""docs/configuration.md, written from the settings models themselves.

The models are what the services validate against, so a reference generated from them
cannot list a setting that does not exist or miss one that does; a unit test
(tests/unit/test_docs.py) fails when the committed page differs from what this writes.

    .venv/bin/python -m slotbridge_dev.settings_reference   # rewrites docs/configuration.md
"""

from __future__ import annotations

import enum
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from services.bridge.settings import BridgeSettings
from services.failover.settings import FailoverSettings, Node, Standby, Subscriber
from spark_consumers.settings import ConsumerSettings

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"

# (heading, the command that reads it, model, where its keys sit in the file)
SECTIONS: list[tuple[str, str, type[BaseModel], str]] = [
    (
        "Bridge",
        "slotbridge run | status | snapshot | adopt-upgrade --config FILE",
        BridgeSettings,
        "",
    ),
    ("Failover", "slotbridge failover check | watch | promote --config FILE", FailoverSettings, ""),
    ("Failover: a node (`primary`)", "", Node, "primary."),
    ("Failover: a standby (`standbys.<name>`)", "", Standby, "standbys.<name>."),
    ("Failover: a subscriber (`subscribers.<name>`)", "", Subscriber, "subscribers.<name>."),
    ("Spark consumer", "slotbridge consume --config FILE", ConsumerSettings, ""),
]

_HEADER = """# Configuration reference

Generated from the settings models by `python -m slotbridge_dev.settings_reference`; do not
edit by hand (a unit test fails when this page and the models differ).

Every service reads a YAML or TOML file (`--config FILE`, or `SLOTBRIDGE_CONFIG`), and every
top-level setting can also come from the environment as `SLOTBRIDGE_<NAME>` (upper case;
dictionaries and lists as JSON; a nested key joined with `__`, e.g.
`SLOTBRIDGE_PRIMARY__DSN`). The environment wins over the file: that is how Kubernetes
Secrets reach the process. Unknown keys are refused, with the nearest known one suggested.
Examples that the tests load: [`docs/examples/`](examples/).
"""


def type_name(annotation: Any) -> str:
    """A reader's name for a field's type: ``int``, ``list[str] | None``, ``"a" | "b"``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:  # a discriminated union: its members say what it takes
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        return (
            f"{getattr(origin, '__name__', str(origin))}[{', '.join(type_name(a) for a in args)}]"
        )
    if annotation is type(None):
        return "None"
    if annotation is SecretStr:
        return "secret"
    return getattr(annotation, "__name__", str(annotation))


def default_text(info: FieldInfo) -> str:
    """The default as a reader writes it; required settings say so."""
    if info.is_required():
        return "required"
    if info.default_factory is not None:
        try:
            value = info.default_factory()  # type: ignore[call-arg]
        except TypeError:
            return "computed"
        # A folder under the user's home differs per machine: the description says it.
        return "computed" if isinstance(value, Path) else f"`{value!r}`"
    value = info.default
    if value is PydanticUndefined or value is None:
        return "none"
    if isinstance(value, enum.Enum):
        value = value.value
    return f"`{value!r}`" if not isinstance(value, str) else f'`"{value}"`'


def _cell(text: str) -> str:
    """One table cell: one line, its pipes escaped, no <...> taken for HTML."""
    return " ".join(text.split()).replace("|", "\\|").replace("<", "&lt;")


def section(heading: str, command: str, model: type[BaseModel], path: str) -> str:
    lines = [f"## {heading}", ""]
    if command:
        lines += [f"Read by `{command}`.", ""]
    doc = " ".join((model.__doc__ or "").split())
    if doc:
        lines += [doc, ""]
    lines += ["| setting | type | default | description |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        lines.append(
            f"| `{path}{name}` | {_cell(type_name(info.annotation))} | {default_text(info)} "
            f"| {_cell(info.description or '')} |"
        )
    return "\n".join(lines) + "\n"


def render() -> str:
    return "\n".join([_HEADER, *(section(*entry) for entry in SECTIONS)])


def undocumented() -> list[str]:
    """Settings without a description: the reference would leave them unexplained."""
    return [
        f"{model.__name__}.{name}"
        for _, _, model, _ in SECTIONS
        for name, info in model.model_fields.items()
        if not info.description
    ]


def main() -> None:
    PAGE.parent.mkdir(exist_ok=True)
    PAGE.write_text(render())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
