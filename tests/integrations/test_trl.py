"""The TRL adapter: prompts to groups and back in order, failed samples masked, and one real GRPOTrainer step on a
2-layer Qwen2 from a config, against a real orchestrator running a tito job on the model server double: the arrays
TRL trains on are, id for id, what the double sampled, and a sample that failed inside a real group arrives masked."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest

from integrations.trl import (
    ID_KEY,
    REWARD_KEY,
    STATUS_KEY,
    TOKEN_STATUS_KEY,
    EnvfleetRollout,
    envfleet_reward,
    group_columns,
    pad_token_id,
    rounds,
    runs,
)
from orchestrator.client.sdk import GroupResult
from orchestrator.core.models import Rollout, RolloutStatus, Tokens
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.server.app import Orchestrator
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, ScriptedServer, Step, start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.integrations.conftest import ENV, TOKENIZER, require
from tests.integrations.exact import assert_sampled, observation_text, samples_of


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
    cols = group_columns(group, pad_id=0)
    assert cols["prompt_ids"] == [[1, 2], [1, 2]]  # the group's prompt: the failed sample has no tokens of its own
    # TRL needs a completion per prompt: the failed one gets one pad token, masked
    assert cols["completion_ids"] == [[3, 4, 5], [0]]
    assert cols["env_mask"] == [[1, 0, 1], [0]]
    assert cols["logprobs"] == [[-0.5, 0.0, -0.25], [0.0]]
    assert cols[REWARD_KEY] == [1.0, None]
    assert cols[STATUS_KEY] == ["OK", "INFRA_ERROR"]
    assert cols[TOKEN_STATUS_KEY] == ["complete", "missing"]
    with pytest.raises(ValueError, match="failed without tokens: group_columns needs a pad_id"):
        group_columns(group)
    assert envfleet_reward(["x", "y"], **{REWARD_KEY: cols[REWARD_KEY]}) == [1.0, None]
    # a failed sample that kept complete tokens trains on none of them
    failed = _rollout(1, RolloutStatus.TIMEOUT, ok)
    cols = group_columns(GroupResult("j:t", "t", [_rollout(0, RolloutStatus.OK, ok), failed], [0.0, None], 1))
    assert cols["env_mask"][1] == [0, 0, 0] and cols[REWARD_KEY][1] is None


def test_the_pad_token_comes_from_the_trainers_tokenizer() -> None:
    tokenizer = type("Tok", (), {"pad_token_id": None, "eos_token_id": 2})()
    processor = type("Proc", (), {"tokenizer": type("Tok", (), {"pad_token_id": 7})()})()
    assert pad_token_id(type("T", (), {"processing_class": tokenizer})()) == 2
    assert pad_token_id(type("T", (), {"processing_class": processor})()) == 7
    assert pad_token_id(object()) is None


def test_a_group_without_tokens_or_with_inexact_tokens_is_refused() -> None:
    with pytest.raises(RuntimeError, match="nothing to train on"):
        group_columns(GroupResult("j:t", "t", [_rollout(0, RolloutStatus.ENV_ERROR)], [None], 1))
    # with a pad token, a group whose every sample failed before its first token is masked whole: raised, one
    # congested moment of the fleet (every sample INFRA_ERROR) ended the trainer's run
    failed = [_rollout(i, RolloutStatus.INFRA_ERROR) for i in range(2)]
    cols = group_columns(GroupResult("j:t", "t", failed, [None, None], 2), pad_id=7)
    assert cols["prompt_ids"] == [[7], [7]] and cols["completion_ids"] == [[7], [7]]
    assert cols["env_mask"] == [[0], [0]] and cols[REWARD_KEY] == [None, None]
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


def _faulty_script(registry: Registry, tasks: list[str]) -> Script:
    """The reference solutions on the qwen3 double, with one failed sample in two of the groups: py-001's sample 1
    is refused (HTTP 400) at its second turn, after a tool call; py-002's sample 0 at its first, before any token."""
    script = reference_script(registry.get(ENV), [t for t in registry.get(ENV).tasks() if t.id in tasks])
    steps = {k: list(v) for k, v in script.tasks.items()}
    for task, sample, turn in (("py-001", 1, 1), ("py-002", 0, 0)):
        fault = {"error_status": 400, "fault_samples": [sample]}
        steps[task][turn] = Step.model_validate({**steps[task][turn].model_dump(), **fault})
    return Script(template="qwen3", tasks=steps)


