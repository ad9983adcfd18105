"""Environments given by reference (module:ClassName), as workers and benchmarks load them, and what registration and
scoring make of an environment author's mistakes: a clear refusal at registration, or ENV_ERROR at a rollout, never
a silent replacement, an infrastructure retry, or a number made of text."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import re
from typing import Any, ClassVar

import pytest

from environments.python_tool import PythonToolEnv
from orchestrator.core.environment import Environment, Episode, Rubric, Score, ScoringContext, Task
from orchestrator.core.errors import EnvironmentBroken, InvalidEnvironmentError
from orchestrator.rollout.step import classify_failure, env_score
from orchestrator.service.registry import ENTRY_POINT_GROUP, Registry


def test_a_reference_loads_an_environment_class() -> None:
    registry = Registry()
    env = registry.load("environments.python_tool:PythonToolEnv")
    assert registry.get("python-tool") is env
    assert registry.lookup("python-tool").source == "reference:environments.python_tool:PythonToolEnv"


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("environments.python_tool", "must be module:ClassName"),
        ("no.such.module:Env", "No module named 'no'"),
        ("environments.python_tool:Nope", "has no attribute 'Nope'"),
        ("orchestrator.core.models:Turn", "is not an Environment class"),
    ],
)
def test_a_bad_reference_says_what_is_wrong(reference: str, message: str) -> None:
    with pytest.raises(InvalidEnvironmentError, match=message):
        Registry().load(reference)


def _exact(ctx: ScoringContext) -> float:
    return 1.0


class Mine(Environment):
    """An author's environment, right as it is; the tests below break one thing each."""

    name: ClassVar[str] = "mine"
    tools: ClassVar[tuple[str, ...]] = ("submit",)
    rubric: ClassVar[Any] = Rubric([("exact", _exact, 1.0)])

    def tasks(self) -> list[Task]:
        return [Task(id="t1", prompt="p")]


class Copied(PythonToolEnv):
    """python-tool copied as the model to start from, not renamed yet."""


@pytest.mark.parametrize(
    ("attribute", "value", "message"),
    [
        ("rubric", [("exact", _exact, 1.0)], "rubric is a list with no async score"),  # as the README once put it
        ("rubric", Rubric, "rubric is <class"),  # the class, never made
        ("rubric", type("SyncScore", (), {"score": lambda self, ctx: 1.0})(), "rubric is a SyncScore with no async"),
        ("max_turns", 0, "max_turns 0 must be an int in 1..1000"),  # every rollout TRUNCATED, no model call
        ("max_turns", 8.0, "max_turns 8.0 must be an int"),  # every rollout INFRA_ERROR, retried
        ("max_turns", True, "max_turns True must be an int"),
        ("tool_timeout_s", float("nan"), "tool_timeout_s nan must be a number in (0, 3600]"),
        ("tool_timeout_s", 0, "tool_timeout_s 0 must be a number"),
        # a misspelt setting was silently the default: 16 turns, bash and submit
        ("max_turn", 40, "Broken.max_turn is no setting of an Environment; did you mean 'max_turns'?"),
        ("tool", ("bash",), "did you mean 'tools'?"),
        ("rubric", Rubric([("turns", _exact, 0.0)]), "no rubric function has a weight, so every episode would score 0"),
        ("setup", lambda self, sandbox, task, seed: None, "setup must be an async def"),
        ("tasks", lambda self: [], "tasks() returned no tasks"),
        ("tasks", [Task(id="t1", prompt="p")], "tasks() must return a sequence of Task"),  # a list, not a method
        ("tasks", lambda self: [{"id": "t1", "prompt": "p"}], "tasks()[0] is {'id': 't1', 'prompt': 'p'}, not a Task"),
    ],
)
def test_an_environment_registration_refuses_what_would_fail_every_rollout(
    attribute: str, value: object, message: str
) -> None:
    broken = type("Broken", (Mine,), {attribute: value})
    with pytest.raises(InvalidEnvironmentError, match=re.escape(message)):
        Registry().register(broken())
    Registry().register(Mine())  # as it was, fine
    # an author's own attributes that only look like settings: another kind of value, or beside the setting itself
    Registry().register(type("Own", (Mine,), {"limit": 10, "workspace_dir": "/w", "names": ("a",)})())

    class Scorer:  # any object with score(ctx), as the default Environment.score calls it
        async def score(self, ctx: ScoringContext) -> Score:
            return Score(1.0)

    Registry().register(type("Duck", (Mine,), {"rubric": Scorer()})())


