"""TRL: a `rollout_func` for GRPOTrainer backed by an envfleet job, and the reward function that reads its rewards.

    from integrations.trl import EnvfleetRollout, envfleet_reward, task_dataset

    policy = PolicyEndpoint(base_url=VLLM_URL, model="Qwen/Qwen3-8B", tokenizer="qwen3")
    rollout = EnvfleetRollout("127.0.0.1:50051", "python-tool", policy, token_mode="tito")
    trainer = GRPOTrainer(model, reward_funcs=envfleet_reward, train_dataset=task_dataset(["py-000", "py-001"]),
                          args=GRPOConfig(num_generations=8, ...), rollout_func=rollout)

Each dataset prompt is a task id. TRL hands the rollout function its prompts already repeated `num_generations`
times in a row; each run becomes one group of one job (`group_size = num_generations`, groups delivered whole), and
the groups are returned in the prompts' order whatever order they finished in. The token arrays are the rollouts'
own (`prompt_ids`, `completion_ids`, `logprobs`, `env_mask` = envfleet's completion_mask: 1 on sampled tokens, 0 on
observations), so the job must produce exact tokens: token-in, token-out (`token_mode="tito"`, a policy tokenizer
the orchestrator knows; the default when the endpoint names one) or a chat server whose prompts extend each other.

A failed rollout (status not OK or TRUNCATED) is masked two ways: its reward is None, which TRL turns into NaN and
leaves out of the group's mean and std (its advantage becomes 0; a 0 reward would move the baseline), and its
env_mask is all 0, so none of its tokens enter the loss or the KL term. One that failed before sampling anything
gets a single pad token (env_mask 0, logprob 0.0) as its completion: TRL needs a non-empty completion per prompt,
and it pads every completion with that token anyway. So does a scored one that kept no completion (its first
generation cut at its length or deadline): masked, its reward kept. A reward function of your own beside
envfleet_reward goes through `failed_masked`, so that it too says None for a failed rollout.
"""

from __future__ import annotations

import functools
import inspect
import numbers
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

from orchestrator.client.sdk import GroupResult, SyncEnvfleetClient
from orchestrator.core.echo import error_text
from orchestrator.core.models import JobSpec, Rollout, RolloutStatus, TaskSelection, TokenMode
from orchestrator.core.policy import PolicyEndpoint, Sampling

REWARD_KEY = "envfleet_reward"
STATUS_KEY = "envfleet_status"
ID_KEY = "envfleet_rollout_id"
TOKEN_STATUS_KEY = "envfleet_token_status"


def task_dataset(task_ids: Sequence[str]) -> Any:
    """A TRL prompt dataset of task ids (a `datasets.Dataset` with one `prompt` column)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": list(task_ids)})


def envfleet_reward(completions: list[Any], **kwargs: Any) -> list[float | None]:
    """GRPOTrainer reward function: each rollout's own reward, None (masked) for a failed one."""
    rewards = kwargs.get(REWARD_KEY)
    if rewards is None or len(rewards) != len(completions):
        raise ValueError(f"envfleet_reward needs the {REWARD_KEY!r} column that EnvfleetRollout returns")
    return [None if r is None else float(r) for r in rewards]


# TRL hands each process its slice of the batch; a group is one job's, so a process must get whole groups
_WHOLE_GROUPS = (
    "each process must get whole groups: make per_device_train_batch_size x steps_per_generation a multiple of "
    "num_generations (TRL spreads a prompt's copies over processes otherwise)"
)


def failed_masked(reward_func: Callable[..., Any]) -> Callable[..., Any]:
    """Another reward function beside envfleet_reward, returning None for a failed rollout: TRL leaves a sample out
    of its group's mean only when every reward function says None, and sums what the others say (a format reward's
    0 for a rollout that never ran moved the group's baseline)."""

    def statuses(completions: list[Any], kwargs: dict[str, Any]) -> list[str]:
        found = kwargs.get(STATUS_KEY)
        if found is None or len(found) != len(completions):
            raise ValueError(f"failed_masked needs the {STATUS_KEY!r} column that EnvfleetRollout returns")
        return list(found)

    def mask(values: list[float | None], said: list[str]) -> list[float | None]:
        return [v if RolloutStatus(s).scored else None for v, s in zip(values, said, strict=True)]

    if inspect.iscoroutinefunction(reward_func):  # TRL awaits those: the wrapper must be one too

        @functools.wraps(reward_func)
        async def masked_async(completions: list[Any], **kwargs: Any) -> list[float | None]:
            said = statuses(completions, kwargs)
            return mask(await reward_func(completions, **kwargs), said)

        return masked_async

    @functools.wraps(reward_func)
    def masked(completions: list[Any], **kwargs: Any) -> list[float | None]:
        said = statuses(completions, kwargs)
        return mask(reward_func(completions, **kwargs), said)

    return masked


