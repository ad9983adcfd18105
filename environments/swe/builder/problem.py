"""Problem statements from failing tests: their names and assertion messages, never the code that fixes them."""

from __future__ import annotations

import re
from collections.abc import Sequence

MAX_SHOWN = 3
MAX_LINES = 8
MAX_LINE_CHARS = 200


def pytest_failure(log: str, test: str) -> str:
    """The assertion lines (`E   ...`) of one failing pytest test, from `--tb=short` output, or its -rA message."""
    title = test.split("::", 1)[1].replace("::", ".") if "::" in test else test
    lines = log.splitlines()
    header = re.compile(rf"^_+ {re.escape(title)} _+$")
    for i, line in enumerate(lines):
        if header.match(line):
            found = []
            for body in lines[i + 1 :]:
                if re.match(r"^(_{3,} .* _{3,}|={3,}.*)$", body):
                    break
                if body.startswith("E ") and "Use -v to get" not in body:
                    found.append(body[1:].strip())
            if found:
                return "\n".join(_clip(x) for x in found[:MAX_LINES])
    for line in lines:
        if line.startswith(("FAILED ", "ERROR ")) and line.split(" ", 1)[1].startswith(test + " - "):
            return _clip(line.split(" - ", 1)[1])
    return ""


def unittest_failure(log: str, test: str) -> str:
    """The end of the traceback of one failing unittest test (the exception and its message)."""
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"^(FAIL|ERROR): {re.escape(test)}", line):
            block: list[str] = []
            for body in lines[i + 2 :]:
                if re.match(r"^(-{20,}|={20,})$", body):
                    break
                block.append(body)
            # the exception line and what follows it, not the traceback's code lines
            start = max((k for k, b in enumerate(block) if re.match(r"^\w[\w.]*(Error|Exception)\b", b)), default=0)
            shown = [b for b in block[start:] if b.strip()]
            return "\n".join(_clip(x) for x in shown[:MAX_LINES])
    return ""


_ADDRESS = re.compile(r"(0x|\.x)[0-9a-f]{6,}")


def _clip(line: str) -> str:
    line = _ADDRESS.sub(r"\1...", line)  # object addresses differ run to run
    return line if len(line) <= MAX_LINE_CHARS else line[: MAX_LINE_CHARS - 3] + "..."


def problem_statement(package: str, failing: Sequence[str], log: str, framework: str) -> str:
    """An issue-style report: what fails and how, in the project's own tests' words."""
    explain = pytest_failure if framework == "pytest" else unittest_failure
    n = len(failing)
    parts = [
        f"Something in `{package}` is broken: {n} of its tests that passed before now fail.",
        "",
        "Failing tests" + (" (a sample):" if n > MAX_SHOWN else ":"),
    ]
    for test in failing[:MAX_SHOWN]:
        parts.append(f"- `{test}`")
        detail = explain(log, test)
        if detail:
            parts += ["  ```", *(f"  {x}" for x in detail.splitlines()), "  ```"]
    parts += [
        "",
        "Please find the cause in the library code and fix it, so that these tests pass again. "
        "The tests themselves are correct and must not be changed.",
    ]
    return "\n".join(parts) + "\n"
