"""Protobuf <-> core models, at the edge only. Field defaults of the wire (0, "") become the models' defaults."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from google.protobuf.message import DecodeError
from pydantic import ValidationError
from pydantic_core import from_json

from orchestrator.client.convert import (
    ADVANTAGE_FROM_PB,
    JOB_STATE_PB,
    KIND_FROM_PB,
    ROLLOUT_STATUS_PB,
    TOKEN_MODE_FROM_PB,
    TOKEN_STATUS_PB,
)
from orchestrator.core.echo import echo
from orchestrator.core.environment import Environment
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.models import (
    JobInfo,
    JobSpec,
)
from orchestrator.core.policy import shown_url
from orchestrator.core.tools import get_tools
from orchestrator.service.jobs import Batch
from orchestrator.service.store import LogEntry
from protos import orchestrator_pb2 as pb

log = logging.getLogger(__name__)

SECRET_FIELDS = frozenset({"api_key"})


def validation_message(e: ValidationError, notes: Mapping[str, str] | None = None) -> str:
    """A pydantic error as one line per field: `path: reason (got value)`, plus a note on the field, if any."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "request"
        got = err.get("input")
        secret = bool(err["loc"]) and err["loc"][-1] in SECRET_FIELDS  # never echoed: errors reach logs and clients
        if bool(err["loc"]) and err["loc"][-1] == "base_url" and isinstance(got, str):
            got = shown_url(got)  # its userinfo and query may hold a key
        shown = "" if isinstance(got, dict) or secret else f" (got {echo(got)})"
        note = (notes or {}).get(loc)
        parts.append(f"{loc}: {err['msg']}{shown}" + (f"; {note}" if note else ""))
    return "; ".join(parts)


# JobSpec fields where the wire's 0 (proto3's "unset") takes the default: error messages say so, like the proto
_WIRE_DEFAULTS: dict[str, int | float] = {
    "group_size": 1,
    "max_concurrency": 8,
    "priority": 1,
    "rollout_timeout_s": 600.0,
}
_JOB_SPEC_NOTES = {k: f"0 means the default, {v:g}" for k, v in _WIRE_DEFAULTS.items()} | {
    "max_model_len": "0 means no limit but the server's",
    "max_turns": "0 means the environment's own limit",
}


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
        "tokenizer": m.policy.tokenizer,
        "stream": m.policy.stream,
    }
    if m.policy.tool_parser:
        policy["tool_parser"] = m.policy.tool_parser
    if m.policy.chat_template_kwargs:
        policy["chat_template_kwargs"] = m.policy.chat_template_kwargs
    for f in ("request_timeout_s", "max_retries", "outage_wait_s"):
        if m.policy.HasField(f):
            policy[f] = getattr(m.policy, f)
    raw: dict[str, Any] = {
        "env": m.env,
        "tasks": {
            "kind": KIND_FROM_PB.get(m.tasks.kind, _unknown(m.tasks.kind)),
            "ids": list(m.tasks.ids),
            "count": m.tasks.count,
            "seed": m.tasks.seed,
        },
        "sampling": sampling,
        "policy": policy,
        "deliver_groups": m.deliver_groups,
        "advantage": ADVANTAGE_FROM_PB.get(m.advantage, _unknown(m.advantage)),
        "token_mode": TOKEN_MODE_FROM_PB.get(m.token_mode, _unknown(m.token_mode)),
        "max_model_len": m.max_model_len or None,
        "max_turns": m.max_turns,
    }
    raw |= {k: getattr(m, k) or default for k, default in _WIRE_DEFAULTS.items()}
    if m.HasField("max_infra_retries"):
        raw["max_infra_retries"] = m.max_infra_retries
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as e:
        raise InvalidRequestError(f"invalid job spec: {validation_message(e, _JOB_SPEC_NOTES)}") from None


