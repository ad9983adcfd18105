"""The SkyRL environment (skyrl_gym BaseTextEnv, registered as `envfleet`) over a real orchestrator's sessions."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from orchestrator.core.errors import EpisodeFailedError
from orchestrator.server.app import Orchestrator
from orchestrator.service.registry import Registry
from tests.integrations.conftest import ENV, require

Message = dict[str, Any]


def _episode(address: str, answer: str, task_id: str = "py-004") -> tuple[list[Message], list[Message], Message]:
    skyrl_gym = require("skyrl_gym", "skyrl")
    import integrations.skyrl  # noqa: F401  (registers "envfleet")

    env = skyrl_gym.make("envfleet", env_config={"server": address, "env": ENV}, extras={"task_id": task_id})
    try:
        messages, info = env.init([{"role": "user", "content": "ignored: the environment brings its prompt"}])
        assert info["task_id"] == task_id and {t["function"]["name"] for t in info["tools"]} == {"python", "submit"}
        first = env.step(
            '<think>hmm</think>\n<tool_call>\n{"name":"python", "arguments": {"code": "print(1)"}}\n</tool_call>'
        )
        assert not first["done"] and first["reward"] == 0.0
        call = json.dumps({"name": "submit", "arguments": {"answer": answer}})
        last = env.step(f"<tool_call>{call}</tool_call>")
        assert last["done"]
        return messages, [*first["observations"], *last["observations"]], {**last, "metrics": env.get_metrics()}
    finally:
        env.close()


async def test_an_episode_scores_the_submitted_answer(orchestrator: Orchestrator, registry: Registry) -> None:
    answer = str(next(t for t in registry.get(ENV).tasks() if t.id == "py-004").data["answer"])
    messages, observations, last = await asyncio.to_thread(_episode, orchestrator.address, answer)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "<tools>" in messages[0]["content"] and '"name": "python"' in messages[0]["content"]
    assert observations[0]["role"] == "tool" and observations[0]["name"] == "python"
    assert last["reward"] == 1.0 and last["metadata"]["status"] == "OK"
    assert last["metrics"]["exact_match"] == 1.0
    _, _, wrong = await asyncio.to_thread(_episode, orchestrator.address, "not it")
    assert wrong["reward"] == 0.0 and wrong["metadata"]["status"] == "OK"  # a wrong answer is a real 0


def test_configuration_errors_are_clear() -> None:
    skyrl_gym = require("skyrl_gym", "skyrl")
    import integrations.skyrl as adapter

    with pytest.raises(ValueError, match="no envfleet environment"):
        skyrl_gym.make("envfleet", env_config={"server": "127.0.0.1:9"}, extras={})
    env = skyrl_gym.make("envfleet", env_config={"server": "127.0.0.1:9", "env": ENV}, extras={})
    with pytest.raises(RuntimeError, match=r"call init\(\) before step\(\)"):
        env.step("42")
    env.close()
    adapter.register()  # again: no error
    assert issubclass(EpisodeFailedError, RuntimeError)


async def test_an_episode_that_raises_releases_its_session(orchestrator: Orchestrator) -> None:
    # SkyRL closes an environment on success only: a step that raised (an episode that failed for the fleet's
    # reason, the server gone) held its sandbox until the session's idle expiry, and its channel for good
    skyrl_gym = require("skyrl_gym", "skyrl")
    import integrations.skyrl  # noqa: F401  (registers "envfleet")

    assert orchestrator.sessions is not None
    env = skyrl_gym.make("envfleet", env_config={"server": orchestrator.address, "env": ENV}, extras={})
    await asyncio.to_thread(env.init, [])
    assert orchestrator.sessions.open_sessions() == 1

    def broken(*args: object) -> object:
        raise EpisodeFailedError("INFRA_ERROR", "SandboxDiedError", "the sandbox died")

    env.sessions.step = broken
    with pytest.raises(EpisodeFailedError, match="the sandbox died"):
        await asyncio.to_thread(env.step, "42")
    assert orchestrator.sessions.open_sessions() == 0


def _thinking_then_calling(address: str, opened: bool = False) -> Any:
    skyrl_gym = require("skyrl_gym", "skyrl")
    import integrations.skyrl  # noqa: F401  (registers "envfleet")

    config = {"server": address, "env": ENV, "thinking_in_prompt": opened}
    env = skyrl_gym.make("envfleet", env_config=config, extras={"task_id": "py-004"})
    try:
        env.init([{"role": "user", "content": "ignored"}])
        submit = json.dumps({"name": "submit", "arguments": {"answer": "0"}})
        python = json.dumps({"name": "python", "arguments": {"code": "print(1)"}})
        # opened: the template's generation prompt opened the thinking, so the model writes only its close
        thinking = f"submit <tool_call>{submit}</tool_call> now?</think>"
        return env.step(f"{'' if opened else '<think>'}{thinking}\n<tool_call>{python}</tool_call>")
    finally:
        env.close()


@pytest.mark.parametrize("opened", [False, True])
async def test_a_call_written_while_thinking_is_not_run(orchestrator: Orchestrator, opened: bool) -> None:
    # the parser read the whole text: a submit the model only considered in its thinking ended the episode, scored
    out = await asyncio.to_thread(_thinking_then_calling, orchestrator.address, opened)
    assert not out["done"] and [m["name"] for m in out["observations"]] == ["python"], out
