"""``slotbridge run`` (the daemon), ``slotbridge status`` (what an operator asks first), and
the operator's one-off commands on a bridge's slot (``snapshot``, ``adopt-upgrade``)."""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from services.bridge.settings import BridgeSettings
from services.common.pg import SourceError
from services.common.settings import SettingsError, load_settings
from services.contract.records import EndedSnapshot

T = TypeVar("T")

_config_option = click.option(
    "--config",
    "config",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    envvar="SLOTBRIDGE_CONFIG",
    help="YAML or TOML settings file (env SLOTBRIDGE_CONFIG); "
    "SLOTBRIDGE_* environment variables override it.",
)


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
    from services.common.allocator import fix_mmap_threshold
    from services.common.collector import freeze_startup_objects, space_out_collections

    # First, before the daemon's first large blocks: see services.common.allocator.
    fix_mmap_threshold()
    space_out_collections()  # the collector took a tenth of an OLTP backlog's CPU: see there
    settings = _settings(config)
    from services.bridge.daemon import Bridge
    from services.common.logs import setup_logging

    setup_logging(settings.log_format, settings.log_level)
    freeze_startup_objects()  # what full collections walked most: see there
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


@click.command()
@_config_option
@click.argument("table", required=False)
@click.option("--where", default=None, help="Only the rows matching this SQL condition.")
@click.option(
    "--cancel",
    "cancel",
    default=None,
    metavar="ID|TABLE",
    help="Cancel the snapshot of a request id or a table instead.",
)
@click.option("--wait/--no-wait", default=True, help="Follow it until Kafka holds it all.")
@click.option(
    "--timeout",
    "timeout_s",
    type=float,
    default=0.0,
    help="Give up waiting after this many seconds (0: never).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def snapshot(
    config: Path | None,
    table: str | None,
    where: str | None,
    cancel: str | None,
    wait: bool,
    timeout_s: float,
    as_json: bool,
) -> None:
    """Snapshot TABLE again (or the rows matching --where) while the bridge streams."""
    settings = _settings(config)
    from services.bridge.progress.kafka_reader import TopicReadError
    from services.bridge.snapshot import ondemand

    try:
        if cancel is not None:
            ondemand.cancel_snapshot(settings, cancel)
            click.echo(json.dumps({"cancelled": cancel}) if as_json else f"cancel of {cancel} sent")
            return
        if table is None:
            raise click.UsageError("name a TABLE (or --cancel ID|TABLE)")
        request, lsn = ondemand.request_snapshot(settings, table, where)
        if not as_json:
            click.echo(
                f"snapshot request {request} sent for {table}"
                + (f" where {where}" if where else "")
            )
        progress = (
            None
            if not wait
            else ondemand.wait_for(
                settings,
                request,
                lsn,
                timeout_s,
                lambda entry: (
                    None
                    if as_json
                    else click.echo(
                        f"  {entry.rows:,} rows in {entry.chunks} chunks"
                        if entry is not None
                        else "  waiting for the bridge to reach the request",
                        err=True,
                    )
                ),
            )
        )
    except (SourceError, TopicReadError) as exc:
        click.echo(f"slotbridge: {exc}", err=True)
        sys.exit(1)
    report: dict[str, Any] = {"request": request, "table": table, "where": where}
    if not wait:
        if as_json:
            click.echo(json.dumps(report))
        return
    if progress is None:
        code, line = 3, f"still running after {timeout_s:.0f}s"
        report["finished"] = False
    else:
        ended = ondemand.ended_entry(progress, request)
        code, line = _snapshot_outcome(ended)
        report["finished"] = True
        if ended is not None:
            report.update(outcome=ended.outcome, reason=ended.reason, rows=ended.rows)
            report.update(chunks=ended.chunks)
    if as_json:
        click.echo(json.dumps(report))
    else:
        click.echo(line, err=code == 1)
    sys.exit(code)


def _snapshot_outcome(ended: EndedSnapshot | None) -> tuple[int, str]:
    """Exit code and line for a request that ended, from what the progress record says."""
    if ended is None:
        return 0, "published (the progress record no longer holds its row count)"
    done = f"{ended.rows:,} rows in {ended.chunks} chunks"
    if ended.outcome == "done":
        return 0, f"published: {done}"
    if ended.outcome == "cancelled":
        return 1, f"slotbridge: snapshot request {ended.id} was cancelled after {done}"
    return 1, f"slotbridge: snapshot request {ended.id} failed after {done}: {ended.reason}"


@click.command("adopt-upgrade")
@_config_option
@click.option(
    "--from-system",
    "from_system",
    required=True,
    metavar="ID",
    help="System identifier of the cluster before pg_upgrade (the bridge's refusal and "
    "`slotbridge status` name it).",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def adopt_upgrade(config: Path | None, from_system: str, as_json: bool) -> None:
    """Resume the slot on its source after a major-version pg_upgrade (run once, bridge stopped)."""
    from services.bridge.upgrade import adopt_upgraded_source

    adopted = _or_exit(lambda: adopt_upgraded_source(_settings(config), from_system))
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(adopted)))
    elif adopted.changed:
        click.echo(
            f"slot {adopted.slot}: progress up to {adopted.end_lsn} now belongs to system "
            f"{adopted.system} (timeline {adopted.timeline}), the upgrade of system "
            f"{adopted.previous_system}; start the bridge"
        )
    else:
        click.echo(
            f"slot {adopted.slot}: its progress already belongs to this server's system "
            f"{adopted.system}; nothing to do"
        )


@click.command()
@_config_option
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def resync(config: Path | None, as_json: bool) -> None:
    """Start an invalidated slot over: every published table snapshotted again into the
    same topics, the gap recorded (run once, bridge stopped)."""
    from services.bridge.resync import resync as start_over

    done = _or_exit(lambda: start_over(_settings(config)))
    if as_json:
        click.echo(json.dumps(dataclasses.asdict(done)))
    else:
        click.echo(
            f"slot {done.slot}: the changes after {done.after_lsn} are lost ({done.reason}); "
            f"recorded, and {len(done.tables)} tables will be snapshotted again "
            "into the same topics: start the bridge"
        )


def _or_exit(command: Callable[[], T]) -> T:
    """What ``command`` returns, or its refusal as one line and exit 1."""
    from services.common.errors import SlotbridgeError

    try:
        return command()
    except SlotbridgeError as exc:
        click.echo(f"slotbridge: {exc}", err=True)
        sys.exit(1)


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
        eta = f", ETA {entry['eta_s']}s" if entry.get("eta_s") is not None else ""
        click.echo(
            f"{'snapshot':<{width}}  {table}: {entry['state']}, {entry['rows_done']:,} "
            # PostgreSQL estimates a table's rows only once it was analysed (reltuples -1).
            f"{f'of ~{estimate:,} ' if estimate is not None else ''}rows in "
            f"{entry['chunks_done']} chunks, {entry['rows_per_s']:,} rows/s{eta}"
            f"{'' if estimate is not None else ' (no estimate: table not analysed)'}"
        )
