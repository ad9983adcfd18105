"""The orchestrator's core types: what a job asks for and what a trainer receives. Protobuf is only the wire form
of these (orchestrator/server/convert.py); the store keeps them as JSON."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from orchestrator.core.echo import MAX_MESSAGE_CHARS, bounded
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint, Sampling
from orchestrator.core.text import as_text

MAX_TASK_IDS = 100_000  # ids one job may name
# the largest reward, either sign: a group's statistics square rewards, and past this they overflowed (advantages
# NaN, infinite, or 0 for a group of distinct rewards); no RL reward comes near it
MAX_REWARD = 1e12
# Tokens.prompt_ids and completion_ids are `repeated int32` on the wire; a token id is never negative.
TOKEN_ID_MAX = 2**31 - 1
# Tokens.completion_logprobs is `repeated float` (float32): a finite double below this would arrive as -inf.
LOGPROB_MIN = -3.4028234663852886e38


class RolloutStatus(StrEnum):
    """How a rollout ended. Only OK and TRUNCATED carry a reward to learn from."""

    OK = "OK"
    TRUNCATED = "TRUNCATED"  # turn or token limit; scored
    TIMEOUT = "TIMEOUT"  # the rollout's wall-clock limit
    POLICY_ERROR = "POLICY_ERROR"  # the inference server failed or answered garbage
    ENV_ERROR = "ENV_ERROR"  # the task or environment is broken
    INFRA_ERROR = "INFRA_ERROR"  # sandbox, engine or daemon failure; retried, never a reward

    @property
    def scored(self) -> bool:
        """Whether the rollout's reward is meaningful."""
        return self in (RolloutStatus.OK, RolloutStatus.TRUNCATED)


# how long a control plane keeps a finished job and its rollouts (`envfleet serve --job-retention-s`)
DEFAULT_JOB_RETENTION_S = 86_400.0


class JobState(StrEnum):
    """A job's lifecycle."""

    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    COMPLETED = "COMPLETED"
    CANCELLED = "CANCELLED"


