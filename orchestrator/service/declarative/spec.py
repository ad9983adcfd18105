"""EnvironmentSpec: an environment described as data (YAML, JSON or protobuf), for authors who do not write Python.

    name: word-count
    version: "1"
    image: {base: envfleet/base:latest, files: {/opt/grader/score.py: "..."}, setup: ["chmod 0755 /opt/grader"]}
    tools: [bash, submit]
    tasks: [{id: t1, prompt: "...", data: {expected: 3}, reference: [{name: submit, arguments: {answer: "3"}}]}]
    scoring: {command: "python3 /opt/grader/score.py"}
    limits: {memory_mb: 512, pids: 128}

`parse_spec` validates every field at once and raises SpecError listing each problem with its field path.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.core.echo import echo
from orchestrator.core.image_spec import shell_form
from orchestrator.core.sandbox import RUNTIME_PATTERN, Limits
from orchestrator.core.tools import BUILTIN_TOOLS
from orchestrator.service.declarative import dockerfile
from orchestrator.service.declarative.errors import Problem, SpecError

# the registry's rules for names and versions
NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,31}$"
TASK_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
PACKAGE_PATTERN = r"^[a-z0-9][a-z0-9+.-]{0,127}$"
ENVFLEET_IMAGE_PREFIX = "envfleet/"
DEFAULT_LIMITS = Limits(memory_mb=512, cpus=1.0, pids=128)
DEFAULT_SYSTEM_PROMPT = "You are an agent working in a sandbox. Use the tools; call submit when done."
MAX_TEXT = 256 << 10
MAX_TASKS = 100_000
MAX_REFERENCE_CALLS = 100  # tool calls of one task's reference solution
MAX_JSON_DEPTH = 64  # levels of nesting in task data and reference arguments: far inside what pydantic reads back
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Dockerfile instructions substitute $VARS in paths and treat a backslash as an escape: allow neither in paths.
_PATH_FORBIDDEN = ("\n", "\r", "\0", "$", "\\")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _image_path(path: str) -> str:
    p = PurePosixPath(path)
    if not p.is_absolute():
        raise ValueError(f"file path {path!r} must be absolute")
    if ".." in p.parts:
        raise ValueError(f"file path {path!r} must not contain '..' (path traversal)")
    if path.endswith("/") or str(p) == "/":
        raise ValueError(f"file path {path!r} must name a file")
    if any(c in path for c in _PATH_FORBIDDEN):
        raise ValueError(f"file path {path!r} must not contain '$', a backslash, a newline or NUL")
    return path


def _workspace_path(path: str) -> str:
    p = PurePosixPath(path)
    if not path or p.is_absolute() or ".." in p.parts or "\0" in path:
        raise ValueError(f"task file {path!r} must be relative to the workspace, without '..' (path traversal)")
    if path.endswith("/") or str(p) == ".":
        raise ValueError(f"task file {path!r} must name a file")
    return path


class ReferenceCall(_Strict):
    """One tool call of a reference solution."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)

    _nesting = field_validator("arguments")(lambda v: nested_within(v, "the arguments"))

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in BUILTIN_TOOLS:
            raise ValueError(f"unknown tool {v!r}; built-in tools are {sorted(BUILTIN_TOOLS)}")
        return v


class TaskDef(_Strict):
    """One task: the prompt the policy sees, data only the scorer sees, files put in the workspace first."""

    id: str = Field(pattern=TASK_ID_PATTERN)
    prompt: str = Field(min_length=1, max_length=MAX_TEXT)
    data: dict[str, Any] = Field(default_factory=dict)
    files: dict[str, str] = Field(default_factory=dict)
    reference: list[ReferenceCall] = Field(default_factory=list, max_length=MAX_REFERENCE_CALLS)

    _nesting = field_validator("data")(lambda v: nested_within(v, "the data"))

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        for path in v:
            _workspace_path(path)
        return v


