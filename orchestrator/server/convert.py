"""Protobuf <-> core models, at the edge only. Field defaults of the wire (0, "") become the models' defaults."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from environments.base import Environment
from environments.tools import get_tools
from orchestrator.errors import InvalidRequestError
from orchestrator.jobs import Batch
from orchestrator.models import (
    JobInfo,
    JobSpec,
    Provenance,
    Rollout,
    RolloutError,
    RolloutStatus,
    Timing,
    Tokens,
    ToolCallRecord,
    Turn,
)
from orchestrator.store import LogEntry
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


def entry_to_pb(entry: LogEntry, advantage: float | None = None) -> pb.Rollout:
    """A stored rollout (its JSON) straight into a message: the model's field names are the message's."""
    d = json.loads(entry.payload)
    if d.get("reward") is None:
        d.pop("reward", None)
    if d.get("error") is None:
        d.pop("error", None)
    m = pb.Rollout(**d, seq=entry.seq)
    if advantage is not None:
        m.advantage = advantage
    return m


def rollout_from_pb(m: pb.Rollout) -> Rollout:
    """The model of a wire rollout (the client's edge). The server validated it when it was stored."""
    t = m.tokens
    return Rollout.model_construct(
        id=m.id,
        job_id=m.job_id,
        env=m.env,
        task_id=m.task_id,
        group_id=m.group_id,
        sample_index=m.sample_index,
        policy_version=m.policy_version,
        status=_STATUS_MODEL[m.status],
        reward=m.reward if m.HasField("reward") else None,
        reward_components=dict(m.reward_components),
        metrics=dict(m.metrics),
        turns=[
            Turn.model_construct(
                role=x.role,  # type: ignore[arg-type]  # validated when stored
                text=x.text,
                tool_calls=[
                    ToolCallRecord.model_construct(id=c.id, name=c.name, arguments=c.arguments) for c in x.tool_calls
                ],
                tool_call_id=x.tool_call_id,
                name=x.name,
            )
            for x in m.turns
        ],
        tokens=Tokens.model_construct(
            status=t.status or "missing",  # type: ignore[arg-type]
            prompt_ids=list(t.prompt_ids),
            completion_ids=list(t.completion_ids),
            completion_mask=list(t.completion_mask),
            completion_logprobs=list(t.completion_logprobs),
        ),
        timing=Timing.model_construct(**{f: getattr(m.timing, f) for f in _TIMING_FIELDS}),
        provenance=Provenance.model_construct(**{f: getattr(m.provenance, f) for f in _PROVENANCE_FIELDS}),
        error=RolloutError.model_construct(kind=m.error.kind, message=m.error.message) if m.HasField("error") else None,
        attempts=m.attempts,
        seq=m.seq,
    )


_TIMING_FIELDS = tuple(Timing.model_fields)
_PROVENANCE_FIELDS = tuple(Provenance.model_fields)


def batch_to_pb(b: Batch) -> pb.RolloutBatch:
    """One stream message."""
    return pb.RolloutBatch(
        rollouts=[entry_to_pb(e) for e in b.entries],
        groups=[
            pb.Group(
                group_id=g.group_id,
                task_id=g.task_id,
                rollouts=[entry_to_pb(e, a) for e, a in zip(g.entries, g.advantages, strict=True)],
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
