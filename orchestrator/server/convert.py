"""Protobuf <-> core models, at the edge only. Field defaults of the wire (0, "") become the models' defaults."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from orchestrator.client.convert import _KIND
from orchestrator.core.echo import echo
from orchestrator.core.environment import Environment
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.models import (
    JobInfo,
    JobSpec,
)
from orchestrator.core.tools import get_tools
from orchestrator.service.jobs import Batch
from orchestrator.service.store import LogEntry
from protos import orchestrator_pb2 as pb


def validation_message(e: ValidationError) -> str:
    """A pydantic error as one line per field: `path: reason (got value)`."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "request"
        got = err.get("input")
        shown = "" if isinstance(got, dict) else f" (got {echo(got)})"
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
