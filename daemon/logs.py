"""Structured logs: one record per event, as JSON lines (services) or plain text (terminals).

Every record may carry an `event` name (`scheduler_died`, `request_aborted`, ...), a
`request_id` and other fields, passed through `log_event`. In JSON a record is exactly one
line, its traceback included (`"traceback"`), so journald keeps it as one entry. Text
output is for people at a terminal: one line, then the traceback's lines if there is one.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD_ATTRS}


class JsonFormatter(logging.Formatter):
    """`{"ts", "level", "logger", "pid", "msg", <fields>, "traceback"?}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "pid": record.process,
            "msg": record.getMessage(),
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["traceback"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["traceback"] = record.exc_text
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`HH:MM:SS.mmm level logger: msg key=value ...` then the traceback, if any."""

    def format(self, record: logging.LogRecord) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        line = (f"{clock}.{int(record.msecs):03d} {record.levelname.lower():7s} "
                f"{record.name}: {record.getMessage()}" + (f"  [{extra}]" if extra else ""))
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.exc_text:
            line += "\n" + record.exc_text
        return line


def setup_logging(log_format: str, level: str) -> None:
    """Route every logger to stderr in `log_format` ("json" or "text") at `level`."""
    if log_format not in ("json", "text"):
        raise ValueError(f"log format must be json or text, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def log_event(logger: logging.Logger, level: int, event: str, message: str,
              exc_info: Any = None, **fields: Any) -> None:
    """One record for one event: `event` and `fields` become structured fields."""
    logger.log(level, message, exc_info=exc_info, extra={"event": event, **fields})
