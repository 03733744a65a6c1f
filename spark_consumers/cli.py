"""``slotbridge consume``: run the Spark consumer job locally (or print its status)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from services.common.httpserver import HttpServerError
from services.common.kafka import KafkaUnreachable
from services.common.logs import setup_logging
from services.common.settings import SettingsError, load_settings
from spark_consumers.preflight import check_kafka
from spark_consumers.settings import ConsumerSettings


@click.command()
@click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="YAML or TOML settings file (SLOTBRIDGE_* variables override it).",
)
@click.option(
    "--once", is_flag=True, help="Consume what Kafka holds now, then stop (availableNow trigger)."
)
@click.option(
    "--fail-on-quarantine",
    is_flag=True,
    help="Exit 3 after a clean end that sent records to the dead-letter table.",
)
@click.option(
    "--print-spark-submit",
    "print_submit",
    is_flag=True,
    help="Print the spark-submit command that runs this job, and exit.",
)
@click.option("--status", "show_status", is_flag=True, help="Print the job's status file and exit.")
def consume(
    config: Path | None, once: bool, fail_on_quarantine: bool, print_submit: bool, show_status: bool
) -> None:
    """Stream the change topics into current-state and history Delta tables."""
    try:
        settings = load_settings(ConsumerSettings, config)
    except SettingsError as exc:
        raise click.ClickException(str(exc)) from None
    if show_status:
        if settings.status_path is None or not settings.status_path.exists():
            raise click.ClickException("no status file (set status_path; is the job running?)")
        click.echo(json.dumps(json.loads(settings.status_path.read_text()), indent=2))
        return
    if print_submit:
        # Spark is imported only now: --status and settings errors need no JVM.
        from spark_consumers.job import spark_submit_command

        click.echo(shlex.join(spark_submit_command(settings, config, once)))
        return
    try:
        check_kafka(settings)
    except KafkaUnreachable as exc:
        raise click.ClickException(str(exc)) from None
    setup_logging(settings.log_format, settings.log_level)
    if settings.spark_master is None:
        settings = settings.model_copy(update={"spark_master": "local[2]"})
    if settings.jars_dir is None:
        raise click.ClickException(
            "jars_dir is not set: local mode needs a folder with the Kafka source and Delta "
            "jars (set jars_dir or SLOTBRIDGE_JARS_DIR; in a checkout `slotbridge stack env` "
            "prints it), or run the job with spark-submit (--print-spark-submit)"
        )
    # Spark is imported only now: --status and settings errors need no JVM.
    from spark_consumers.job import run

    try:
        code = run(settings, once=once, fail_on_quarantine=fail_on_quarantine)
    except HttpServerError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)
