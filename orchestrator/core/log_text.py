"""Log lines in text: a record's message on one line of its own."""

from __future__ import annotations

import logging
import re

# every control character but tab: a line or an escape sequence a sandbox's output put in a message (a scoring
# command's, a grader's tail) wrote a forged log line of its own, or cleared the operator's terminal
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class TextFormatter(logging.Formatter):
    """TEXT_FORMAT, a record's message on one line: its control characters escaped (the exception's traceback
    follows on lines of its own, as ever)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", record.message)
        return super().formatMessage(record)