def test_one_name_and_version_from_two_places_is_refused_not_replaced(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # the one read last took the other's place, silently, in whatever order the entry points came
    registry = Registry()
    registry.load("environments.python_tool:PythonToolEnv")
    with pytest.raises(InvalidEnvironmentError, match=r"python-tool@1 from reference:.*Copied is already registered"):
        registry.load(f"{__name__}:Copied")
    assert registry.lookup("python-tool").source == "reference:environments.python_tool:PythonToolEnv"
    registry.load("environments.python_tool:PythonToolEnv")  # the same source again: fine
    from_entry = Registry.from_entry_points()
    from_entry.load("environments.python_tool:PythonToolEnv")  # the same class another way (a config's reference)

    points = [
        importlib.metadata.EntryPoint("python-tool", "environments.python_tool:PythonToolEnv", ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("my-env", f"{__name__}:Copied", ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint("not-mine", f"{__name__}:Mine", ENTRY_POINT_GROUP),
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: points)
    with caplog.at_level(logging.WARNING, logger="orchestrator.service.registry"):
        registry = Registry.from_entry_points()
    assert registry.lookup("python-tool").source == "entry-point:environments.python_tool:PythonToolEnv"
    assert registry.get("mine").name == "mine"
    assert "my-env (tests.orchestrator.test_registry:Copied) failed to load" in caplog.text
    assert "not-mine (tests.orchestrator.test_registry:Mine) registers mine@1" in caplog.text


def test_a_rubric_with_two_functions_of_one_name_is_refused() -> None:
    # the second's value took the first's place in the components, while the reward summed both
    with pytest.raises(ValueError, match="rubric function names are not unique"):
        Rubric([("exact", _exact, 1.0), ("exact", _exact, 0.5)])


@pytest.mark.parametrize(
    ("functions", "message"),
    [
        ([("exact", _exact)], "rubric function 0 is .*, not a \\(name, function, weight\\) tuple"),
        ([("exact", 1.0, _exact)], "rubric function 'exact': 1.0 is not callable"),
        ([("exact", _exact, "1")], "rubric function 'exact': its weight '1' is not a finite number"),
        ([("exact", _exact, float("nan"))], "its weight nan is not a finite number"),
        ([("", _exact, 1.0)], "rubric function 0: its name '' is not a non-empty string"),
    ],
)
def test_a_rubric_says_which_function_is_wrong(functions: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Rubric(functions)


async def test_a_rubric_made_of_an_iterator_keeps_its_functions() -> None:
    # the uniqueness check used the iterator up: every rollout scored 0.0, with no components, and registered fine
    rubric = Rubric(zip(["exact", "turns"], [_exact, _exact], [1.0, 0.0], strict=True))  # type: ignore[arg-type]
    assert await rubric.score(None) == Score(1.0, {"exact": 1.0}, {"turns": 1.0})  # type: ignore[arg-type]
    assert Rubric([["exact", _exact, 1.0]]).functions == (("exact", _exact, 1.0),)  # type: ignore[list-item]


async def test_a_reward_function_that_raises_is_named_in_the_rollouts_error(caplog: pytest.LogCaptureFixture) -> None:
    # a KeyError's "'answr'" alone reached the trainer, and the server logged nothing: no function, no line
    def typo(ctx: ScoringContext) -> float:
        return float({"answer": 1}["answr"])

    env = type("Typo", (Mine,), {"rubric": Rubric([("exact", _exact, 1.0), ("typo", typo, 1.0)])})()
    with caplog.at_level(logging.WARNING, logger="orchestrator.rollout.step"):
        for _ in range(2):
            with pytest.raises(EnvironmentBroken) as e:
                await env_score(env, None, env.tasks()[0], Episode([], "", "submit"))  # type: ignore[arg-type]
            status, error = classify_failure(e.value)
            assert (status.value, error.kind, error.message) == (
                "ENV_ERROR",
                "KeyError",
                "'answr' (in reward function 'typo')",
            )
    # its traceback once, for the author (the second rollout's failure at the same place is not logged again)
    assert caplog.text.count('["answr"]') == 1 and "in typo" in caplog.text
    np = __import__("numpy")
    funcs = [("half", lambda ctx: np.float32(0.5), 1.0), ("close", lambda ctx: np.isclose(1.0, 1.0), 1.0)]
    three = type("Numpy", (Mine,), {"rubric": Rubric(funcs)})()
    assert (await env_score(three, None, three.tasks()[0], Episode([], "", "submit"))).reward == 1.5  # type: ignore[arg-type]
    none_rubric = Rubric([("exact", lambda ctx: None, 1.0)])  # type: ignore[list-item, return-value]
    nothing = type("Nothing", (Mine,), {"rubric": none_rubric})()
    with pytest.raises(EnvironmentBroken, match="reward function 'exact' returned None, not a number"):
        await env_score(nothing, None, nothing.tasks()[0], Episode([], "", "submit"))  # type: ignore[arg-type]


class Scoring(Mine):
    async def score(self, sandbox: Any, task: Task, episode: Episode) -> Any:
        return await self.outcome()

    async def outcome(self) -> Any:
        raise NotImplementedError


async def _scored(outcome: Any) -> Any:
    async def give() -> Any:
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    env = Scoring()
    env.outcome = give  # type: ignore[method-assign]
    return await env_score(env, None, env.tasks()[0], Episode([], "", "submit"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("outcome", "message"),
    [
        (1.0, "mine@1.score returned a float, not a Score"),  # an AttributeError outside it: INFRA_ERROR, retried
        (TimeoutError("the grader's own wait_for"), "TimeoutError: the grader's own wait_for"),  # TIMEOUT before
    ],
)
async def test_an_environments_wrong_result_or_own_timeout_is_env_error(outcome: Any, message: str) -> None:
    with pytest.raises(EnvironmentBroken, match=message) as e:
        await _scored(outcome)
    assert classify_failure(e.value)[0].value == "ENV_ERROR"
    assert await _scored(Score(1.0)) == Score(1.0)


async def test_a_reward_function_that_returns_text_is_env_error_not_a_number() -> None:
    # float("1") is 1.0: a function that returned the sandbox's output undecoded, or a string, was a reward
    rubric = Rubric([("exact", lambda ctx: "1", 1.0)])  # type: ignore[list-item, return-value]
    env = type("Texty", (Mine,), {"rubric": rubric})()
    with pytest.raises(EnvironmentBroken, match="reward function 'exact' returned str '1', not a number"):
        await env_score(env, None, env.tasks()[0], Episode([], "", "submit"))  # type: ignore[arg-type]
    numbers = Rubric([("passed", lambda ctx: True, 1.0), ("rate", lambda ctx: asyncio.sleep(0, 0.5), 1.0)])
    env = type("Numbers", (Mine,), {"rubric": numbers})()
    assert (await env_score(env, None, env.tasks()[0], Episode([], "", "submit"))).reward == 1.5  # type: ignore[arg-type]