class ImageDef(_Strict):
    """A Dockerfile, or a base image plus files, package checks, environment and build commands."""

    dockerfile: str | None = Field(None, min_length=1, max_length=MAX_TEXT)
    base: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:@-]*$")
    packages: list[str] = Field(default_factory=list, max_length=1000)
    files: dict[str, str] = Field(default_factory=dict)
    setup: list[str] = Field(default_factory=list, max_length=1000)
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("base")
    @classmethod
    def _envfleet_base(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith(ENVFLEET_IMAGE_PREFIX):
            raise ValueError(f"base {echo(v)} must be an envfleet image (envfleet/...): sandboxes need envd")
        if v is not None and v.startswith(dockerfile.TENANT_IMAGE_PREFIX):
            raise ValueError(f"base {echo(v)} is another environment's image (maybe another tenant's)")
        return v

    @field_validator("packages")
    @classmethod
    def _packages(cls, v: list[str]) -> list[str]:
        for p in v:
            if not re.match(PACKAGE_PATTERN, p):
                raise ValueError(f"{p!r} is not a Debian package name")
        return v

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        for path in v:
            _image_path(path)
        return v

    @field_validator("setup")
    @classmethod
    def _setup(cls, v: list[str]) -> list[str]:
        for cmd in v:
            if not cmd.strip() or "\0" in cmd:
                raise ValueError(f"setup command {cmd!r} is empty or holds NUL")
        # a command written as a RUN line (render_dockerfile) is checked as a tenant's Dockerfile is: "--mount=...,
        # from=" at its start is a RUN flag, which would read another environment's image on a builder that takes
        # it. One of several lines goes in as JSON, where the builder reads no flag (nor heredoc)
        for i, cmd in enumerate(v):
            if shell_form(cmd):
                try:
                    dockerfile.check(f"FROM envfleet/base:latest\nRUN {cmd}\n")
                except dockerfile.DockerfileError as e:
                    raise ValueError(f"setup[{i}] {echo(cmd)}: {e}") from None
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for name, value in v.items():
            if not _ENV_NAME.match(name):
                raise ValueError(f"env name {name!r} is not a shell variable name")
            if any(c in value for c in "\n\r\0"):
                raise ValueError(f"env {name} holds a newline or NUL")
        return v

    @field_validator("dockerfile")
    @classmethod
    def _dockerfile(cls, v: str | None) -> str | None:
        if v is None:
            return v
        dockerfile.check(v)  # parsed as the builder reads it: every stage, --from, ADD, ONBUILD (DockerfileError)
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> ImageDef:
        if self.dockerfile is not None and (self.base or self.packages or self.files or self.setup or self.env):
            raise ValueError("give either dockerfile, or base/packages/files/setup/env, not both")
        return self

    @property
    def is_default(self) -> bool:
        """The plain base image, nothing to build."""
        return self.dockerfile is None and not (self.packages or self.files or self.setup or self.env)


class ScoringDef(_Strict):
    """The scoring command and its limits."""

    command: str = Field(min_length=1, max_length=MAX_TEXT)
    timeout_s: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False)
    min_reference_reward: float = Field(1.0, allow_inf_nan=False)


class EnvironmentSpec(_Strict):
    """A whole declarative environment."""

    name: str = Field(pattern=NAME_PATTERN)
    version: str = Field(pattern=VERSION_PATTERN)
    description: str = Field("", max_length=4096)
    image: ImageDef = ImageDef()
    tasks: list[TaskDef] = Field(min_length=1, max_length=MAX_TASKS)
    tools: list[str] = Field(min_length=1, max_length=len(BUILTIN_TOOLS))
    scoring: ScoringDef
    limits: Limits = DEFAULT_LIMITS
    runtime: str = Field("", pattern=RUNTIME_PATTERN, description="OCI runtime (runsc: gVisor); empty: the default")
    system_prompt: str = Field(DEFAULT_SYSTEM_PROMPT, min_length=1, max_length=MAX_TEXT)
    max_turns: int = Field(16, ge=1, le=1000)
    tool_timeout_s: float = Field(60.0, gt=0, le=3600, allow_inf_nan=False)
    setup_command: str | None = Field(None, min_length=1, max_length=MAX_TEXT)
    # private: only the registering tenant may list, describe, run jobs, sessions and sandboxes on it (its tasks'
    # data and its scorer's reward components are that tenant's); public: every tenant may
    visibility: Literal["private", "public"] = "private"

    @field_validator("tools")
    @classmethod
    def _tools(cls, v: list[str]) -> list[str]:
        unknown = [t for t in v if t not in BUILTIN_TOOLS]
        if unknown:
            raise ValueError(f"unknown tool(s) {unknown}; built-in tools are {sorted(BUILTIN_TOOLS)}")
        if len(set(v)) != len(v):
            raise ValueError("a tool is listed twice")
        return v

    @field_validator("tasks")
    @classmethod
    def _unique_ids(cls, v: list[TaskDef]) -> list[TaskDef]:
        dupes = sorted(i for i, n in Counter(t.id for t in v).items() if n > 1)
        if dupes:
            raise ValueError(f"task ids are not unique: {dupes[:5]}")
        return v

    @model_validator(mode="after")
    def _reference_tools_offered(self) -> EnvironmentSpec:
        for i, task in enumerate(self.tasks):
            missing = sorted({c.name for c in task.reference} - set(self.tools))
            if missing:
                raise ValueError(f"tasks[{i}].reference calls {missing}, which are not in tools {self.tools}")
        return self

    def ref(self) -> str:
        """`name@version`."""
        return f"{self.name}@{self.version}"


def _field_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or "spec"


def _message(err: Mapping[str, Any]) -> str:
    msg = str(err["msg"]).removeprefix("Value error, ")
    got = err.get("input")
    if err["type"] not in ("missing", "value_error") and not isinstance(got, dict | list):
        msg += f" (got {echo(got)})"
    return msg


