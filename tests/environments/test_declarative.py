"""Declarative specs without a server: parsing, every problem with its path, YAML files, the scoring contract."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from orchestrator.core.sandbox import ExecResult
from orchestrator.service.declarative import SpecError, load_spec_file, make_environment, parse_spec
from orchestrator.service.declarative.env import image_name, parse_score
from orchestrator.service.declarative.errors import ScoringError


def minimal(**kw: Any) -> dict[str, Any]:
    return {
        "name": "demo",
        "version": "1",
        "tools": ["bash", "submit"],
        "tasks": [{"id": "t1", "prompt": "do it", "reference": [{"name": "submit", "arguments": {"answer": "x"}}]}],
        "scoring": {"command": "true"},
        **kw,
    }


def problems(raw: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as e:
        parse_spec(raw)
    return [str(p) for p in e.value.problems]


def test_a_minimal_spec_becomes_an_environment() -> None:
    spec = parse_spec(minimal())
    env = make_environment(spec)
    assert env.ref() == "demo@1" and env.tools == ("bash", "submit") and env.limits.memory_mb == 512
    (task,) = env.tasks()
    assert task.id == "t1" and task.reference[0].name == "submit"
    assert env.image_spec() is None and env.image_description() == "envfleet/base"
    assert type(env) is not type(make_environment(parse_spec(minimal(version="2"))))  # one class per spec
    assert image_name("a..b_c-") == "env-a-b-c"


def test_every_problem_is_listed_with_its_path() -> None:
    raw = minimal(
        tools=["bash", "nope"],
        limits={"memory_mb": 0, "pids": -1},
        tool_timeout_s=1e12,
        image={"files": {"/a/../../etc/shadow": "x"}, "packages": ["Bad Pkg"]},
    )
    raw.pop("scoring")
    raw["tasks"].append({"id": "t2", "prompt": "", "files": {"/abs": "x"}})
    got = problems(raw)
    for fragment in (
        "image.packages: 'Bad Pkg' is not a Debian package name",
        "image.files: file path '/a/../../etc/shadow' must not contain '..' (path traversal)",
        "tasks[1].prompt: String should have at least 1 character",
        "tasks[1].files: task file '/abs' must be relative",
        "tools: unknown tool(s) ['nope']",
        "scoring: Field required",
        "limits.memory_mb: Input should be greater than or equal to 16 (got 0)",
        "limits.pids: Input should be greater than or equal to 8 (got -1)",
        "tool_timeout_s: Input should be less than or equal to 3600",
    ):
        assert any(fragment in p for p in got), (fragment, got)


def test_cross_field_and_image_rules() -> None:
    assert problems(minimal(tools=["bash"])) == [
        "spec: tasks[0].reference calls ['submit'], which are not in tools ['bash']"
    ]
    assert (
        "give either dockerfile, or base/packages/files/setup/env"
        in problems(minimal(image={"dockerfile": "FROM envfleet/base:latest", "setup": ["true"]}))[0]
    )
    assert "must be an envfleet image" in problems(minimal(image={"base": "debian:12"}))[0]
    assert "no FROM line" in problems(minimal(image={"dockerfile": "RUN true"}))[0]
    assert problems(minimal(scoring={"command": "x", "timeout_s": float("nan")}))[0].startswith("scoring.timeout_s")


def test_jsonl_tasks_are_reported_by_line() -> None:
    raw = minimal()
    raw.pop("tasks")
    raw["tasks_jsonl"] = '{"id": "a", "prompt": "p"}\n\nnot json\n{"id": "b"}\n'
    assert problems(raw) == [
        "tasks_jsonl line 3: not valid JSON (Expecting value at column 1)",
        "tasks_jsonl line 4.prompt: Field required",
    ]
    both = minimal(tasks_jsonl='{"id": "a", "prompt": "p"}')
    assert problems(both) == ["tasks_jsonl: give tasks inline or as JSONL, not both"]


def test_yaml_file_with_task_and_dockerfile_files(tmp_path: Path) -> None:
    (tmp_path / "tasks.jsonl").write_text(json.dumps({"id": "a", "prompt": "p"}) + "\n")
    (tmp_path / "Dockerfile").write_text("FROM envfleet/base:latest\nRUN true\n")
    (tmp_path / "spec.yaml").write_text(
        "name: demo\nversion: '1'\ntools: [submit]\ntasks_file: tasks.jsonl\n"
        "image: {dockerfile_file: Dockerfile}\nscoring: {command: 'echo {}'}\n"
    )
    spec = load_spec_file(tmp_path / "spec.yaml")
    assert [t.id for t in spec.tasks] == ["a"] and spec.image.dockerfile == "FROM envfleet/base:latest\nRUN true\n"
    (tmp_path / "bad.yaml").write_text("name: demo\ntasks_file: missing.jsonl\n")
    with pytest.raises(SpecError, match=r"tasks_file: cannot read 'missing\.jsonl'"):
        load_spec_file(tmp_path / "bad.yaml")


@pytest.mark.parametrize(
    ("stdout", "exit_code", "expected"),
    [
        (
            b'log line\n{"reward": 0.5, "tests": 3, "label": "x", "flag": true}\n',
            0,
            (0.5, {"tests": 3.0, "flag": 1.0}),
        ),  # a bool is 1 or 0; text is left out
        (b'{"reward": 1}', 0, (1.0, {})),
    ],
)
def test_scoring_output(stdout: bytes, exit_code: int, expected: tuple[float, dict[str, float]]) -> None:
    score = parse_score(ExecResult(exit_code, stdout, b""), 10)
    assert (score.reward, score.components) == expected


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (ExecResult(1, b"", b"Traceback: boom"), "exited with code 1: Traceback: boom"),
        (ExecResult(0, b"reward=1", b""), 'finite numeric "reward"'),
        (ExecResult(0, b'{"reward": NaN}', b""), 'finite numeric "reward"'),
        (ExecResult(0, b'{"reward": "1"}', b""), 'finite numeric "reward"'),
        (ExecResult(-1, b"", b"", timed_out=True), "timed out after 10s"),
    ],
)
def test_scoring_failures_are_environment_errors(result: ExecResult, message: str) -> None:
    with pytest.raises(ScoringError, match=message):
        parse_score(result, 10)
