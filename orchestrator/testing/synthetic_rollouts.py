"""Synthetic rollouts for the trajectory viewer's tests and benchmark: many small ones, or one long one, with
toy-tokenizer token ids and masks that are right by construction."""

from __future__ import annotations

import random
from collections.abc import Iterator

from orchestrator.core.models import (
    Provenance,
    Rollout,
    RolloutStatus,
    Timing,
    Tokens,
    ToolCallRecord,
    Turn,
    rollout_id,
)
from orchestrator.testing import toy_tokenizer

STATUSES = [RolloutStatus.OK] * 6 + [RolloutStatus.TRUNCATED, RolloutStatus.TIMEOUT, RolloutStatus.INFRA_ERROR]


def long_rollout(turns: int = 100, job_id: str = "job-long", tool_output: str = "ok") -> Rollout:
    """One rollout of `turns` assistant/tool exchanges, with tokens: policy tokens mask 1, tool outputs mask 0."""
    history: list[Turn] = [Turn(role="user", text="Solve the task, then call submit.")]
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for i in range(turns // 2):
        call = ToolCallRecord(id=f"call_{i}", name="python", arguments=f'{{"code": "print({i} * 2)"}}')
        history.append(Turn(role="assistant", text=f"Step {i}: compute it.", tool_calls=[call]))
        wire_call = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        reply = toy_tokenizer.completion_ids(
            {"role": "assistant", "content": f"Step {i}: compute it.", "tool_calls": [wire_call]}
        )
        ids += reply
        mask += [1] * len(reply)
        logprobs += [toy_tokenizer.logprob(t, p) for p, t in enumerate(reply)]
        output = f"{i * 2}\n{tool_output}"
        history.append(Turn(role="tool", text=output, tool_call_id=call.id, name="python"))
        obs = [toy_tokenizer.TOOL, *toy_tokenizer.encode(output), toy_tokenizer.END, toy_tokenizer.ASSISTANT]
        ids += obs
        mask += [0] * len(obs)
        logprobs += [0.0] * len(obs)
    prompt = toy_tokenizer.prompt_ids([{"role": "user", "content": history[0].text}])
    return Rollout(
        id=rollout_id(job_id, "task-0", 0),
        job_id=job_id,
        env="python-tool@1",
        task_id="task-0",
        group_id=f"{job_id}:task-0",
        sample_index=0,
        status=RolloutStatus.OK,
        reward=1.0,
        reward_components={"correct": 1.0, "format": 0.5},
        turns=history,
        tokens=Tokens(
            status="complete", prompt_ids=prompt, completion_ids=ids, completion_mask=mask, completion_logprobs=logprobs
        ),
        timing=Timing(queue=0.1, sandbox_acquire=0.3, setup=0.2, generation=2.0, tools=1.5, scoring=0.4, total=4.5),
        provenance=Provenance(policy_model="scripted", policy_version="v1", image="envfleet/base:latest"),
        started_at=1_700_000_000.0,
        finished_at=1_700_000_004.5,
    )


def many_rollouts(n: int, job_id: str = "job-many", group_size: int = 4, seed: int = 0) -> Iterator[Rollout]:
    """`n` short rollouts in groups of `group_size`, with varied statuses, rewards, turns and durations."""
    rng = random.Random(seed)
    for i in range(n):
        task, sample = f"task-{i // group_size}", i % group_size
        status = rng.choice(STATUSES)
        turns = rng.randint(2, 12)
        total = rng.uniform(0.5, 30.0)
        yield Rollout(
            id=rollout_id(job_id, task, sample),
            job_id=job_id,
            env=rng.choice(["python-tool@1", "code-tests@1"]),
            task_id=task,
            group_id=f"{job_id}:{task}",
            sample_index=sample,
            status=status,
            reward=round(rng.random(), 3) if status.scored else None,
            turns=[Turn(role="user", text="go")] + [Turn(role="assistant", text=f"turn {t}") for t in range(turns - 1)],
            timing=Timing(generation=total * 0.6, tools=total * 0.3, total=total),
            provenance=Provenance(policy_model="policy"),
            finished_at=1_700_000_000.0 + i * 0.01,
        )