async def test_one_grpo_step_on_a_tiny_qwen2(orchestrator: Orchestrator, registry: Registry, tmp_path: Path) -> None:
    torch = require("torch", "trl")
    trl = require("trl", "trl")
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from integrations.trl import task_dataset
    from orchestrator.testing.qwen_like import QWEN_LIKE_DIR

    tasks = ["py-000", "py-001", "py-002", "py-003"]
    server = await start_scripted_server(_faulty_script(registry, tasks))
    tokenizer = AutoTokenizer.from_pretrained(QWEN_LIKE_DIR)
    # the model reads the ids the double samples: one vocabulary, the double's tokenizer's
    assert len(tokenizer) == server.app.model.vocab_size
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
    policy = PolicyEndpoint(base_url=server.url, model="qwen-like", tokenizer=TOKENIZER)
    rollout = EnvfleetRollout(orchestrator.address, ENV, policy, sampling=Sampling(max_tokens=256), token_mode="tito")
    seen: list[dict[str, Any]] = []

    def recorded(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        out = rollout(prompts, trainer)
        seen.append({"prompts": list(prompts), **out})
        return out

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,  # the four tasks, two samples each, in the one step
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
        train_dataset=task_dataset(tasks),
        rollout_func=recorded,
    )
    try:
        result = await asyncio.to_thread(trainer.train)
    finally:
        rollout.close()
        await server.close()
    assert math.isfinite(result.training_loss)
    assert len(seen) == 1
    batch = seen[0]
    assert sorted(batch["prompts"]) == sorted(tasks * 2) and batch["prompts"][0] == batch["prompts"][1]
    assert [i.split(":")[1] for i in batch[ID_KEY]] == batch["prompts"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)

    code = {t.id: str(t.reference[0].arguments["code"]) for t in registry.get(ENV).tasks()}
    failed = {("py-001", "1"), ("py-002", "0")}
    for i, rollout_id in enumerate(batch[ID_KEY]):
        _, task, sample = rollout_id.split(":")
        prompt, completion = batch["prompt_ids"][i], batch["completion_ids"][i]
        mask, logprobs = batch["env_mask"][i], batch["logprobs"][i]
        assert max(prompt + completion) < config.vocab_size
        assert len(completion) == len(mask) == len(logprobs) > 0
        samples = samples_of(server, rollout_id)
        if (task, sample) in failed:
            # masked, never scored 0: no reward and no token in the loss. A failed rollout carries no tokens (py-001's
            # sample 1 had sampled its first turn), so TRL gets the group's prompt and one pad token
            assert batch[STATUS_KEY][i] == "POLICY_ERROR" and batch[REWARD_KEY][i] is None
            assert batch[TOKEN_STATUS_KEY][i] == "missing" and prompt == batch["prompt_ids"][i ^ 1]
            assert completion == [tokenizer.pad_token_id] and mask == [0] and logprobs == [0.0]
            assert [s.turn for s in samples] == ([0] if task == "py-001" else [])
            continue
        assert batch[STATUS_KEY][i] == "OK" and batch[REWARD_KEY][i] == 1.0
        assert batch[TOKEN_STATUS_KEY][i] == "complete"
        assert [s.turn for s in samples] == [0, 1]
        # exactly the double's ids and logprobs (float32 on the wire), env_mask 1 on them only
        (observation,) = assert_sampled(prompt, completion, mask, logprobs, samples, float32=True)
        assert observation == tokenizer.encode(observation_text(code[task]), add_special_tokens=False)
    assert sum(r is None for r in batch[REWARD_KEY]) == 2
    # TRL left the failed samples out of the reward: a 0 would have made the mean 6/8
    logged = next(h for h in trainer.state.log_history if "reward" in h)
    assert logged["reward"] == 1.0 and logged["rewards/envfleet_reward/mean"] == 1.0


