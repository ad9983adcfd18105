"""Tokens holds its per-token lists aligned: a mask and logprobs as long as the ids (or absent), a mask of 0 and 1,
ids of 0 or more. What the fleet's own TokenTracker produces passes; each way of breaking it is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from orchestrator.core.models import Tokens
from orchestrator.rollout.policy.base import Completion
from orchestrator.rollout.tokens import TokenTracker


def _c(prompt: list[int], completion: list[int]) -> Completion:
    logprobs = [-0.25 * (i + 1) for i in range(len(completion))]
    return Completion("", [], "stop", prompt, completion, logprobs, "m", {"role": "assistant", "content": ""})


def test_what_the_tracker_produces_holds_the_invariant() -> None:
    tracker = TokenTracker()
    # three turns; an observation between each (mask 0), and a token id 0 (a valid id: the vocabulary starts there)
    for c in (_c([1, 2], [0, 11]), _c([1, 2, 0, 11, 4, 5], [12]), _c([1, 2, 0, 11, 4, 5, 12, 6], [13, 14])):
        tracker.add(c)
    tokens = tracker.result()
    assert tokens.status == "complete"
    assert len(tokens.completion_ids) == len(tokens.completion_mask) == len(tokens.completion_logprobs) == 8
    # an observation token carries logprob 0.0, never a value of its own
    assert [lp for lp, m in zip(tokens.completion_logprobs, tokens.completion_mask, strict=True) if not m] == [0.0] * 3
    assert Tokens.model_validate_json(tokens.model_dump_json()) == tokens
    # a dropped episode holds no arrays at all
    assert TokenTracker().result() == Tokens(status="missing")


GOOD: dict[str, Any] = {
    "status": "complete",
    "prompt_ids": [1, 2],
    "completion_ids": [3, 4, 5],
    "completion_mask": [1, 0, 1],
    "completion_logprobs": [-0.5, 0.0, -0.25],
}


@pytest.mark.parametrize(
    ("update", "match"),
    [
        ({"completion_mask": [1, 0]}, "completion_mask has 2 entries for 3 completion_ids"),
        ({"completion_logprobs": [-0.5, 0.0, -0.25, -1.0]}, "completion_logprobs has 4 entries for 3 completion_ids"),
        ({"completion_ids": [], "completion_mask": [1]}, "completion_mask has 1 entries for 0 completion_ids"),
        ({"completion_mask": [1, 2, 1]}, "completion_mask holds a value other than 0 and 1"),
        ({"completion_mask": [1, -1, 1]}, "completion_mask holds a value other than 0 and 1"),
        ({"completion_ids": [3, -4, 5]}, "completion_ids holds a negative token id"),
        ({"prompt_ids": [-1]}, "prompt_ids holds a negative token id"),
    ],
)
def test_tokens_that_do_not_line_up_are_refused(update: dict[str, Any], match: str) -> None:
    Tokens(**GOOD)
    with pytest.raises(ValidationError, match=match):
        Tokens(**(GOOD | update))


def test_complete_tokens_carry_every_list_and_others_may_leave_one_out() -> None:
    # complete ids with no mask or logprobs gave the TRL adapter columns of unequal lengths; tokens of another status
    # are not trained on, and a list left empty there is one not given
    left_out: list[dict[str, Any]] = [{"completion_logprobs": []}, {"completion_mask": [], "completion_logprobs": []}]
    for gone in left_out:
        with pytest.raises(ValidationError, match="0 entries for 3 completion_ids"):
            Tokens(**(GOOD | gone))
        assert Tokens(**(GOOD | gone | {"status": "inconsistent"})).completion_ids == [3, 4, 5]
