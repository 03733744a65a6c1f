"""Settings: pydantic models filled from a YAML/TOML file and ``SLOTBRIDGE_*`` environment.

Every service describes its settings as a subclass of ``ServiceSettings``; this module only
decides where values come from (environment beats file, file beats defaults) and turns a
ValidationError into one readable line per problem, because an operator starting a daemon
wants "source_dsn: Field required", not a traceback.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import pydantic_settings
import yaml
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from services.common.errors import SlotbridgeError


class SettingsError(SlotbridgeError):
    """Invalid or unreadable settings; the message is ready to show as is."""

    retryable = False  # only the operator can change the settings


class ServiceSettings(BaseSettings):
    """Base for every service's settings: env prefix, no unknown keys, env over file."""

    model_config = SettingsConfigDict(
        env_prefix="SLOTBRIDGE_",
        env_nested_delimiter="__",
        extra="forbid",
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # File values arrive as init arguments; an environment variable that is set must
        # win over them (that is how Kubernetes Secrets reach the process).
        return (env_settings, init_settings, file_secret_settings)


S = TypeVar("S", bound=ServiceSettings)

# The daemons' HTTP endpoints have no authentication: loopback unless the operator (or the
# Helm chart, for the kubelet and Prometheus) chooses an address others can reach.
HTTP_HOST: Any = Field(
    default="127.0.0.1",
    description="address of the HTTP endpoints (/healthz, /readyz, "
    "/metrics ...; no authentication): loopback by default, the Helm chart sets 0.0.0.0",
)

LOG_FORMAT: Any = Field(
    default="json",
    description="json: one JSON object per line (for log shippers); text: for people",
)
LOG_LEVEL: Any = Field(default="INFO", description="the least severe log level written")

_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def kafka_topic_name(value: str) -> str:
    """Validator: a name Kafka accepts for a topic (or a topic prefix)."""
    if not _TOPIC.match(value):
        raise ValueError("must be a valid Kafka topic name (letters, digits, '.', '_', '-')")
    return value


def qualified_tables(value: list[str] | None) -> list[str] | None:
    """Validator: table names written ``schema.table`` (None means every table)."""
    if value is not None:
        for name in value:
            if name.count(".") != 1:
                raise ValueError(f"table {name!r} must be written schema.table")
    return value


def matches_any(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` matches one of the settings' fnmatch ``patterns`` (case matters:
    PostgreSQL names are case-sensitive once quoted)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def is_pattern(name: str) -> bool:
    """Whether a name in the settings is a pattern, not a name: a name must exist."""
    return any(c in name for c in "*?[")


def read_settings_file(path: Path) -> dict[str, Any]:
    """Read a YAML or TOML settings file into a dict (TOML by suffix, YAML otherwise)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"cannot read settings file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"settings file {path} is not valid TOML: {exc}") from None
    except yaml.YAMLError as exc:
        raise SettingsError(f"settings file {path} is not valid YAML: {_yaml_fault(exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"settings file {path} must hold a mapping at the top level")
    return data


def _yaml_fault(exc: yaml.YAMLError) -> str:
    """PyYAML's multi-line report as one line: the problem and where it is."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return " ".join(str(exc).split())
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def string_values(value: Any) -> Any:
    """Validator (before): client settings as the strings librdkafka/Spark take, so YAML's
    ``linger.ms: 5`` or ``enable.idempotence: true`` work as written."""
    if isinstance(value, dict):
        return {
            k: (str(v).lower() if isinstance(v, bool) else str(v))
            if isinstance(v, bool | int | float)
            else v
            for k, v in value.items()
        }
    return value


def format_validation_error(exc: ValidationError, cls: type[BaseSettings]) -> str:
    """One line per problem; an unknown key gets the nearest known one as a suggestion."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "settings"
        message = err["msg"]
        if err["type"] == "value_error":  # our validators' own words, without pydantic's prefix
            message = str(err.get("ctx", {}).get("error", message))
        elif err["type"] == "extra_forbidden":
            message = "unknown setting"
            if len(err["loc"]) == 1:
                near = difflib.get_close_matches(str(err["loc"][0]), cls.model_fields, n=1)
                if near:
                    message += f"; did you mean {near[0]}?"
        lines.append(f"invalid setting {where}: {message}")
    return "\n".join(lines)


def load_settings(cls: type[S], path: Path | None = None, section: str | None = None) -> S:
    """Build ``cls`` from the file (or one top-level section of it) and the environment."""
    data: dict[str, Any] = {}
    if path is not None:
        data = read_settings_file(path)
        if section is not None:
            data = data.get(section) or {}
    try:
        return cls(**data)
    except ValidationError as exc:
        raise SettingsError(format_validation_error(exc, cls)) from None
    except pydantic_settings.SettingsError as exc:
        # An environment variable that does not parse (JSON of a dict or list field).
        raise SettingsError(_env_error(exc)) from None


def _env_error(exc: Exception) -> str:
    found = re.search(r'field "(\w+)"', str(exc))
    where = f"SLOTBRIDGE_{found[1].upper()}" if found else "a SLOTBRIDGE_* variable"
    cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
    return f"invalid setting {where}: not valid JSON{cause}"
