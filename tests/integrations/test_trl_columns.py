"""The TRL adapter's columns for a scored sample that kept no completion: a first generation cut at its length or
deadline (TRUNCATED, tokens "missing") failed the whole GRPO step with an error about tokenizers, and a "complete"
rollout with no ids gave columns of lengths 1, 1 and 0. Both are now one masked pad token, their reward kept. Runs
without TRL installed: integrations.trl imports none of it."""

from __future__ import annotations

import pytest

from integrations.trl import REWARD_KEY, TOKEN_STATUS_KEY, group_columns
from orchestrator.client.sdk import GroupResult
from orchestrator.core.models import Rollout, RolloutStatus, Tokens
from orchestrator.rollout.tokens import TokenTracker

PAD = 9
OK = Tokens(
    status="complete",
    prompt_ids=[1, 2],
    completion_ids=[3, 4, 5],
    completion_mask=[1, 0, 1],
    completion_logprobs=[-0.5, 0.0, -0.25],
)


def _rollout(i: int, status: RolloutStatus, tokens: Tokens, reward: float | None = 0.5) -> Rollout:
    return Rollout(
        id=f"j:t:{i}",
        job_id="j",
        env="python-tool@1",
        task_id="t",
        group_id="j:t",
        sample_index=i,
        status=status,
        reward=reward if status.scored else None,
        tokens=tokens,
    )


def _group(*rollouts: Rollout) -> GroupResult:
    return GroupResult("j:t", "t", list(rollouts), [0.0] * len(rollouts), 0)


@pytest.mark.parametrize(
    "tokens",
    [
        TokenTracker().result(),  # the episode kept no turn: its first generation was cut
        Tokens(status="complete", prompt_ids=[1, 2]),  # complete, and no completion in it
    ],
    ids=["missing", "complete-empty"],
)
def test_a_scored_sample_without_a_completion_is_one_masked_pad_token(tokens: Tokens) -> None:
    group = _group(_rollout(0, RolloutStatus.OK, OK, 1.0), _rollout(1, RolloutStatus.TRUNCATED, tokens))
    cols = group_columns(group, PAD)
    assert cols["prompt_ids"] == [[1, 2], [1, 2]]
    assert cols["completion_ids"] == [[3, 4, 5], [PAD]]
    assert cols["logprobs"] == [[-0.5, 0.0, -0.25], [0.0]] and cols["env_mask"] == [[1, 0, 1], [0]]
    for c, lp, m in zip(cols["completion_ids"], cols["logprobs"], cols["env_mask"], strict=True):
        assert len(c) == len(lp) == len(m)
    assert cols[REWARD_KEY] == [1.0, 0.5]  # scored: its reward stays in the group's baseline
    assert cols[TOKEN_STATUS_KEY][1] == tokens.status
    with pytest.raises(ValueError, match="rollout j:t:1 kept no completion: group_columns needs a pad_id"):
        group_columns(group)


def test_a_group_with_no_ids_from_its_server_is_still_refused() -> None:
    # every sample scored and every one "missing": the server returned no ids, the setup's fault, never padded
    missing = Tokens(status="missing")
    group = _group(_rollout(0, RolloutStatus.OK, missing), _rollout(1, RolloutStatus.OK, missing))
    with pytest.raises(RuntimeError, match=r"nothing to train on\. GRPOTrainer needs exact ids\. Give the policy a"):
        group_columns(group, pad_id=PAD)
    inconsistent = Tokens(status="inconsistent")
    with pytest.raises(RuntimeError, match="j:t:1 has inconsistent tokens: GRPOTrainer needs exact ids"):
        group_columns(_group(_rollout(0, RolloutStatus.OK, OK), _rollout(1, RolloutStatus.OK, inconsistent)), PAD)
