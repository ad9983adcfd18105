"""What the scripted policy answers: a Script of Steps per task, and how it renders prompts into toy token ids."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.testing import toy_tokenizer as toy

Template = Literal["prefix", "drop_history", "qwen3"]


class ScriptedToolCall(BaseModel):
    """A tool call the scripted model makes; arguments are sent as their JSON text."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    arguments: dict[str, Any] = Field(default_factory=dict)


class Step(BaseModel):
    """One assistant turn: text and tool calls, or a fault (an HTTP error status, or never answering)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    content: str = ""
    tool_calls: list[ScriptedToolCall] = Field(default_factory=list)
    finish_reason: str | None = Field(None, description="override, e.g. 'length'; default: tool_calls or stop")
    error_status: int | None = Field(None, ge=400, le=599, description="answer this HTTP status instead")
    error_message: str | None = Field(None, description="the error's message, e.g. vLLM's context-length one")
    hang: bool = Field(False, description="never answer; hold the connection until the client gives up")
    chunk_delay_s: float = Field(
        0.0, ge=0, le=60, description="a streamed answer's pause between chunks: a long generation that keeps sending"
    )
    fail_times: int | None = Field(
        None, ge=1, description="the fault hits only this many attempts, then the turn answers normally; None: always"
    )
    choice_fields: dict[str, Any] = Field(
        default_factory=dict,
        description="a hostile server: these keys replace choices[0]'s own in the answer (token_ids, logprobs, "
        "prompt_token_ids...), sent as Python's json writes them (NaN and Infinity as its literals)",
    )
    fault_samples: frozenset[int] | None = Field(
        None,
        description="the fault hits only the rollouts with these sample indices (the last part of the rollout id, "
        "see sample_of), the others answer the step normally: one failed sample in a group; None: every rollout",
    )

    @model_validator(mode="after")
    def _one_fault(self) -> Step:
        if self.error_status is not None and self.hang:
            raise ValueError("a step is either an error_status or a hang, not both")
        if self.fail_times is not None and self.error_status is None and not self.hang:
            raise ValueError("fail_times needs a fault (error_status or hang)")
        if self.fault_samples is not None and self.error_status is None and not self.hang:
            raise ValueError("fault_samples needs a fault (error_status or hang)")
        return self

    def fault_applies(self, user: str) -> bool:
        """Whether this step's fault (if it has one) applies to the rollout `user`; fail_times is counted apart."""
        if self.error_status is None and not self.hang:
            return False
        return self.fault_samples is None or sample_of(user) in self.fault_samples


class Script(BaseModel):
    """What the scripted policy answers: steps per task id, steps for any other task, simulated latency."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tasks: dict[str, list[Step]] = Field(default_factory=dict)
    default: list[Step] = Field(default_factory=list, description="for tasks not in `tasks`")
    latency_s: float = Field(0.0, ge=0, le=3600, description="simulated latency of every completion")
    latency_jitter_s: float = Field(
        0.0,
        ge=0,
        le=3600,
        description="each completion's latency is drawn uniformly from latency_s +- this (never below 0), the same "
        "for the same rollout and turn in every run: a model server's answers take longer or shorter with their "
        "length, so a batch of rollouts that started together drifts apart",
    )
    model: str = Field("policy", min_length=1, description="the model id /v1/models lists")
    template: Template = Field(
        "prefix",
        description="how the prompt is rendered. prefix: every turn's prompt extends the previous prompt and "
        "completion. drop_history: earlier assistant turns render empty, as reasoning models' chat templates drop "
        "earlier thinking, so a later prompt does NOT extend the earlier one (token arrays become inconsistent). "
        "qwen3: a model server double with the offline Qwen-like tokenizer and chat template (qwen_policy.py): "
        "/v1/completions with token ids too, answers sampled with <think> and hermes tool calls (the `tito` extra)",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="qwen3 only: the context length; a longer request is refused as vLLM refuses it"
    )


def task_of(user: str) -> str | None:
    """The task id in a rollout id "<job_id>:<task_id>:<sample_index>" (task ids may contain ':'), else None."""
    first, last = user.find(":"), user.rfind(":")
    if first < 0 or last == first:
        return None
    return user[first + 1 : last]


def sample_of(user: str) -> int | None:
    """The sample index in a rollout id "<job_id>:<task_id>:<sample_index>", else None."""
    if task_of(user) is None:
        return None
    tail = user.rsplit(":", 1)[1]
    return int(tail) if tail.isdigit() else None


def render_prompt(messages: list[dict[str, Any]], template: Template) -> list[int]:
    """The prompt token ids of a conversation under a toy template (ValueError for a message the toy cannot render);
    the qwen3 template renders in qwen_policy.py."""
    if template == "qwen3":
        raise ValueError("the qwen3 template is rendered by the Qwen-like model, not the toy tokenizer")
    if template == "drop_history":
        messages = [{"role": "assistant", "content": ""} if m.get("role") == "assistant" else m for m in messages]
    return toy.prompt_ids(messages)
