"""The ``slotbridge`` command line: a thin shell that hands each verb to its service.

Subcommands load lazily so ``slotbridge stack up`` does not import Kafka or Spark, and a
broken optional part (say, no Java for Spark) cannot stop the others from starting.
"""

from __future__ import annotations

import importlib
import sys

import click

# verb -> "module:attribute" of a click command or group
_COMMANDS = {
    "stack": "services.stack.cli:stack",
    "run": "services.bridge.cli:run",
    "status": "services.bridge.cli:status",
    "snapshot": "services.bridge.cli:snapshot",
    "failover": "services.failover.cli:failover",
    "consume": "spark_consumers.cli:consume",
    "demo": "services.demo:demo",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = _COMMANDS.get(cmd_name)
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
