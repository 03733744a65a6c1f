"""Structured logging: one JSON object per line (or plain text for humans at a terminal).

Callers pass context as ``extra={"fields": {...}}`` or through ``log_event``; the JSON
formatter puts those keys at the top level so log pipelines can index them.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from confluent_kafka import KafkaException

from services.common.errors import self_explanatory
from services.common.kafka import explain


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = f"{self.formatTime(record, '%H:%M:%S')} {record.levelname:<7} {record.getMessage()}"
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict) and fields:
            base += " " + " ".join(f"{k}={v}" for k, v in fields.items())
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


def setup_logging(fmt: str = "json", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # librdkafka's chatter is not the operator's business at INFO; at DEBUG it is: the
    # debug contexts an operator turns on through kafka_config's "debug" log at DEBUG.
    chatter = logging.DEBUG if root.level <= logging.DEBUG else logging.WARNING
    logging.getLogger("kafka").setLevel(chatter)


def log_event(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    logger.log(level, msg, extra={"fields": fields})


def one_line(exc: BaseException) -> str:
    """The first line of an error's text (drivers append hints and context lines), or its
    type when it has no text: what a log field or a status line should carry."""
    if isinstance(exc, KafkaException):
        return explain(exc)  # its str() is the KafkaError{code=...,val=...} repr
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def log_failure(logger: logging.Logger, exc: BaseException) -> None:
    """An error that ends the work, as the ERROR line operators read (``one_line``, the
    error's type in ``error``), with the traceback when the exception is a bug rather than
    one of ours or an outage (``self_explanatory``)."""
    logger.error(
        one_line(exc),
        exc_info=None if self_explanatory(exc) else exc,
        extra={"fields": {"error": type(exc).__name__}},
    )
