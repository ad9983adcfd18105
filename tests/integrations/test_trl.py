"""The TRL adapter: prompts to groups and back in order, failed samples masked, and one real GRPOTrainer step on a
2-layer Qwen2 from a config, against a real orchestrator and the scripted policy."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from integrations.trl import REWARD_KEY, STATUS_KEY, EnvfleetRollout, envfleet_reward, group_columns, rounds, runs
from orchestrator.client.sdk import GroupResult
from orchestrator.core.models import Rollout, RolloutStatus, Tokens
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.server.app import Orchestrator
from orchestrator.testing.scripted_policy import ScriptedServer
from tests.integrations.conftest import ENV, require


def _rollout(i: int, status: RolloutStatus, tokens: Tokens | None = None) -> Rollout:
    return Rollout(
        id=f"j:t:{i}",
        job_id="j",
        env=ENV,
        task_id="t",
        group_id="j:t",
        sample_index=i,
        status=status,
        reward=1.0 if status.scored else None,
        tokens=tokens or Tokens(),
    )


def test_prompts_become_groups_and_rounds() -> None:
    assert runs(["a", "a", "b", "b"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="not one task repeated"):
        runs(["a", "b", "b", "b"], 2)
    with pytest.raises(ValueError, match="not whole groups of num_generations=2"):
        runs(["a", "a", "b"], 2)
    # a task twice in one batch goes to a second job: rollout ids are job:task:sample
    assert rounds(["a", "b", "a", "c", "a"]) == [["a", "b", "c"], ["a"], ["a"]]


def test_a_failed_sample_is_masked_never_scored_zero() -> None:
    ok = Tokens(
        status="complete",
        prompt_ids=[1, 2],
        completion_ids=[3, 4, 5],
        completion_mask=[1, 0, 1],
        completion_logprobs=[-0.5, 0.0, -0.25],
    )
    # out of order on purpose: columns come in sample order
    group = GroupResult(
        "j:t", "t", [_rollout(1, RolloutStatus.INFRA_ERROR), _rollout(0, RolloutStatus.OK, ok)], [0.0, None], 1
    )
    cols = group_columns(group)
    assert cols["prompt_ids"] == [[1, 2], [1, 2]]  # the group's prompt: the failed sample has no tokens of its own
    assert cols["completion_ids"] == [[3, 4, 5], []]
    assert cols["env_mask"] == [[1, 0, 1], []]
    assert cols["logprobs"] == [[-0.5, 0.0, -0.25], []]
    assert cols[REWARD_KEY] == [1.0, None]
    assert cols[STATUS_KEY] == ["OK", "INFRA_ERROR"]
    assert envfleet_reward(["x", "y"], **{REWARD_KEY: cols[REWARD_KEY]}) == [1.0, None]
    # a failed sample that kept complete tokens trains on none of them
    failed = _rollout(1, RolloutStatus.TIMEOUT, ok)
    cols = group_columns(GroupResult("j:t", "t", [_rollout(0, RolloutStatus.OK, ok), failed], [0.0, None], 1))
    assert cols["env_mask"][1] == [0, 0, 0] and cols[REWARD_KEY][1] is None


def test_a_group_without_tokens_or_with_inexact_tokens_is_refused() -> None:
    with pytest.raises(RuntimeError, match="nothing to train on"):
        group_columns(GroupResult("j:t", "t", [_rollout(0, RolloutStatus.ENV_ERROR)], [None], 1))
    inconsistent = Tokens(status="inconsistent", prompt_ids=[1])
    with pytest.raises(RuntimeError, match="inconsistent tokens: GRPOTrainer needs exact ids"):
        group_columns(GroupResult("j:t", "t", [_rollout(0, RolloutStatus.OK, inconsistent)], [0.0], 0))
    with pytest.raises(ValueError, match="needs the 'envfleet_reward' column"):
        envfleet_reward(["x"])


class _Trainer:
    """What rollout_func reads of a GRPOTrainer."""

    def __init__(self, n: int) -> None:
        self.num_generations = n
        self.num_generations_eval = n
        self.state = type("State", (), {"global_step": 3})()


async def test_rollout_func_returns_the_groups_in_prompt_order(
    orchestrator: Orchestrator, policy_server: ScriptedServer
) -> None:
    policy = PolicyEndpoint(base_url=policy_server.url, model="scripted")
    rollout = EnvfleetRollout(orchestrator.address, ENV, policy, sampling=Sampling(max_tokens=64))
    # py-002 twice: two groups of it, in two jobs
    prompts = ["py-002", "py-002", "py-000", "py-000", "py-002", "py-002", "py-001", "py-001"]
    try:
        out = await asyncio.to_thread(rollout, prompts, _Trainer(2))
    finally:
        rollout.close()
    assert set(out) >= {"prompt_ids", "completion_ids", "logprobs", "env_mask", REWARD_KEY, STATUS_KEY}
    assert all(len(v) == len(prompts) for v in out.values())
    ids = out["envfleet_rollout_id"]
    assert [i.split(":")[1] for i in ids] == prompts  # groups in the prompts' order
    assert [i.rsplit(":", 1)[1] for i in ids] == ["0", "1"] * 4  # samples in order within each group
    assert len(rollout.job_ids) == 2 and ids[0].split(":")[0] != ids[4].split(":")[0]
    for c, m, lp in zip(out["completion_ids"], out["env_mask"], out["logprobs"], strict=True):
        assert len(c) == len(m) == len(lp) > 0
        assert 0 in m and 1 in m  # the tool observation between the two turns is masked
    assert out[REWARD_KEY] == [1.0] * 8  # the reference solutions


async def test_one_grpo_step_on_a_tiny_qwen2(
    orchestrator: Orchestrator, policy_server: ScriptedServer, tmp_path: Path
) -> None:
    torch = require("torch", "trl")
    trl = require("trl", "trl")
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from integrations.trl import task_dataset
    from orchestrator.testing.qwen_like import QWEN_LIKE_DIR

    tokenizer = AutoTokenizer.from_pretrained(QWEN_LIKE_DIR)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    policy = PolicyEndpoint(base_url=policy_server.url, model="scripted")
    rollout = EnvfleetRollout(orchestrator.address, ENV, policy, sampling=Sampling(max_tokens=64))
    seen: list[dict[str, Any]] = []

    def recorded(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = rollout(prompts, trainer)
        seen.append({"prompts": list(prompts), **out})
        return out

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        num_generations=2,
        max_steps=1,
        max_completion_length=512,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        reward_funcs=envfleet_reward,
        args=args,
        train_dataset=task_dataset(["py-000", "py-001", "py-002", "py-003"]),
        rollout_func=recorded,
    )
    try:
        result = await asyncio.to_thread(trainer.train)
    finally:
        rollout.close()
    assert math.isfinite(result.training_loss)
    assert len(seen) == 1
    batch = seen[0]
    assert len(batch["prompts"]) == 4 and batch["prompts"][0] == batch["prompts"][1] != batch["prompts"][2]
    assert [i.split(":")[1] for i in batch["envfleet_rollout_id"]] == batch["prompts"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