def _number(value: Any) -> float | None:
    """A trainer's setting as a number (a numpy float too), None when it is none (None, a bool, text)."""
    return float(value) if isinstance(value, numbers.Real) and not isinstance(value, bool) else None


def runs(task_ids: Sequence[str], group_size: int) -> list[str]:
    """The task of each run of `group_size` equal prompts (TRL's RepeatSampler order); ValueError otherwise."""
    if group_size < 1 or len(task_ids) % group_size:
        raise ValueError(
            f"{len(task_ids)} prompts are not whole groups of num_generations={group_size}: {_WHOLE_GROUPS}"
        )
    heads = list(task_ids[::group_size])
    for i, head in enumerate(heads):
        run = task_ids[i * group_size : (i + 1) * group_size]
        if any(t != head for t in run):
            raise ValueError(
                f"prompts {i * group_size}..{(i + 1) * group_size - 1} are not one task repeated: {run}; "
                f"{_WHOLE_GROUPS}"
            )
    return heads


def rounds(heads: Sequence[str]) -> list[list[str]]:
    """Split the groups' tasks into jobs with distinct task ids (a rollout id is job:task:sample, so a task twice in
    one batch needs a second job): the k-th occurrence of a task goes to round k."""
    out: list[list[str]] = []
    seen: dict[str, int] = defaultdict(int)
    for head in heads:
        k = seen[head]
        seen[head] += 1
        if k == len(out):
            out.append([])
        out[k].append(head)
    return out


def _prompt_ids(group: GroupResult) -> list[int] | None:
    # every sample of a group starts from the same rendered prompt; a failed sample may have no tokens at all
    return next((r.tokens.prompt_ids for r in group.rollouts if r.tokens.prompt_ids), None)


def group_columns(group: GroupResult, pad_id: int | None = None) -> dict[str, list[Any]]:
    """One group's columns, samples in sample order; a failed sample masked (env_mask 0, reward None), and given
    `pad_id` as its one masked token when it has none (ValueError if it has none and no pad_id was given)."""
    rollouts = sorted(group.rollouts, key=lambda r: r.sample_index)
    shared_prompt = _prompt_ids(group)
    if shared_prompt is None:
        scored_missing = any(r.status.scored and r.tokens.status == "missing" for r in rollouts)
        if scored_missing or pad_id is None:  # a job that keeps no ids (a setup to fix), or nothing to mask with
            raise RuntimeError(
                f"every sample of group {group.group_id} ended without tokens ({[r.status.value for r in rollouts]}); "
                "there is nothing to train on" + (f". {_NO_IDS}" if scored_missing else "")
            )
        # every sample failed before its first token (the fleet's failure: a sandbox that never came): each is masked
        # on a prompt of the pad token, its reward None, as TRL masks a group of no rewards. Raised, one congested
        # moment of the fleet ended the trainer's whole run
        shared_prompt = [pad_id]
    cols: dict[str, list[Any]] = defaultdict(list)
    for r in rollouts:
        _check_tokens(r)
        scored = r.status.scored
        t = r.tokens
        # Only complete tokens are kept. A scored rollout whose first generation was never kept (cut at its length,
        # or past its deadline: TRUNCATED) has "missing" tokens, and one "complete" with no ids has none either; the
        # first failed the whole step with an error about tokenizers, the second gave columns of lengths 1, 1 and 0.
        # Both are padded and masked like a failed sample, their reward kept: the episode happened, nothing to train.
        completion = list(t.completion_ids) if t.status == "complete" else []
        logprobs = list(t.completion_logprobs) if completion else []
        mask = list(t.completion_mask) if scored and completion else [0] * len(completion)
        if not completion:
            if pad_id is None:
                what = "kept no completion" if scored else "failed without tokens"
                raise ValueError(f"rollout {r.id} {what}: group_columns needs a pad_id to mask it")
            completion, logprobs, mask = [pad_id], [0.0], [0]
        cols["prompt_ids"].append(t.prompt_ids or shared_prompt)
        cols["completion_ids"].append(completion)
        cols["logprobs"].append(logprobs)
        cols["env_mask"].append(mask)
        cols[REWARD_KEY].append(r.reward if scored else None)
        cols[STATUS_KEY].append(r.status.value)
        cols[TOKEN_STATUS_KEY].append(t.status)
        cols[ID_KEY].append(r.id)
    return cols


def pad_token_id(trainer: Any) -> int | None:
    """The pad token of a trainer's processing class (a processor's tokenizer), else its eos token, else None."""
    tok = getattr(trainer, "processing_class", None)
    tok = getattr(tok, "tokenizer", tok)
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tok, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


