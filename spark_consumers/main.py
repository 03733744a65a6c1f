"""spark-submit entry: ``spark-submit [--jars ...] spark_consumers/main.py CONFIG [--once]``.

On a cluster spark-submit decides the master and ships the jars, so this entry leaves
``spark_master`` as configured (usually unset) instead of defaulting to local mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

from services.common.kafka import KafkaUnreachable
from services.common.logs import setup_logging
from services.common.settings import SettingsError, load_settings
from spark_consumers.job import run
from spark_consumers.preflight import check_kafka
from spark_consumers.settings import ConsumerSettings


def main(argv: list[str]) -> int:
    flags = ("--once", "--fail-on-quarantine")
    args = [a for a in argv if a not in flags]
    if len(args) > 1:
        print("usage: main.py [CONFIG] [--once] [--fail-on-quarantine]", file=sys.stderr)
        return 2
    try:
        settings = load_settings(ConsumerSettings, Path(args[0]) if args else None)
    except SettingsError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        check_kafka(settings)
    except KafkaUnreachable as exc:
        print(exc, file=sys.stderr)
        return 1
    setup_logging(settings.log_format, settings.log_level)
    return run(settings, once="--once" in argv, fail_on_quarantine="--fail-on-quarantine" in argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
