"""The documentation a newcomer follows is the code's: the configuration reference is
generated from the settings models, and every example file loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import BaseModel

from services.bridge.settings import BridgeSettings
from services.common.settings import ServiceSettings, load_settings
from services.failover.settings import FailoverSettings
from slotbridge_dev import settings_reference
from spark_consumers.settings import ConsumerSettings

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def test_configuration_reference_is_current() -> None:
    assert settings_reference.PAGE.read_text() == settings_reference.render(), (
        "docs/configuration.md is stale: run python -m slotbridge_dev.settings_reference"
    )


def test_every_setting_is_described() -> None:
    assert settings_reference.undocumented() == []


@pytest.mark.parametrize(
    ("name", "model"),
    [("bridge", BridgeSettings), ("failover", FailoverSettings), ("consumer", ConsumerSettings)],
)
def test_example_loads(
    name: str, model: type[ServiceSettings], monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in [v for v in os.environ if v.startswith("SLOTBRIDGE_")]:
        monkeypatch.delenv(variable)  # the file alone, as a new user's first run reads it
    settings = load_settings(model, EXAMPLES / f"{name}.yaml")
    assert isinstance(settings, BaseModel)


def test_type_names_read_as_written() -> None:
    fields = BridgeSettings.model_fields
    assert settings_reference.type_name(fields["tables"].annotation) == "list[str] | None"
    assert settings_reference.type_name(fields["streaming"].annotation) == (
        '"parallel" | "on" | "off"'
    )
    assert settings_reference.default_text(fields["source_dsn"]) == "required"
    assert settings_reference.default_text(fields["spool_dir"]) == "computed"
