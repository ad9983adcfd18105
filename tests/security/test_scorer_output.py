"""What a declarative environment's scoring command prints is read as its verdict only when it is whole and a finite
number. A scorer that runs the policy's code and lets its stderr through gave the policy the last line: its code
printed a reward line, then flooded stderr past the output cap, and the line the scorer printed after was cut while
the policy's stayed. A 400-digit number in a component (a scorer that echoes `int(answer)`) raised OverflowError,
and the policy's 0 became an ENV_ERROR."""

from __future__ import annotations

import pytest

from orchestrator.core.sandbox import ExecResult
from orchestrator.service.declarative.env import MAX_SCORING_OUTPUT, parse_score
from orchestrator.service.declarative.errors import ScoringError


def test_a_scorers_output_cut_at_the_cap_is_no_verdict() -> None:
    flooded = ExecResult(0, b'{"reward": 1}\n', b"x" * MAX_SCORING_OUTPUT, truncated=True)
    with pytest.raises(ScoringError, match="its last line was lost"):
        parse_score(flooded, 10)
    whole = ExecResult(0, b'{"reward": 1}\n', b"x" * 1000)
    assert parse_score(whole, 10).reward == 1.0


def test_a_number_past_a_floats_range_is_no_error_in_a_component_and_no_reward() -> None:
    huge = "1" + "0" * 400
    score = parse_score(ExecResult(0, f'{{"reward": 0, "parsed": {huge}, "ok": 2}}\n'.encode(), b""), 10)
    assert (score.reward, score.components) == (0.0, {"ok": 2.0})
    with pytest.raises(ScoringError, match='finite numeric "reward"'):
        parse_score(ExecResult(0, f'{{"reward": {huge}}}\n'.encode(), b""), 10)


def test_more_components_than_a_score_keeps_leave_the_reward_standing() -> None:
    # Score refuses more than 256 components (ValueError: ENV_ERROR, masked): a policy's program the scorer runs
    # could print them, and trade its 0 for no signal
    import json

    from orchestrator.core.environment import MAX_SCORE_NAMES

    line = json.dumps({"reward": 0, **{f"k{i}": 1 for i in range(MAX_SCORE_NAMES + 1)}}) + "\n"
    score = parse_score(ExecResult(0, line.encode(), b""), 10)
    assert (score.reward, score.components) == (0.0, {})
    # a reward past what a Score takes: a failed scoring (0 on the policy's answer), not a ValueError
    with pytest.raises(ScoringError, match=r"a reward of 1e\+300, past"):
        parse_score(ExecResult(0, b'{"reward": 1e300}\n', b""), 10)


async def test_a_shell_that_fails_in_time_says_the_host_keeps_time() -> None:
    # the policy, as root, broke /bin/sh: the probe's nonzero exit was read as a slow host (INFRA_ERROR, retried and
    # masked), a way out of a 0 the policy could choose. Only a probe past its time is the host's
    from orchestrator.core.errors import SandboxUnavailableError
    from orchestrator.core.sandbox import keeps_time

    class Sandbox:
        def __init__(self, result: ExecResult) -> None:
            self.result = result

        async def exec(self, *a: object, **kw: object) -> ExecResult:
            return self.result

    await keeps_time(Sandbox(ExecResult(127, b"", b"/bin/sh: not found")), "the verifier failed")  # type: ignore[arg-type]
    with pytest.raises(SandboxUnavailableError, match="the host, not the policy, is slow"):
        await keeps_time(Sandbox(ExecResult(-9, b"", b"", timed_out=True)), "the verifier failed")  # type: ignore[arg-type]


def test_a_true_or_false_component_counts_as_1_or_0() -> None:
    # a grader's {"reward": 1, "passed": true} lost its component: only numbers were kept
    score = parse_score(ExecResult(0, b'{"reward": 1, "passed": true, "lint": false, "note": "x"}\n', b""), 10)
    assert score.components == {"passed": 1.0, "lint": 0.0}
    assert parse_score(ExecResult(0, b'{"reward": true}\n', b""), 10).reward == 1.0  # the reward alike
