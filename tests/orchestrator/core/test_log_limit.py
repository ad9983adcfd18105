"""LogLimit: a line a key a period, and the next one says how many were held back."""

from __future__ import annotations

from orchestrator.core import log_limit
from orchestrator.core.log_limit import LogLimit


def test_one_line_a_key_a_period_then_the_count_held_back() -> None:
    now = [0.0]
    said = LogLimit(60.0, clock=lambda: now[0])
    assert said.allow("a") == ""
    assert [said.allow("a") for _ in range(3)] == [None, None, None]
    assert said.allow("b") == ""  # keys are apart
    now[0] = 59.9
    assert said.allow("a") is None
    now[0] = 61.0
    assert said.allow("a") == " (4 more like it in the last 61 s)"
    now[0] = 200.0
    assert said.allow("a") == ""  # none held back since the last line


def test_keys_are_bounded_the_least_recently_logged_forgotten() -> None:
    now = [0.0]
    said = LogLimit(60.0, clock=lambda: now[0])
    for i in range(log_limit.MAX_KEYS + 10):
        assert said.allow(i) == ""
    assert len(said._keys) == log_limit.MAX_KEYS
    assert said.allow(0) == ""  # forgotten: logs again
    assert said.allow(log_limit.MAX_KEYS + 9) is None  # remembered
