"""A remote worker's token arrays reach the trainer only if they line up: the control plane validates a remote
worker's JSON as a Rollout (worker/results.py), and Tokens refuses a mask or logprobs of another length than the
ids, a mask value other than 0 and 1, a negative id or one past int32, and a logprob outside float32's range or
over 0. Before, those went on to the trainer as misaligned arrays."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.core.models import Rollout, RolloutStatus, Tokens
from orchestrator.rollout.runner import WorkItem
from orchestrator.worker import results
from orchestrator.worker.results import InvalidResultError, encode
from protos import worker_pb2 as wpb
from tests.orchestrator.core.test_token_arrays import GOOD
from tests.orchestrator.worker_wire import items
from tests.security.test_worker_results import _forged, _one

BAD: dict[str, tuple[dict[str, Any], str]] = {
    "a short mask": ({"completion_mask": [1, 0]}, "completion_mask has 2 entries for 3 completion_ids"),
    "long logprobs": ({"completion_logprobs": [-0.5] * 4}, "completion_logprobs has 4 entries for 3"),
    "a mask of 2": ({"completion_mask": [1, 2, 1]}, "completion_mask holds a value other than 0 and 1"),
    "a negative id": ({"completion_ids": [3, -4, 5]}, "completion_ids holds a negative token id"),
    # finite doubles past float32: the trainer's arrays got inf and -inf; a logprob is never positive either
    "a logprob past float32": ({"completion_logprobs": [1e300, 0.0, -1e39]}, "completion_logprobs holds a value"),
    "a positive logprob": ({"completion_logprobs": [-0.5, 5.0, 0.0]}, "completion_logprobs holds a value"),
}


@pytest.mark.parametrize(
    ("tokens", "why"),
    [
        # the forms a forger's JSON can carry that encode() above cannot make: NaN (min and max skip it), an id
        # past int32
        ({"completion_logprobs": [0.0, float("nan"), -0.5]}, "completion_logprobs holds a value"),
        ({"prompt_ids": [1, 2**31]}, "prompt_ids holds a token id over"),
    ],
)
def test_tokens_refuse_what_the_wire_cannot_carry(tokens: dict[str, Any], why: str) -> None:
    assert Tokens.model_validate(GOOD).status == "complete"
    with pytest.raises(ValueError, match=why):
        Tokens.model_validate(GOOD | tokens)
    with pytest.raises(ValueError, match=why):
        Tokens.model_validate_json(Tokens.model_construct(**(GOOD | tokens)).model_dump_json().replace("null", "NaN"))


def _with_tokens(rollout: Rollout, **tokens: Any) -> Rollout:
    # model_construct: the worker's side is the forger's, and builds what Tokens would refuse
    return rollout.model_copy(update={"tokens": Tokens.model_construct(**(GOOD | tokens))})


def _item_rollout(item: WorkItem) -> Rollout:
    return Rollout(
        id=item.id,
        job_id=item.job_id,
        env="python-tool@1",
        task_id=item.task.id,
        group_id=item.group_id,
        sample_index=item.sample_index,
        status=RolloutStatus.OK,
        reward=1.0,
    )


@pytest.mark.parametrize("case", list(BAD))
def test_a_remote_workers_misaligned_tokens_are_refused(case: str) -> None:
    update, why = BAD[case]
    (item,) = items("job-tokens", 1)
    good = encode("a-1", _with_tokens(_item_rollout(item)))
    assert results.decode(good, item, trusted=False)[0].id == item.id
    with pytest.raises(InvalidResultError, match=f"(?s)JSON form is invalid: .*{why}"):
        results.decode(encode("a-1", _with_tokens(_item_rollout(item), **update)), item, trusted=False)


async def test_a_remote_worker_that_sends_misaligned_tokens_delivers_no_reward() -> None:
    def answer(a: wpb.Assignment) -> wpb.RolloutResult:
        return _forged(a, tokens=Tokens.model_construct(**(GOOD | {"completion_mask": [1, 0]})))

    got = await _one("tcp", answer)
    assert isinstance(got, Rollout) and got.status == RolloutStatus.INFRA_ERROR and got.reward is None, got
    assert got.error is not None and "completion_mask has 2 entries for 3 completion_ids" in got.error.message