_NO_IDS = (
    "GRPOTrainer needs exact ids. Give the policy a tokenizer (token-in, token-out) or use a server that returns token "
    "ids"
)


def _check_tokens(r: Rollout) -> None:
    # "missing" is not refused here: a scored rollout that kept no generation has it too (masked in group_columns).
    # A server that returns no ids leaves every sample without them, which the group's prompt check refuses.
    if r.status.scored and r.tokens.status == "inconsistent":
        raise RuntimeError(f"rollout {r.id} has inconsistent tokens: {_NO_IDS}")


class EnvfleetRollout:
    """GRPOTrainer's rollout_func: one envfleet job per call, its groups returned in the prompts' order.

    token_mode is the jobs' (None: tito when `policy.tokenizer` is set, else chat); GRPOTrainer needs exact ids."""

    def __init__(
        self,
        server: str,
        env: str,
        policy: PolicyEndpoint,
        *,
        sampling: Sampling | None = None,
        max_turns: int = 0,
        max_concurrency: int = 64,
        token_mode: TokenMode | None = None,
        token: str | None = None,
        **client_kwargs: Any,
    ) -> None:
        self.env = env
        self.policy = policy
        self.sampling = sampling  # None: the trainer's (GRPOConfig's temperature, top_p, max_completion_length)
        self.max_turns = max_turns
        self.max_concurrency = max_concurrency
        self.token_mode = token_mode
        self.client = SyncEnvfleetClient(server, token=token, **client_kwargs)
        self.job_ids: deque[str] = deque(maxlen=64)  # the last jobs, a job a step: not every one of a long run

    def sampling_for(self, trainer: Any) -> Sampling:
        """The jobs' sampling: the rollout's, else the trainer's. TRL recomputes the logprobs at its own temperature,
        so a rollout's that differs is refused: the gradient and the importance ratio were of another distribution
        than the one sampled, silently."""
        args = getattr(trainer, "args", None)
        temperature, top_p = _number(getattr(args, "temperature", None)), _number(getattr(args, "top_p", None))
        if self.sampling is None:
            length = _number(getattr(args, "max_completion_length", None))
            given = {"temperature": temperature, "top_p": top_p, "max_tokens": None if length is None else int(length)}
            try:
                return Sampling(**{k: v for k, v in given.items() if v is not None})
            except ValueError as e:  # a temperature past 2, say: said now, not at the first generation's error
                raise ValueError(f"the trainer's sampling cannot be the jobs': {error_text(e)}") from None
        if temperature is not None and abs(temperature - self.sampling.temperature) > 1e-9:
            raise ValueError(
                f"the rollout samples at temperature {self.sampling.temperature:g} and the trainer computes logprobs "
                f"at {temperature:g} (GRPOConfig.temperature): give EnvfleetRollout the trainer's, or no sampling"
            )
        return self.sampling

    def spec(self, task_ids: list[str], group_size: int, version: str, sampling: Sampling | None = None) -> JobSpec:
        """The job for one round of groups."""
        return JobSpec(
            env=self.env,
            tasks=TaskSelection(kind="ids", ids=task_ids),
            group_size=group_size,
            sampling=sampling or self.sampling or Sampling(),
            policy=self.policy.model_copy(update={"version": version}),
            max_turns=self.max_turns,
            max_concurrency=self.max_concurrency,
            deliver_groups=True,
            token_mode=self.token_mode,
        )

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """Run the prompts' groups; returns prompt_ids, completion_ids, logprobs, env_mask and the reward column."""
        training = bool(getattr(getattr(trainer, "model", None), "training", True))
        group_size = int(trainer.num_generations if training else trainer.num_generations_eval)
        if not all(isinstance(p, str) for p in prompts):
            raise TypeError("EnvfleetRollout's prompts are task ids (str): build the dataset with task_dataset()")
        heads = runs(prompts, group_size)
        version = str(getattr(getattr(trainer, "state", None), "global_step", 0))
        sampling = self.sampling_for(trainer)
        by_task: dict[str, list[GroupResult]] = defaultdict(list)
        for task_ids in rounds(heads):
            job_id = self.client.submit(self.spec(task_ids, group_size, version, sampling))
            self.job_ids.append(job_id)
            for group in self.client.groups(job_id):
                by_task[group.task_id].append(group)
        out: dict[str, list[Any]] = defaultdict(list)
        pad_id = pad_token_id(trainer)
        for head in heads:
            if not by_task[head]:
                raise RuntimeError(f"job {self.job_ids[-1]} ended without a whole group for task {head!r}")
            for key, values in group_columns(by_task[head].pop(0), pad_id).items():
                out[key] += values
        return dict(out)

    def close(self) -> None:
        """Close the connection."""
        self.client.close()
