"""Structured logs: one record per event, as JSON lines (services) or plain text (terminals).

Every record may carry an `event` name (`scheduler_died`, `request_aborted`, ...), a
`request_id` and other fields, passed through `log_event`. In JSON a record is exactly one
line, its traceback included (`"traceback"`), so journald keeps it as one entry. Text
output is for people at a terminal: one line, then the traceback's lines if there is one.

When stderr is the journal (`$JOURNAL_STREAM` names its device and inode, as systemd sets
it for a service), every line starts with its sd-daemon(3) priority (`<3>` error and
critical, `<4>` warning, `<6>` info, `<7>` debug) and text records have their newlines
escaped as `\\n`: journald makes one entry per line, so a record must be one line.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

LOG_FORMAT_ENV = "SPECD_LOG_FORMAT"  # the format of the process that started this one
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


class JournalFormatter(logging.Formatter):
    """Wraps a formatter for journald's stream: `<priority>` first, the record on one line."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return f"<{journal_priority(record.levelno)}>" + self.inner.format(record).replace(
            "\n", "\\n")


def journal_priority(levelno: int) -> int:
    """syslog priority of a logging level: 3 err, 4 warning, 6 info, 7 debug."""
    if levelno >= logging.ERROR:
        return 3
    if levelno >= logging.WARNING:
        return 4
    if levelno >= logging.INFO:
        return 6
    return 7


def stderr_is_journal() -> bool:
    """True when `$JOURNAL_STREAM` ("<device>:<inode>") is the file open as sys.stderr."""
    expected = os.environ.get("JOURNAL_STREAM")
    if not expected:
        return False
    try:
        stat = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):  # no file descriptor behind sys.stderr (closed, replaced)
        return False
    return expected == f"{stat.st_dev}:{stat.st_ino}"


def setup_logging(log_format: str, level: str) -> None:
    """Route every logger to stderr in `log_format` ("json" or "text") at `level`, with
    journald priorities when stderr is the journal. The format is also left in the
    environment ($SPECD_LOG_FORMAT), where the processes this one starts find it
    (`inherited_log_format`): a tensor-parallel rank writes to the same stderr, and its
    records read as rank 0's do."""
    if log_format not in ("json", "text"):
        raise ValueError(f"log format must be json or text, got {log_format!r}")
    os.environ[LOG_FORMAT_ENV] = log_format
    handler = logging.StreamHandler(sys.stderr)
    formatter: logging.Formatter = (JsonFormatter() if log_format == "json"
                                    else TextFormatter())
    if stderr_is_journal():
        formatter = JournalFormatter(formatter)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def inherited_log_format() -> str:
    """The log format of the process that started this one (`setup_logging` left it in
    the environment); JSON when none did."""
    return os.environ.get(LOG_FORMAT_ENV, "json")


def one_line(text: str, limit: int = 200) -> str:
    """`text` as one line of at most about `limit` characters, for status: whitespace
    (newlines included) collapsed, and a longer text cut at the end of a word, `...`
    marking the cut. A first word longer than `limit` is kept whole: never cut inside a
    word. The whole text belongs in the log record."""
    words = text.split()
    line = " ".join(words)
    if len(line) <= limit:
        return line
    kept = [words[0]]
    for word in words[1:]:
        if len(" ".join(kept)) + 1 + len(word) + 4 > limit:
            break
        kept.append(word)
    return " ".join(kept) + " ..."


def log_event(logger: logging.Logger, level: int, event: str, message: str,
              exc_info: Any = None, **fields: Any) -> None:
    """One record for one event: `event` and `fields` become structured fields."""
    logger.log(level, message, exc_info=exc_info, extra={"event": event, **fields})
