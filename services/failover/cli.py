"""``slotbridge failover check|watch|promote``: argument parsing and exit codes only.

Exit codes: 0 ready / done, 1 not ready / the runbook stopped, 2 unusable settings.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict
from pathlib import Path

import click

from services.common.httpserver import HttpServerError
from services.common.logs import setup_logging
from services.common.settings import SettingsError, load_settings
from services.failover.checks import Thresholds, evaluate
from services.failover.probe import probe_cluster
from services.failover.promote import PromoteError, Runbook, Step
from services.failover.report import render_json, render_report, render_steps, report_dict
from services.failover.settings import FailoverSettings
from services.failover.watch import Watcher

_config = click.option(
    "--config",
    "-c",
    "config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="SLOTBRIDGE_FAILOVER_CONFIG",
    default=None,
    help="settings file (YAML, or TOML by suffix); SLOTBRIDGE_* variables override it",
)
_section = click.option(
    "--section", default=None, help="read the settings from this top-level key of the file"
)


def _load(config: Path | None, section: str | None) -> FailoverSettings:
    try:
        return load_settings(FailoverSettings, config, section)
    except SettingsError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)


@click.group()
def failover() -> None:
    """Failover readiness, the watch daemon and the promote runbook."""


@failover.command()
@_config
@_section
@click.option("--standby", default=None, help="judge readiness for this standby only")
@click.option("--json", "as_json", is_flag=True, help="machine-readable report")
@click.option("--problems", is_flag=True, help="table: show only checks that are not OK")
def check(
    config: Path | None, section: str | None, standby: str | None, as_json: bool, problems: bool
) -> None:
    """One-shot readiness report; exit 0 only when ready for failover."""
    settings = _load(config, section)
    setup_logging(settings.log_format, "WARNING")
    if standby is not None and standby not in settings.standbys:
        click.echo(f"no standby named {standby!r} in the settings", err=True)
        sys.exit(2)
    report = evaluate(
        probe_cluster(settings),
        Thresholds(settings.max_slot_lag_bytes, settings.max_replay_lag_bytes),
    )
    data = report_dict(report, standby)
    click.echo(render_json(data) if as_json else render_report(report, standby, not problems))
    sys.exit(0 if data["ready"] else 1)


@failover.command()
@_config
@_section
def watch(config: Path | None, section: str | None) -> None:
    """Run the checks on a timer; metrics, health, remedies, promotion handling."""
    settings = _load(config, section)
    setup_logging(settings.log_format, settings.log_level)
    logging.getLogger("slotbridge.failover").info("watch starting")
    try:
        Watcher(settings).run()
    except HttpServerError as exc:
        click.echo(f"slotbridge: {exc}", err=True)
        sys.exit(2)


@failover.command()
@_config
@_section
@click.option("--standby", required=True, help="the standby to promote")
@click.option("--force", is_flag=True, help="promote even if checks fail (lists them)")
@click.option("--dry-run", is_flag=True, help="print the plan; change nothing")
@click.option("--json", "as_json", is_flag=True, help="machine-readable steps and summary")
def promote(
    config: Path | None,
    section: str | None,
    standby: str,
    force: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Promote STANDBY and move every subscriber to it; safe to re-run after a failure."""
    settings = _load(config, section)
    setup_logging(settings.log_format, settings.log_level)

    def show(step: Step) -> None:
        if not as_json:
            click.echo(f"[{step.seconds:6.2f}s] {step.step:<17} {step.result:<7} {step.detail}")

    try:
        runbook = Runbook(settings, standby, force=force, dry_run=dry_run, emit=show)
    except PromoteError as exc:
        click.echo(str(exc), err=True)
        sys.exit(2)
    result = runbook.run()
    steps = [asdict(s) for s in result.steps]
    if as_json:
        click.echo(render_json({"steps": steps, "summary": result.summary()}))
    else:
        click.echo("")
        click.echo(render_steps(steps, result.summary()))
    sys.exit(0 if result.ok else 1)
