"""A sandbox's text in the control plane's log stays inside its own line: control characters in a message (a scoring
command's output, a grader's tail) are escaped in the text format, as the JSON format escapes them."""

from __future__ import annotations

import logging

import pytest

from orchestrator.cli.log_format import configure_logging
from orchestrator.worker.__main__ import configure_logging as worker_logging

FORGED = "junk\r\n2099-01-01 00:00:00,000 ERROR orchestrator.server: forged line\x1b[2J"


@pytest.mark.parametrize("process", ["control plane", "worker"])
def test_a_policys_output_cannot_write_a_log_line_of_its_own(process: str, capsys: pytest.CaptureFixture[str]) -> None:
    # a local worker runs the scoring, and its stderr is the control plane's
    if process == "worker":
        worker_logging("w0", 1)
    else:
        configure_logging(1, "text")
    try:
        logging.getLogger("orchestrator.service.declarative.env").info(
            "%s: the scoring command failed on the policy's answer (%s); scored 0", "task-1", FORGED
        )
    finally:
        configure_logging(0, "text")
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\r" not in err and "\x1b" not in err, repr(err)
    assert "junk\\x0d\\x0a2099-01-01" in err and "forged line\\x1b[2J); scored 0" in err


@pytest.mark.parametrize("process", ["control plane", "worker"])
def test_an_exceptions_message_cannot_write_a_log_line_of_its_own(
    process: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # the traceback's last line is the exception's message, appended raw: a plug-in's or a library's exception that
    # carried a sandbox's text wrote a forged record and a raw escape after the real one
    if process == "worker":
        worker_logging("w0", 1)
    else:
        configure_logging(1, "text")
    try:
        try:
            raise ValueError(FORGED)
        except ValueError:
            logging.getLogger("orchestrator.rollout.step").warning("an environment failed", exc_info=True)
        logging.getLogger("orchestrator.rollout.step").warning("here", stack_info=True)
    finally:
        configure_logging(0, "text")
    lines = capsys.readouterr().err.splitlines()
    records = [line for line in lines if not line.startswith("  ")]
    assert len(records) == 2 and "an environment failed" in records[0] and "here" in records[1], lines
    assert not any("\x1b" in line or "\r" in line for line in lines), lines
    assert (
        "  ValueError: junk\\x0d" in lines
        and "  2099-01-01 00:00:00,000 ERROR orchestrator.server: forged line\\x1b[2J" in lines
    )