def nested_within(value: Any, what: str = "it") -> Any:
    """`value` (parsed JSON), or ValueError when it nests deeper than MAX_JSON_DEPTH: a spec stored as JSON is read
    back by pydantic, whose reader stops at about 200 levels (and whose writer at 255). Deeper, a spec registered and
    then failed every rollout on a remote worker, which could not parse it, and was dropped at the next start."""
    if not isinstance(value, dict | list):
        return value
    level = [value]  # the containers at one depth
    for _ in range(MAX_JSON_DEPTH):
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, dict | list)]
        if not level:
            return value
    raise ValueError(f"{what} is nested too deeply: more than {MAX_JSON_DEPTH} levels")


def loads(text: str) -> Any:
    """json.loads, raising ValueError (besides its JSONDecodeError) for what it would raise otherwise or let pass:
    nesting deeper than MAX_JSON_DEPTH, an integer of thousands of digits, and a lone surrogate's escape, which is no
    character: a spec holding one could not be stored (each was an INTERNAL error)."""
    try:
        value = nested_within(json.loads(text))
    except RecursionError:
        raise ValueError(f"it is nested too deeply: more than {MAX_JSON_DEPTH} levels") from None
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        raise ValueError("it holds a lone surrogate escape (\\ud800-\\udfff), which is no character") from None
    return value


def parse_tasks_jsonl(text: str) -> tuple[list[Any], list[int], list[Problem]]:
    """Tasks from JSONL text: the parsed objects, their line numbers, and problems with unreadable lines."""
    tasks: list[Any] = []
    lines: list[int] = []
    problems: list[Problem] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if len(tasks) + len(problems) >= MAX_TASKS:  # what follows is not parsed: a spec holds MAX_TASKS at most
            problems.append(Problem("tasks_jsonl", f"more than {MAX_TASKS} tasks; the limit is {MAX_TASKS}"))
            break
        try:
            tasks.append(loads(line))
            lines.append(n)
        except json.JSONDecodeError as e:
            problems.append(Problem(f"tasks_jsonl line {n}", f"not valid JSON ({e.msg} at column {e.colno})"))
        except ValueError as e:
            problems.append(Problem(f"tasks_jsonl line {n}", f"not usable JSON: {e}"))
    return tasks, lines, problems


def parse_spec(raw: Mapping[str, Any]) -> EnvironmentSpec:
    """Validate a spec given as plain data (with `tasks` inline, or `tasks_jsonl` text); SpecError lists every problem.

    Problems of JSONL tasks name their line: `tasks_jsonl line 3.prompt: ...`.
    """
    data = dict(raw)
    problems: list[Problem] = []
    jsonl = data.pop("tasks_jsonl", None)
    lines: list[int] | None = None
    if jsonl:
        if not isinstance(jsonl, str):
            problems.append(Problem("tasks_jsonl", "must be text, one JSON task per line"))
        elif data.get("tasks"):
            problems.append(Problem("tasks_jsonl", "give tasks inline or as JSONL, not both"))
        else:
            data["tasks"], lines, bad = parse_tasks_jsonl(jsonl)
            problems += bad
    try:
        spec = EnvironmentSpec.model_validate(data)
    except ValidationError as e:
        for err in e.errors():
            loc = tuple(err["loc"])
            if lines is not None and len(loc) >= 2 and loc[0] == "tasks" and isinstance(loc[1], int):
                where = f"tasks_jsonl line {lines[loc[1]]}"
                rest = _field_path(loc[2:]) if len(loc) > 2 else ""
                path = f"{where}.{rest}" if rest else where
            else:
                path = _field_path(loc)
            problems.append(Problem(path, _message(err)))
        raise SpecError(problems) from None
    if problems:
        raise SpecError(problems)
    return spec


def load_spec_file(path: Path) -> EnvironmentSpec:
    """A spec from a YAML (or JSON) file. `tasks_file` (JSONL) and `image.dockerfile_file` are read relative to it."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError([Problem(str(path), f"cannot read: {e}")]) from None
    except yaml.YAMLError as e:
        raise SpecError([Problem(str(path), f"not valid YAML: {e}")]) from None
    if not isinstance(raw, dict):
        raise SpecError([Problem(str(path), "must hold a mapping (name, version, image, tasks, tools, scoring...)")])
    problems: list[Problem] = []

    def read(key: str, rel: Any) -> str | None:
        if not isinstance(rel, str):
            problems.append(Problem(key, "must be a file path"))
            return None
        try:
            return (path.parent / rel).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            problems.append(Problem(key, f"cannot read {rel!r}: {e}"))
            return None

    if "tasks_file" in raw:
        text = read("tasks_file", raw.pop("tasks_file"))
        if text is not None:
            raw["tasks_jsonl"] = text
    image = raw.get("image")
    if isinstance(image, dict) and "dockerfile_file" in image:
        image = dict(image)
        text = read("image.dockerfile_file", image.pop("dockerfile_file"))
        if text is not None:
            image["dockerfile"] = text
        raw["image"] = image
    try:
        spec = parse_spec(raw)
    except SpecError as e:
        raise SpecError(problems + e.problems) from None
    if problems:
        raise SpecError(problems)
    return spec
