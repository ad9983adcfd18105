"""Protobuf <-> core models, at the edge only. Field defaults of the wire (0, "") become the models' defaults."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from environments.base import Environment
from environments.tools import get_tools
from orchestrator.errors import InvalidRequestError
from orchestrator.jobs import Batch
from orchestrator.models import JobInfo, JobSpec, Rollout, RolloutStatus
from protos import orchestrator_pb2 as pb

_KIND = {pb.TaskSelection.KIND_ALL: "all", pb.TaskSelection.KIND_IDS: "ids", pb.TaskSelection.KIND_SAMPLE: "sample"}
_STATUS_PB = {s: pb.RolloutStatus.Value(s.value) for s in RolloutStatus}
_STATUS_MODEL = {v: k for k, v in _STATUS_PB.items()}


def validation_message(e: ValidationError) -> str:
    """A pydantic error as one line per field: `path: reason (got value)`."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "request"
        got = err.get("input")
        shown = "" if isinstance(got, dict) else f" (got {got!r})"[:120]
        parts.append(f"{loc}: {err['msg']}{shown}")
    return "; ".join(parts)


def job_spec_from_pb(m: pb.JobSpec) -> JobSpec:
    """A validated JobSpec, or InvalidRequestError naming every bad field."""
    sampling: dict[str, Any] = {"stop": list(m.sampling.stop)}
    for f in ("temperature", "top_p", "max_tokens", "seed"):
        if m.sampling.HasField(f):
            sampling[f] = getattr(m.sampling, f)
    policy: dict[str, Any] = {
        "base_url": m.policy.base_url,
        "model": m.policy.model or "policy",
        "api_key": m.policy.api_key,
        "version": m.policy.version or "0",
    }
    for f in ("request_timeout_s", "max_retries"):
        if m.policy.HasField(f):
            policy[f] = getattr(m.policy, f)
    raw: dict[str, Any] = {
        "env": m.env,
        "tasks": {
            "kind": _KIND.get(m.tasks.kind, "?"),
            "ids": list(m.tasks.ids),
            "count": m.tasks.count,
            "seed": m.tasks.seed,
        },
        "group_size": m.group_size or 1,
        "sampling": sampling,
        "policy": policy,
        "max_concurrency": m.max_concurrency or 8,
        "priority": m.priority or 1,
        "max_turns": m.max_turns or 16,
        "rollout_timeout_s": m.rollout_timeout_s or 600.0,
        "deliver_groups": m.deliver_groups,
    }
    if m.HasField("max_infra_retries"):
        raw["max_infra_retries"] = m.max_infra_retries
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        raise InvalidRequestError(f"invalid job spec: {validation_message(e)}") from None


def rollout_to_pb(r: Rollout, advantage: float | None = None) -> pb.Rollout:
    """The wire form of a rollout."""
    m = pb.Rollout(
        id=r.id,
        job_id=r.job_id,
        env=r.env,
        task_id=r.task_id,
        group_id=r.group_id,
        sample_index=r.sample_index,
        policy_version=r.policy_version,
        status=_STATUS_PB[r.status],
        reward_components=r.reward_components,
        metrics=r.metrics,
        turns=[
            pb.Turn(
                role=t.role,
                text=t.text,
                tool_calls=[pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in t.tool_calls],
                tool_call_id=t.tool_call_id,
                name=t.name,
            )
            for t in r.turns
        ],
        tokens=pb.Tokens(
            status=r.tokens.status,
            prompt_ids=r.tokens.prompt_ids,
            completion_ids=r.tokens.completion_ids,
            completion_mask=r.tokens.completion_mask,
            completion_logprobs=r.tokens.completion_logprobs,
        ),
        timing=pb.Timing(**r.timing.model_dump()),
        provenance=pb.Provenance(**r.provenance.model_dump()),
        attempts=r.attempts,
        seq=r.seq,
    )
    if r.reward is not None:
        m.reward = r.reward
    if r.error is not None:
        m.error.kind, m.error.message = r.error.kind, r.error.message
    if advantage is not None:
        m.advantage = advantage
    return m


