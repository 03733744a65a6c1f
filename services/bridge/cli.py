"""``slotbridge run`` (the daemon) and ``slotbridge status`` (what an operator asks first)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from services.bridge.settings import BridgeSettings
from services.common.pg import SourceError
from services.common.settings import SettingsError, load_settings

_config_option = click.option(
    "--config", "config", type=click.Path(dir_okay=False, path_type=Path), default=None,
    envvar="SLOTBRIDGE_CONFIG", help="YAML or TOML settings file (env SLOTBRIDGE_CONFIG); "
    "SLOTBRIDGE_* environment variables override it.")


def _settings(config: Path | None) -> BridgeSettings:
    try:
        return load_settings(BridgeSettings, config)
    except SettingsError as exc:
        click.echo(f"slotbridge: {exc}", err=True)
        sys.exit(2)


@click.command()
@_config_option
def run(config: Path | None) -> None:
    """Stream the slot into Kafka until SIGTERM."""
    settings = _settings(config)
    from services.bridge.daemon import Bridge
    from services.common.logs import setup_logging

    setup_logging(settings.log_format, settings.log_level)
    sys.exit(Bridge(settings).run())


@click.command()
@_config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def status(config: Path | None, as_json: bool) -> None:
    """Slot, origin and Kafka progress of this bridge, and the slot's decoding counters."""
    settings = _settings(config)
    from services.bridge.status import collect

    try:
        report = collect(settings)
    except SourceError as exc:
        click.echo(f"slotbridge: {exc}", err=True)
        sys.exit(1)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    _print_table(report)


def _print_table(report: dict[str, Any]) -> None:
    snapshot = report.pop("snapshot", {})
    width = max(len(k) for k in report)
    for key, value in report.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}={v}" for k, v in value.items()) or "-"
        click.echo(f"{key:<{width}}  {value if value is not None else '-'}")
    if isinstance(snapshot, str) or not snapshot:
        click.echo(f"{'snapshot':<{width}}  {snapshot or 'none taken by this daemon'}")
        return
    for table, entry in snapshot.items():
        estimate = entry["rows_estimated"]
        click.echo(f"{'snapshot':<{width}}  {table}: {entry['state']}, {entry['rows_done']:,} of "
                   f"{f'~{estimate:,}' if estimate is not None else 'unknown'} rows, "
                   f"as of {entry['lsn']}")
