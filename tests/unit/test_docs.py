"""The documentation a newcomer follows is the code's: the configuration reference is
generated from the settings models, and every example file loads."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from services.bridge.settings import BridgeSettings
from services.common.settings import ServiceSettings, load_settings
from services.failover.settings import FailoverSettings
from slotbridge_dev import settings_reference
from spark_consumers.settings import ConsumerSettings

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "docs" / "examples"
MODELS: dict[str, type[ServiceSettings]] = {
    "bridge": BridgeSettings,
    "failover": FailoverSettings,
    "consumer": ConsumerSettings,
}
# A YAML block in a page, its first line naming the file it is: "# bridge.yaml".
_YAML_BLOCK = re.compile(r"^```yaml\n# (\w+)\.yaml\b[^\n]*\n(.*?)^```", re.M | re.S)


def _pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _blocks() -> list[tuple[str, str, str]]:
    """(page, kind, text) of every YAML example in README.md and docs/."""
    return [
        (page.name, m.group(1), m.group(2))
        for page in _pages()
        for m in _YAML_BLOCK.finditer(page.read_text())
    ]


def test_configuration_reference_is_current() -> None:
    assert settings_reference.PAGE.read_text() == settings_reference.render(), (
        "docs/configuration.md is stale: run python -m slotbridge_dev.settings_reference"
    )


def test_every_setting_is_described() -> None:
    assert settings_reference.undocumented() == []


def _without_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in [v for v in os.environ if v.startswith("SLOTBRIDGE_")]:
        monkeypatch.delenv(variable)  # the file alone, as a new user's first run reads it


@pytest.mark.parametrize("name", sorted(MODELS))
def test_example_loads(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _without_environment(monkeypatch)
    settings = load_settings(MODELS[name], EXAMPLES / f"{name}.yaml")
    assert isinstance(settings, BaseModel)


def test_every_yaml_block_in_the_pages_names_its_file() -> None:
    """So the test below loads each one: a block without the name would go unchecked."""
    for page in _pages():
        text = page.read_text()
        assert text.count("```yaml\n") == len(_YAML_BLOCK.findall(text)), page.name


@pytest.mark.parametrize(("page", "kind", "text"), _blocks())
def test_yaml_block_in_the_pages_loads(
    page: str, kind: str, text: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _without_environment(monkeypatch)
    # The hash transforms' key comes from the environment only (docs/masking.md).
    monkeypatch.setenv("SLOTBRIDGE_MASKING_KEY", "a key of the docs' examples, 32 bytes")
    path = tmp_path / f"{kind}.yaml"
    path.write_text(text)
    assert isinstance(load_settings(MODELS[kind], path), BaseModel), page


def test_readme_keeps_the_command_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Run the tests", 1)[1].split("\n## ", 1)[0]
    assert "python3 -m slotbridge_dev.bootstrap && .venv/bin/python -m pytest -n 2\n" in section


def test_type_names_read_as_written() -> None:
    fields = BridgeSettings.model_fields
    assert settings_reference.type_name(fields["tables"].annotation) == "list[str] | None"
    assert settings_reference.type_name(fields["streaming"].annotation) == (
        '"parallel" | "on" | "off"'
    )
    assert settings_reference.default_text(fields["source_dsn"]) == "required"
    assert settings_reference.default_text(fields["spool_dir"]) == "computed"