def test_the_jobs_sample_as_the_trainer_computes_logprobs() -> None:
    # the jobs sampled at envfleet's defaults (temperature 1.0, 1024 tokens) whatever GRPOConfig said, and TRL
    # recomputes the logprobs at its own temperature: the gradient was of another distribution, silently
    args = type("Args", (), {"temperature": 0.7, "top_p": 0.95, "max_completion_length": 256})()
    trainer = type("Trainer", (), {"args": args})()
    policy = PolicyEndpoint(base_url="http://127.0.0.1:9/v1")
    rollout = EnvfleetRollout("127.0.0.1:9", ENV, policy)
    try:
        assert rollout.sampling_for(trainer) == Sampling(temperature=0.7, top_p=0.95, max_tokens=256)
        assert rollout.sampling_for(object()) == Sampling()  # no trainer arguments: envfleet's defaults
    finally:
        rollout.close()
    rollout = EnvfleetRollout("127.0.0.1:9", ENV, policy, sampling=Sampling(temperature=1.0))
    try:
        with pytest.raises(ValueError, match=r"samples at temperature 1 and the trainer computes logprobs at 0\.7"):
            rollout.sampling_for(trainer)
    finally:
        rollout.close()


def test_another_reward_function_says_none_for_a_failed_rollout() -> None:
    # TRL sums what the reward functions say and leaves a sample out only when all say None: a format reward's 0 for
    # a rollout that never ran went into its group's baseline
    from integrations.trl import STATUS_KEY, failed_masked

    def length_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
        return [0.0 for _ in completions]

    masked = failed_masked(length_reward)
    statuses = ["OK", "INFRA_ERROR", "TRUNCATED"]
    assert masked(["a", "b", "c"], **{STATUS_KEY: statuses}) == [0.0, None, 0.0]
    assert masked.__name__ == "length_reward"  # TRL logs a reward function by its name
    with pytest.raises(ValueError, match="needs the 'envfleet_status' column"):
        masked(["a"])


async def test_an_async_reward_function_stays_one_when_masked() -> None:
    # TRL awaits a coroutine reward function; the sync wrapper hid it, and zipped over the coroutine
    import inspect

    from integrations.trl import STATUS_KEY, failed_masked

    async def judged(completions: list[Any], **kwargs: Any) -> list[float | None]:
        return [1.0 for _ in completions]

    masked = failed_masked(judged)
    assert inspect.iscoroutinefunction(masked)
    assert await masked(["a", "b"], **{STATUS_KEY: ["OK", "ENV_ERROR"]}) == [1.0, None]


def test_the_trainers_sampling_as_numbers_of_any_kind_and_out_of_range() -> None:
    import numpy as np

    policy = PolicyEndpoint(base_url="http://127.0.0.1:9/v1")
    rollout = EnvfleetRollout("127.0.0.1:9", ENV, policy)
    try:
        args = type("Args", (), {"temperature": np.float32(0.5), "top_p": None, "max_completion_length": 64})()
        assert rollout.sampling_for(type("T", (), {"args": args})()) == Sampling(temperature=0.5, max_tokens=64)
        hot = type("Args", (), {"temperature": 3.0})()
        with pytest.raises(ValueError, match="the trainer's sampling cannot be the jobs': temperature"):
            rollout.sampling_for(type("T", (), {"args": hot})())
    finally:
        rollout.close()
