"""The ``slotbridge`` command line: a thin shell that hands each verb to its service.

Subcommands load lazily so ``slotbridge stack up`` does not import Kafka or Spark, and a
broken optional part (say, no Java for Spark) cannot stop the others from starting.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys

import click

# verb -> "module:attribute" of a click command or group
_COMMANDS = {
    "run": "services.bridge.cli:run",
    "status": "services.bridge.cli:status",
    "snapshot": "services.bridge.cli:snapshot",
    "adopt-upgrade": "services.bridge.cli:adopt_upgrade",
    "resync": "services.bridge.cli:resync",
    "failover": "services.failover.cli:failover",
    "consume": "spark_consumers.cli:consume",
}
# Development tools: in a source checkout set up by its bootstrap, never in the wheel or
# the images (slotbridge_dev is not part of the distribution), so no product module
# imports them; the verbs appear only where they can run.
_DEV_PACKAGE = "slotbridge_dev"
_DEV_COMMANDS = {
    "stack": "slotbridge_dev.stack.cli:stack",
    "demo": "slotbridge_dev.demo:demo",
}


def _dev_tools() -> bool:
    return importlib.util.find_spec(_DEV_PACKAGE) is not None


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*_COMMANDS, *(_DEV_COMMANDS if _dev_tools() else ())])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
        if target is None and cmd_name in _DEV_COMMANDS:
            if not _dev_tools():
                raise click.UsageError(
                    f"'{cmd_name}' is a development tool: run it from a slotbridge source "
                    "checkout set up with `python3 -m slotbridge_dev.bootstrap`"
                )
            target = _DEV_COMMANDS[cmd_name]
        if target is None:
            return None
        module_name, attr = target.split(":")
        command = getattr(importlib.import_module(module_name), attr)
        assert isinstance(command, click.Command)
        return command


@click.group(cls=_LazyGroup)
@click.version_option(package_name="slotbridge")
def cli() -> None:
    """slotbridge: PostgreSQL 17+ logical decoding to Kafka, exactly once."""


def main() -> None:
    try:
        cli()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