def rollout_from_pb(m: pb.Rollout) -> Rollout:
    """The model of a wire rollout (the client's edge)."""
    return Rollout.model_validate(
        {
            "id": m.id,
            "job_id": m.job_id,
            "env": m.env,
            "task_id": m.task_id,
            "group_id": m.group_id,
            "sample_index": m.sample_index,
            "policy_version": m.policy_version,
            "status": _STATUS_MODEL[m.status],
            "reward": m.reward if m.HasField("reward") else None,
            "reward_components": dict(m.reward_components),
            "metrics": dict(m.metrics),
            "turns": [
                {
                    "role": t.role,
                    "text": t.text,
                    "tool_calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in t.tool_calls],
                    "tool_call_id": t.tool_call_id,
                    "name": t.name,
                }
                for t in m.turns
            ],
            "tokens": {
                "status": m.tokens.status or "missing",
                "prompt_ids": list(m.tokens.prompt_ids),
                "completion_ids": list(m.tokens.completion_ids),
                "completion_mask": list(m.tokens.completion_mask),
                "completion_logprobs": list(m.tokens.completion_logprobs),
            },
            "timing": {f: getattr(m.timing, f) for f in pb.Timing.DESCRIPTOR.fields_by_name},
            "provenance": {f: getattr(m.provenance, f) for f in pb.Provenance.DESCRIPTOR.fields_by_name},
            "error": {"kind": m.error.kind, "message": m.error.message} if m.HasField("error") else None,
            "attempts": m.attempts,
            "seq": m.seq,
        }
    )


def batch_to_pb(b: Batch) -> pb.RolloutBatch:
    """One stream message."""
    return pb.RolloutBatch(
        rollouts=[rollout_to_pb(r) for r in b.rollouts],
        groups=[
            pb.Group(
                group_id=g.group_id,
                task_id=g.task_id,
                rollouts=[rollout_to_pb(r, a) for r, a in zip(g.rollouts, g.advantages, strict=True)],
                failed=g.failed,
            )
            for g in b.groups
        ],
    )


def job_status_pb(info: JobInfo) -> pb.JobStatus:
    """GetJob's answer."""
    c = info.counts
    return pb.JobStatus(
        job_id=info.job_id,
        state=info.state.value,
        env=info.spec.env,
        total=c.total,
        done=c.done,
        by_status=c.by_status,
        acked=c.acked,
        in_flight=c.in_flight,
        rollouts_per_s=c.rollouts_per_s,
        policy_version=info.spec.policy.version,
        created_at=info.created_at,
    )


def environment_pb(env: Environment, source: str, image: str) -> pb.EnvironmentInfo:
    """Describe's answer."""
    return pb.EnvironmentInfo(
        name=env.name,
        version=env.version,
        description=env.description,
        num_tasks=len(env.tasks()),
        tools=[
            pb.ToolInfo(name=t.name, description=t.description, parameters_json=json.dumps(t.parameters))
            for t in get_tools(env.tools)
        ],
        image=image,
        default_max_turns=env.max_turns,
        source=source,
    )


_KIND_PB = {v: k for k, v in _KIND.items()}


def job_spec_to_pb(s: JobSpec) -> pb.JobSpec:
    """The wire form of a JobSpec (the client's edge)."""
    m = pb.JobSpec(
        env=s.env,
        tasks=pb.TaskSelection(kind=_KIND_PB[s.tasks.kind], ids=s.tasks.ids, count=s.tasks.count, seed=s.tasks.seed),
        group_size=s.group_size,
        sampling=pb.SamplingParams(
            temperature=s.sampling.temperature,
            top_p=s.sampling.top_p,
            max_tokens=s.sampling.max_tokens,
            stop=s.sampling.stop,
        ),
        policy=pb.PolicyEndpoint(
            base_url=s.policy.base_url,
            model=s.policy.model,
            api_key=s.policy.api_key,
            version=s.policy.version,
            request_timeout_s=s.policy.request_timeout_s,
            max_retries=s.policy.max_retries,
        ),
        max_concurrency=s.max_concurrency,
        priority=s.priority,
        max_turns=s.max_turns,
        rollout_timeout_s=s.rollout_timeout_s,
        max_infra_retries=s.max_infra_retries,
        deliver_groups=s.deliver_groups,
    )
    if s.sampling.seed is not None:
        m.sampling.seed = s.sampling.seed
    return m
