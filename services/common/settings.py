"""Settings: pydantic models filled from a YAML/TOML file and ``SLOTBRIDGE_*`` environment.

Every service describes its settings as a subclass of ``ServiceSettings``; this module only
decides where values come from (environment beats file, file beats defaults) and turns a
ValidationError into one readable line per problem, because an operator starting a daemon
wants "source_dsn: Field required", not a traceback.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, TypeVar

import pydantic_settings
import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class SettingsError(Exception):
    """Invalid or unreadable settings; the message is ready to show as is."""


class ServiceSettings(BaseSettings):
    """Base for every service's settings: env prefix, no unknown keys, env over file."""

    model_config = SettingsConfigDict(
        env_prefix="SLOTBRIDGE_", env_nested_delimiter="__", extra="forbid",
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


def read_settings_file(path: Path) -> dict[str, Any]:
    """Read a YAML or TOML settings file into a dict (TOML by suffix, YAML otherwise)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(f"cannot read settings file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise SettingsError(f"settings file {path} is not valid: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"settings file {path} must hold a mapping at the top level")
    return data


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "settings"
        lines.append(f"invalid setting {where}: {err['msg']}")
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
        raise SettingsError(format_validation_error(exc)) from None
    except pydantic_settings.SettingsError as exc:
        # An environment variable that does not parse (JSON of a dict or list field).
        raise SettingsError(_env_error(cls, exc)) from None


def _env_error(cls: type[ServiceSettings], exc: Exception) -> str:
    found = re.search(r'field "(\w+)"', str(exc))
    where = f"SLOTBRIDGE_{found[1].upper()}" if found else "a SLOTBRIDGE_* variable"
    cause = f": {exc.__cause__}" if exc.__cause__ is not None else ""
    return f"invalid setting {where}: not valid JSON{cause}"