TokenStatus = Literal["complete", "missing", "inconsistent"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskSelection(_Model):
    """Which tasks of the environment a job runs."""

    kind: Literal["all", "ids", "sample"] = "all"
    ids: list[str] = Field(default_factory=list, max_length=MAX_TASK_IDS)
    count: int = Field(0, ge=0, le=1_000_000, description="how many tasks to sample (kind=sample)")
    seed: int = 0

    @field_validator("ids")
    @classmethod
    def _once_each(cls, v: list[str]) -> list[str]:
        # a task's rollouts are one per sample however often it is named (a rollout's id is job:task:sample): kept
        # as named, 100,000 copies of one long id were 20 MiB a job in memory and 12 MiB in the log, for nothing
        return list(dict.fromkeys(v)) if len(set(v)) < len(v) else v

    @model_validator(mode="after")
    def _consistent(self) -> TaskSelection:
        if self.kind == "ids" and not self.ids:
            raise ValueError("tasks.ids is empty: name at least one task id")
        if self.kind == "sample" and self.count < 1:
            raise ValueError("tasks.count must be >= 1 when sampling tasks")
        if self.kind != "ids" and self.ids:
            raise ValueError("tasks.ids given but tasks.kind is not 'ids'")
        return self


# How a delivered group's advantages are computed from its rewards (orchestrator/service/advantages.py).
AdvantageMode = Literal["grpo", "dr_grpo", "rloo", "none"]
# How a rollout gets its tokens: chat (/v1/chat/completions per turn, the server renders the template; ids kept only
# while each prompt extends the last) or tito (token-in, token-out: /v1/completions with token ids, the sampled ids
# appended exactly; orchestrator/rollout/tito/).
TokenMode = Literal["chat", "tito"]


class JobSpec(_Model):
    """A trainer's request: which environment, which tasks, how many samples, and which policy."""

    env: str = Field(min_length=1, max_length=200, description="name or name@version")
    tasks: TaskSelection = TaskSelection()
    group_size: int = Field(1, ge=1, le=1024, description="samples per task (GRPO's n)")
    sampling: Sampling = Sampling()
    policy: PolicyEndpoint
    max_concurrency: int = Field(8, ge=1, le=4096, description="rollouts of this job in flight at once")
    priority: int = Field(1, ge=1, le=100, description="weight in the fair share between one tenant's jobs")
    max_turns: int = Field(
        0, ge=0, le=1000, description="0: the environment's own limit; else the smaller of this and the environment's"
    )
    rollout_timeout_s: float = Field(
        600.0,
        gt=0,
        le=24 * 3600,
        description="the episode's and its scoring's time, from the setup's end; the sandbox and setup get as long",
    )
    max_infra_retries: int = Field(2, ge=0, le=10)
    deliver_groups: bool = False
    advantage: AdvantageMode = Field(
        "grpo",
        description="advantages of delivered groups: grpo (r - mean) / (std + eps), dr_grpo r - mean, "
        "rloo r - mean of the others, none (raw reward)",
    )
    token_mode: TokenMode | None = Field(
        None, description="chat or tito; None: tito when policy.tokenizer is set, else chat (resolved on validation)"
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        le=10_000_000,
        description="tito: the whole episode's context in tokens (prompt, samples, observations); each call's "
        "max_tokens is min(sampling.max_tokens, room left) and a full context ends the rollout TRUNCATED",
    )

    @model_validator(mode="after")
    def _token_mode(self) -> JobSpec:
        if self.token_mode is None:
            self.token_mode = "tito" if self.policy.tokenizer else "chat"
        if self.token_mode == "tito":
            if not self.policy.tokenizer:
                raise ValueError("token_mode tito needs policy.tokenizer (a tokenizer name the server knows)")
            if self.policy.base_url == REPLAY_URL:
                raise ValueError(f"token_mode tito needs a policy server; {REPLAY_URL} samples no tokens")
        return self


class ToolCallRecord(_Model):
    """A tool call as the policy made it."""

    id: str
    name: str
    arguments: str


class Turn(_Model):
    """One message of the episode."""

    role: Literal["system", "user", "assistant", "tool"]
    text: str = ""
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    tool_call_id: str = ""
    name: str = ""


class Tokens(_Model):
    """Flat token arrays for training. Present only when the server returned them; never invented.

    completion_ids spans every turn after the first prompt: policy tokens (mask 1) and the observation tokens between
    them (mask 0, logprob 0). status says whether they are complete, missing, or inconsistent (a later prompt did not
    extend the earlier one, so no flat array can be exact).
    """

    status: TokenStatus = "missing"
    prompt_ids: list[int] = Field(default_factory=list)
    completion_ids: list[int] = Field(default_factory=list)
    completion_mask: list[int] = Field(default_factory=list)
    completion_logprobs: list[float] = Field(default_factory=list)

    @model_validator(mode="after")
    def _aligned(self) -> Tokens:
        # A remote worker's JSON is parsed into this model (worker/results.py) and went on to the trainer as sent: a
        # mask or logprobs of another length than the ids (arrays that no longer line up), a mask of 2 or -1, a
        # negative id. Checked with len, set and min, not element by element: a rollout holds up to 200,000 tokens.
        # Complete tokens carry all three lists, of one length; in tokens of another status a list left empty is
        # absent. Observation tokens carry logprob 0.0 (rollout/tokens.py); that is not checked here, as it would
        # need a pass over every token.
        n = len(self.completion_ids)
        for name, values in (
            ("completion_mask", self.completion_mask),
            ("completion_logprobs", self.completion_logprobs),
        ):
            if (values or self.status == "complete") and len(values) != n:
                raise ValueError(f"tokens.{name} has {len(values)} entries for {n} completion_ids")
        if self.completion_mask and not set(self.completion_mask) <= {0, 1}:
            raise ValueError("tokens.completion_mask holds a value other than 0 and 1")
        for name, ids in (("prompt_ids", self.prompt_ids), ("completion_ids", self.completion_ids)):
            if ids and min(ids) < 0:
                raise ValueError(f"tokens.{name} holds a negative token id")
            if ids and max(ids) > TOKEN_ID_MAX:
                raise ValueError(f"tokens.{name} holds a token id over {TOKEN_ID_MAX} (the wire's int32)")
        # a logprob is never positive; one past float32's range arrived as -inf or inf in the trainer's float32 array
        lps = self.completion_logprobs
        if lps and not (min(lps) >= LOGPROB_MIN and max(lps) <= 0.0 and not math.isnan(sum(lps))):  # min skips NaN
            raise ValueError(f"tokens.completion_logprobs holds a value outside {LOGPROB_MIN:g}..0 (float32's range)")
        return self


class Timing(_Model):
    """Seconds spent in each phase of one rollout."""

    queue: float = 0.0
    sandbox_acquire: float = 0.0
    setup: float = 0.0
    generation: float = 0.0
    tools: float = 0.0
    scoring: float = 0.0
    total: float = 0.0


class Provenance(_Model):
    """What produced the rollout."""

    image: str = ""
    image_id: str = ""
    env_version: str = ""
    seed: int = 0
    policy_model: str = ""
    policy_version: str = ""


MAX_KIND_CHARS = 200  # an exception's class name
CUT_NOTE_CHARS = 64  # what a cut adds past the limit (bounded's note)


class RolloutError(_Model):
    """Why a rollout failed. Made text and cut short wherever it is made: an environment's exception may quote
    megabytes, or a lone surrogate, which no result log or wire holds (on a worker, a rollout that could not be sent
    was taken for the worker's loss, and its episode run again on every worker in turn)."""

    kind: str
    message: str

    @field_validator("kind", "message")
    @classmethod
    def _carried(cls, v: str, info: ValidationInfo) -> str:
        limit = MAX_KIND_CHARS if info.field_name == "kind" else MAX_MESSAGE_CHARS
        if len(v) > limit + CUT_NOTE_CHARS:  # one cut already made (its note past the limit) is left as it is
            v = bounded(v, limit)
        return as_text(v)


class Rollout(_Model):
    """One scored attempt at one task. `id` is `job:task:sample`, stable across retries and restarts."""

    id: str
    job_id: str
    env: str
    task_id: str
    group_id: str
    sample_index: int
    policy_version: str = ""
    status: RolloutStatus
    reward: float | None = None
    reward_components: dict[str, float] = Field(default_factory=dict)
    metrics: dict[str, float] = Field(default_factory=dict)
    turns: list[Turn] = Field(default_factory=list)
    tokens: Tokens = Tokens()
    timing: Timing = Timing()
    provenance: Provenance = Provenance()
    error: RolloutError | None = None
    attempts: int = 1
    seq: int = 0  # position in the job's result log, set by the store
    started_at: float = 0.0  # unix seconds: the first attempt started; 0 if logged before this field existed
    finished_at: float = 0.0  # unix seconds: the last attempt ended

    @model_validator(mode="after")
    def _no_reward_without_score(self) -> Rollout:
        check_reward(self.status, self.reward)
        return self


def check_reward(status: RolloutStatus, reward: float | None) -> None:
    """Only a scored rollout carries a reward, and every scored one does: a failure never passes as reward 0."""
    if not status.scored and reward is not None:
        raise ValueError(f"a {status.value} rollout must not carry a reward")
    if status.scored and reward is None:
        raise ValueError(f"a {status.value} rollout needs a reward")
    if reward is not None and not math.isfinite(reward):
        raise ValueError(f"a rollout's reward must be a finite number, not {reward}")
    if reward is not None and abs(reward) > MAX_REWARD:
        raise ValueError(f"a rollout's reward must be within ±{MAX_REWARD:g}, not {reward:g}")


@dataclass(frozen=True, slots=True)
class EncodedRollout:
    """A rollout as the worker that ran it serialized it, with the fields the control plane checked: the result log
    keeps `json` and the trainer stream sends `wire` as they came, neither decoded and encoded again."""

    id: str
    job_id: str
    group_id: str
    status: RolloutStatus
    reward: float | None
    attempts: int
    json: str  # the Rollout as JSON, without its seq (the result log's form)
    wire: bytes  # the trainer wire form (orchestrator.v1.Rollout), seq unset; opaque here


def rollout_id(job_id: str, task_id: str, sample_index: int) -> str:
    """The idempotent id of one sample of one task in one job."""
    return f"{job_id}:{task_id}:{sample_index}"


class JobCounts(_Model):
    """Progress of a job."""

    total: int = 0
    done: int = 0
    by_status: dict[RolloutStatus, int] = Field(default_factory=dict)
    acked: int = 0
    in_flight: int = 0
    rollouts_per_s: float = 0.0  # done / (finished_at or now - created_at): the average since submit


class JobInfo(_Model):
    """A job as GetJob reports it."""

    job_id: str
    spec: JobSpec
    state: JobState
    counts: JobCounts = JobCounts()
    created_at: float = 0.0
    finished_at: float | None = None


class JobStatus(_Model):
    """A job as the wire's JobStatus reports it to a client (flat, without the spec)."""

    job_id: str
    state: JobState
    env: str  # resolved: name@version
    total: int = 0
    done: int = 0
    by_status: dict[RolloutStatus, int] = Field(default_factory=dict)
    acked: int = 0
    in_flight: int = 0
    rollouts_per_s: float = 0.0  # done / (finished_at or now - created_at)
    policy_version: str = ""
    created_at: float = 0.0
    finished_at: float = 0.0  # 0 while the job is not finished