def rollout_pb(payload: str | bytes, seq: int = 0) -> pb.Rollout:
    """A rollout's JSON (the result log's form) straight into its wire message: the model's field names are the
    message's, its text enums become the wire's enums. Workers call it once per rollout, so that the control plane
    streams their bytes as they came; the control plane calls it for rollouts that came without them."""
    d = from_json(payload)  # pydantic's parser: about 3x the standard library's
    d.pop("seq", None)
    if d.get("reward") is None:
        d.pop("reward", None)
    if d.get("error") is None:
        d.pop("error", None)
    d["status"] = ROLLOUT_STATUS_PB[d["status"]]
    tokens = d.get("tokens")
    if tokens is not None:
        name = tokens.pop("status", "missing")
        tokens["status"], tokens["status_name"] = TOKEN_STATUS_PB[name], name
    return pb.Rollout(**d, seq=seq)


def _unknown(number: int) -> str:
    """How an enum number this server does not know reads in the refusal (a client's newer proto sent it)."""
    return f"enum value {number}, unknown to this server (older than your proto?)"


def _fill(target: pb.Rollout, entry: LogEntry, advantage: float | None = None) -> None:
    """Write a stored rollout into a message of the batch in place (a message appended to a repeated field would be
    copied): its wire bytes when a worker sent them, else its JSON converted. A row this version cannot convert (an
    older one's, a status or field since gone) goes out as an INFRA_ERROR with its id: raised, it failed its stream
    at every try, and nothing of the job after it was delivered."""
    try:
        if entry.wire:
            target.MergeFromString(entry.wire)
        else:
            target.CopyFrom(rollout_pb(entry.payload))
    except (ValueError, TypeError, KeyError, DecodeError) as e:
        log.error("rollout %s (seq %d) of the result log cannot be streamed: %s", entry.rollout_id, entry.seq, e)
        target.Clear()
        sample = entry.rollout_id.rpartition(":")[2]  # ids are job:task:sample
        target.MergeFrom(
            pb.Rollout(
                id=entry.rollout_id,
                job_id=entry.job_id,
                group_id=entry.group_id,
                task_id=entry.task_id,
                sample_index=int(sample) if sample.isdigit() and len(sample) < 10 else 0,
                status=pb.ROLLOUT_STATUS_INFRA_ERROR,
                tokens=pb.Tokens(status=pb.TOKEN_STATUS_MISSING),  # UNSPECIFIED is never sent
                error=pb.RolloutError(
                    kind="UnreadableLogEntry",
                    message=f"the result log's row of this rollout cannot be read by this version: {type(e).__name__}",
                ),
            )
        )
        advantage = None  # no score to weigh (its group's figures count it as it was logged)
    target.seq = entry.seq
    if advantage is not None:
        target.advantage = advantage


def entry_to_pb(entry: LogEntry, advantage: float | None = None) -> pb.Rollout:
    """One stored rollout as its wire message."""
    m = pb.Rollout()
    _fill(m, entry, advantage)
    return m


def batch_to_pb(b: Batch) -> pb.RolloutBatch:
    """One stream message."""
    out = pb.RolloutBatch()
    for e in b.entries:
        _fill(out.rollouts.add(), e)
    for g in b.groups:
        group = out.groups.add(group_id=g.group_id, task_id=g.task_id, failed=g.failed, more=g.more)
        for e, a in zip(g.entries, g.advantages, strict=True):
            _fill(group.rollouts.add(), e, a)
    return out


def job_status_pb(info: JobInfo) -> pb.JobStatus:
    """GetJob's answer."""
    c = info.counts
    return pb.JobStatus(
        job_id=info.job_id,
        state=JOB_STATE_PB[info.state.value],
        state_name=info.state.value,
        env=info.spec.env,
        total=c.total,
        done=c.done,
        by_status={k.value: v for k, v in c.by_status.items()},
        acked=c.acked,
        in_flight=c.in_flight,
        rollouts_per_s=c.rollouts_per_s,
        policy_version=info.spec.policy.version,
        created_at=info.created_at,
        finished_at=info.finished_at or 0.0,
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
