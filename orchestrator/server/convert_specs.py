"""EnvironmentSpec <-> protobuf, at the edge. Unset optional fields take the model's defaults; a set one is checked."""

from __future__ import annotations

import json
from typing import Any

from orchestrator.core.sandbox import Limits
from orchestrator.service.archives import ArchiveUpload, parse_upload
from orchestrator.service.declarative import EnvironmentSpec, Problem, SpecError, parse_spec
from orchestrator.service.declarative.spec import MAX_REFERENCE_CALLS, MAX_TASKS, loads
from orchestrator.service.registration import ValidationResult
from protos import orchestrator_pb2 as pb

_LIMIT_FIELDS = tuple(Limits.model_fields)


def limits_overrides(m: pb.SandboxLimits) -> dict[str, Any]:
    """The limits a message sets (unset ones are absent, so defaults apply)."""
    return {f: getattr(m, f) for f in _LIMIT_FIELDS if m.HasField(f)}


def _json_object(text: str, where: str, problems: list[Problem]) -> Any:
    if not text:
        return {}
    try:
        return loads(text)
    except json.JSONDecodeError as e:
        problems.append(Problem(where, f"not valid JSON ({e.msg} at position {e.pos})"))
    except ValueError as e:
        problems.append(Problem(where, f"not usable JSON: {e}"))
    return {}


def _image(m: pb.ImageSource) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for f in ("dockerfile", "base"):
        if getattr(m, f):
            raw[f] = getattr(m, f)
    for f in ("packages", "setup"):
        if getattr(m, f):
            raw[f] = list(getattr(m, f))
    for f in ("files", "env"):
        if getattr(m, f):
            raw[f] = dict(getattr(m, f))
    return raw


def _task(m: pb.TaskSpec, i: int, problems: list[Problem]) -> dict[str, Any]:
    return {
        "id": m.id,
        "prompt": m.prompt,
        "data": _json_object(m.data_json, f"tasks[{i}].data_json", problems),
        "files": dict(m.files),
        "reference": [
            {"name": c.name, "arguments": _json_object(c.arguments, f"tasks[{i}].reference[{j}].arguments", problems)}
            for j, c in enumerate(m.reference)
        ],
    }


def spec_from_pb(m: pb.EnvironmentSpec) -> EnvironmentSpec:
    """A validated spec, or SpecError (INVALID_ARGUMENT) listing every problem with its field path."""
    problems: list[Problem] = []
    raw: dict[str, Any] = {"name": m.name, "version": m.version, "tools": list(m.tools)}
    if m.description:
        raw["description"] = m.description
    if m.HasField("image"):
        raw["image"] = _image(m.image)
    # counted before any task is converted: each parses its JSON, and 64 MiB of empty tasks held the event loop for
    # minutes (and took gigabytes) before the model's own limit refused them
    if len(m.tasks) > MAX_TASKS:
        raise SpecError([Problem("tasks", f"{len(m.tasks)} tasks; the limit is {MAX_TASKS}")])
    for i, t in enumerate(m.tasks):
        if len(t.reference) > MAX_REFERENCE_CALLS:
            problem = f"{len(t.reference)} calls; the limit is {MAX_REFERENCE_CALLS}"
            raise SpecError([Problem(f"tasks[{i}].reference", problem)])
    if m.tasks:
        raw["tasks"] = [_task(t, i, problems) for i, t in enumerate(m.tasks)]
    if m.tasks_jsonl:
        raw["tasks_jsonl"] = m.tasks_jsonl
    if m.HasField("scoring"):
        raw["scoring"] = {"command": m.scoring.command}
        for f in ("timeout_s", "min_reference_reward"):
            if m.scoring.HasField(f):
                raw["scoring"][f] = getattr(m.scoring, f)
    if m.HasField("limits"):
        raw["limits"] = limits_overrides(m.limits)
    for f in ("system_prompt", "setup_command", "visibility", "runtime"):
        if getattr(m, f):
            raw[f] = getattr(m, f)
    for f in ("max_turns", "tool_timeout_s"):
        if m.HasField(f):
            raw[f] = getattr(m, f)
    try:
        spec = parse_spec(raw)
    except SpecError as e:
        raise SpecError(problems + e.problems) from None
    if problems:
        raise SpecError(problems)
    return spec


def spec_to_pb(spec: EnvironmentSpec) -> pb.EnvironmentSpec:
    """The wire form of a spec (the client's edge)."""
    img = spec.image
    return pb.EnvironmentSpec(
        name=spec.name,
        version=spec.version,
        description=spec.description,
        image=pb.ImageSource(
            dockerfile=img.dockerfile or "",
            base=img.base or "",
            packages=img.packages,
            files=img.files,
            setup=img.setup,
            env=img.env,
        ),
        tasks=[
            pb.TaskSpec(
                id=t.id,
                prompt=t.prompt,
                data_json=json.dumps(t.data) if t.data else "",
                files=t.files,
                reference=[pb.ToolCall(name=c.name, arguments=json.dumps(c.arguments)) for c in t.reference],
            )
            for t in spec.tasks
        ],
        tools=spec.tools,
        scoring=pb.ScoringSpec(
            command=spec.scoring.command,
            timeout_s=spec.scoring.timeout_s,
            min_reference_reward=spec.scoring.min_reference_reward,
        ),
        limits=pb.SandboxLimits(**spec.limits.model_dump()),
        system_prompt=spec.system_prompt,
        max_turns=spec.max_turns,
        tool_timeout_s=spec.tool_timeout_s,
        setup_command=spec.setup_command or "",
        visibility=spec.visibility,
        runtime=spec.runtime,
    )


def archive_from_pb(m: pb.EnvironmentArchive) -> ArchiveUpload:
    """A checked upload (INVALID_ARGUMENT names each bad field); the size caps are the registrar's."""
    return parse_upload(m.kind, m.name, m.version, m.visibility, m.archive)


def validation_report_pb(r: ValidationResult) -> pb.ValidationReport:
    """Validate's (and ValidateArchive's) answer."""
    m = pb.ValidationReport(
        env=r.env,
        image=r.image,
        num_tasks=r.num_tasks,
        reference_task_id=r.reference_task_id,
        reference_components=r.reference_components,
        duration_s=r.duration_s,
        checks=r.checks,
    )
    if r.reference_reward is not None:
        m.reference_reward = r.reference_reward
    for t in r.tasks:
        task = m.tasks.add(task_id=t.task_id)
        if t.reference_reward is not None:
            task.reference_reward = t.reference_reward
        if t.empty_reward is not None:
            task.empty_reward = t.empty_reward
    return m
