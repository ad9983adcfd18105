"""Log lines in text: a record's message on one line of its own."""

from __future__ import annotations

import logging
import re
from typing import Any

# every control character but tab: a line or an escape sequence a sandbox's output put in a message (a scoring
# command's, a grader's tail) wrote a forged log line of its own, or cleared the operator's terminal
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_NOT_NEWLINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # in a traceback, whose lines are its own


def _escaped(text: str, pattern: re.Pattern[str]) -> str:
    return pattern.sub(lambda m: f"\\x{ord(m[0]):02x}", text)


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, a record's message on one line: its control characters escaped. An exception's traceback follows
    on lines of its own, each indented: its last line is the exception's message, which a plug-in's or a library's
    exception may carry from a sandbox (a line of its own that read as a log record, an escape that cleared the
    terminal), so no line of it starts where a record does."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _escaped(record.message, _CONTROL)
        return super().formatMessage(record)

    def formatException(self, ei: Any) -> str:
        return _indented(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _indented(super().formatStack(stack_info))


def _indented(text: str) -> str:
    return "\n".join(f"  {line}" for line in _escaped(text, _NOT_NEWLINE).split("\n"))
