"""Protobuf <-> core models for what a client sends and receives (JobSpec out, Rollout in); the server shares the
tables."""

from __future__ import annotations

from orchestrator.core.models import (
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
from protos import orchestrator_pb2 as pb

_KIND = {pb.TaskSelection.KIND_ALL: "all", pb.TaskSelection.KIND_IDS: "ids", pb.TaskSelection.KIND_SAMPLE: "sample"}


_STATUS_PB = {s: pb.RolloutStatus.Value(s.value) for s in RolloutStatus}


_STATUS_MODEL = {v: k for k, v in _STATUS_PB.items()}


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
