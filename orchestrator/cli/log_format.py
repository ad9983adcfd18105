"""How the command line logs: `-v` for the level, `--log-format text|json`; json is one object per line (time,
level, logger, message, exception, and any `extra=` fields) for an operator's log collector."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

from orchestrator.core.log_text import TextFormatter

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# attributes every LogRecord has; anything else on a record came from `extra=` and goes into the JSON object
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        """The record as a JSON line."""
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in entry:
                entry[key] = value
        return json.dumps(entry, default=str, ensure_ascii=False)


def add_log_format_argument(p: argparse.ArgumentParser) -> None:
    """`--log-format`, for every command."""
    p.add_argument(
        "--log-format", choices=LOG_FORMATS, default="text", help="log lines on stderr as text or JSON objects"
    )


def configure_logging(verbose: int, log_format: str = "text") -> None:
    """The root logger for a command: WARNING, INFO with -v, DEBUG with -vv, on stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(TEXT_FORMAT))
    logging.basicConfig(level=logging.WARNING - 10 * min(verbose, 2), handlers=[handler], force=True)
