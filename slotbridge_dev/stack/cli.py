"""``slotbridge stack up|down|status|env``: the local stack from a shell.

Every failure is one line on stderr and exit code 1; a traceback would bury the one fact
the user needs (which part failed, where its log is).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import click
import psycopg

from services.common.logs import one_line
from slotbridge_dev.bootstrap import ROOT
from slotbridge_dev.stack.stack import Stack, StackError

P = ParamSpec("P")
R = TypeVar("R")

_dir_option = click.option(
    "--dir",
    "state_dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="SLOTBRIDGE_STACK_DIR",
    default=ROOT / ".stack",
    show_default=True,
    help="State folder (env SLOTBRIDGE_STACK_DIR).",
)


def _one_line_errors(func: Callable[P, R]) -> Callable[P, R]:
    @wraps(func)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return func(*args, **kwargs)
        except StackError as exc:
            click.echo(f"slotbridge stack: {exc}", err=True)
            sys.exit(1)
        except (OSError, psycopg.Error, subprocess.SubprocessError) as exc:
            # Not foreseen by the stack code, but still the environment's fault, not a bug.
            click.echo(f"slotbridge stack: {type(exc).__name__}: {one_line(exc)}", err=True)
            sys.exit(1)

    return wrapper


@click.group()
def stack() -> None:
    """Local PostgreSQL primary + standby + subscriber and a Kafka broker on 127.0.0.1."""


@stack.command()
@_dir_option
@click.option(
    "--pg",
    "pg_major",
    type=click.Choice(["17", "18"]),
    default=None,
    help="PostgreSQL major version: 17 for a new stack, else the recorded one; "
    "a different one than recorded is refused.",
)
@_one_line_errors
def up(state_dir: Path, pg_major: str | None) -> None:
    """Build or start every part; returns when all are ready."""
    # Stack(...).pg_major is the recorded version, or 17 when nothing is built yet.
    Stack(state_dir, pg_major or Stack(state_dir).pg_major).up()


@stack.command()
@_dir_option
@click.option("--purge", is_flag=True, help="Also delete the data, ports and state.")
@_one_line_errors
def down(state_dir: Path, purge: bool) -> None:
    """Stop every process of the stack (data kept unless --purge)."""
    Stack(state_dir).down(purge=purge)


@stack.command()
@_dir_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@_one_line_errors
def status(state_dir: Path, as_json: bool) -> None:
    """Each part's port and health, the standby's lag and synced slots (exit 1 if unhealthy)."""
    report = Stack(state_dir).status()
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        _print_status(report)
    sys.exit(0 if report["healthy"] else 1)


def _print_status(report: dict[str, Any]) -> None:
    click.echo(f"stack {report['state_dir']} (PostgreSQL {report['pg_major']})")
    for name, part in report["parts"].items():
        health = "healthy" if part["healthy"] else ("running" if part["running"] else "down")
        role = f" {part['role']}" if part.get("role") else ""
        click.echo(f"  {name:<11} port {part['port']:<6} {health}{role}  log {part['log']}")
        if "streaming" in part:
            click.echo(
                f"      streaming={part['streaming']} replay_lag_bytes={part['replay_lag_bytes']}"
            )
            for slot in part["synced_slots"]:
                click.echo(
                    f"      slot {slot['name']}: synced={slot['synced']} "
                    f"temporary={slot['temporary']} "
                    f"invalidation_reason={slot['invalidation_reason']}"
                )


@stack.command()
@_dir_option
@_one_line_errors
def env(state_dir: Path) -> None:
    """KEY=VALUE lines for `eval "$(slotbridge stack env)"`."""
    for key, value in Stack(state_dir).env().items():
        click.echo(f"{key}={shlex.quote(value)}")
