"""An environment's own tools: a Tool object in its `tools`, offered to the policy with its JSON schema, run behind
it (arguments that do not fit are the policy's mistake, an observation), its own failure the environment's
(ENV_ERROR, never an infrastructure retry). The SDK exported Tool, but only built-in names were taken: passing one
raised "unhashable type: 'dict'". Real gRPC, jobs, store, and worker processes on the fake backend."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from environments.sdk import Environment, Rubric, Sandbox, ScoringContext, Task, Tool, ToolInvocation, ToolResult
from orchestrator.backends.config import FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import EnvironmentBroken, InvalidEnvironmentError, InvalidRequestError
from orchestrator.core.models import JobSpec, RolloutStatus, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.core.tools import call_tool, get_tools
from orchestrator.service.registry import Registry
from tests.conftest import TEST_OWNER
from tests.orchestrator.servers import serve

SEEN = {"north": "a lantern", "south": "a wall"}


async def _look(sandbox: Sandbox, args: Mapping[str, Any], timeout_s: float) -> ToolResult:
    return ToolResult(f"you see {SEEN[args['where']]}")


async def _boom(sandbox: Sandbox, args: Mapping[str, Any], timeout_s: float) -> ToolResult:
    raise KeyError("a bug in the tool")


LOOK = Tool(
    "look",
    "Look one way.",
    {"type": "object", "properties": {"where": {"enum": ["north", "south"]}}, "required": ["where"]},
    _look,
)
BOOM = Tool("boom", "Breaks.", {"type": "object", "properties": {}}, _boom)


def _found(ctx: ScoringContext) -> float:
    return float(ctx.episode.answer == "lantern")


class LanternEnv(Environment):
    name = "lantern"
    tools = ("submit", LOOK, BOOM)
    max_turns = 4
    rubric = Rubric([("found", _found, 1.0)])

    def tasks(self) -> Sequence[Task]:
        submit = ToolInvocation("submit", {"answer": "lantern"})
        return [
            Task("look", "Find the lantern.", reference=(ToolInvocation("look", {"where": "north"}), submit)),
            Task("misread", "Find it.", reference=(ToolInvocation("look", {"where": 3}), submit)),
            Task("broken", "Find it.", reference=(ToolInvocation("boom", {}), submit)),
        ]


@pytest.mark.parametrize("workers", [0, 1])
async def test_an_environments_own_tool_runs_behind_its_schema(tmp_path: Path, workers: int) -> None:
    backend = FakeBackendConfig(owner=TEST_OWNER)
    async with (
        serve(tmp_path, backend=backend, workers=workers, environments=[f"{__name__}:LanternEnv"]) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        (info,) = [e for e in await client.list_envs() if e.name == "lantern"]
        assert [t.name for t in info.tools] == ["submit", "look", "boom"]
        spec = JobSpec(
            env="lantern",
            tasks=TaskSelection(kind="ids", ids=["look", "misread", "broken"]),
            policy=PolicyEndpoint(base_url=REPLAY_URL),
        )
        async with asyncio.timeout(60):
            got = {r.task_id: r async for r in client.rollouts(await client.submit(spec))}
    look, misread, broken = got["look"], got["misread"], got["broken"]
    assert (look.status, look.reward) == (RolloutStatus.OK, 1.0)
    assert next(t.text for t in look.turns if t.role == "tool") == "you see a lantern"
    # the policy's arguments that do not fit: an observation, and the episode goes on
    assert misread.status == RolloutStatus.OK
    observed = next(t.text for t in misread.turns if t.role == "tool")
    assert observed == "error: the arguments do not fit look's parameters: 3 is not one of ['north', 'south']"
    # the tool's own bug: the environment's failure, once, never retried as the fleet's
    assert (broken.status, broken.reward, broken.attempts) == (RolloutStatus.ENV_ERROR, None, 1)
    assert broken.error is not None
    assert (broken.error.kind, broken.error.message) == ("KeyError", "'a bug in the tool' (in tool 'boom')")


async def _sync_run(sandbox: Sandbox, args: Mapping[str, Any], timeout_s: float) -> ToolResult:
    return ToolResult("")


@pytest.mark.parametrize(
    ("tool", "message"),
    [
        (Tool("bash", "mine", {"type": "object"}, _look), "tool 'bash' is a built-in tool's name"),
        (Tool("look around", "x", {"type": "object"}, _look), "tool name 'look around' must match"),
        (Tool("x", "x", {"type": "array"}, _look), "its parameters must be a JSON schema of type object"),
        (Tool("x", "x", {"type": "object", "properties": {"a": {"type": "strin"}}}, _look), "are no JSON schema"),
        (Tool("x", "x", {"type": "object"}, lambda s, a, t: ToolResult("")), "run must be an async def"),  # type: ignore[arg-type,return-value]
        (LOOK, "tool(s) ['look'] named more than once"),
    ],
)
def test_a_malformed_tool_is_refused_at_registration(tool: Tool, message: str) -> None:
    env = type("Bad", (LanternEnv,), {"tools": ("submit", LOOK, tool)})()
    with pytest.raises(InvalidEnvironmentError, match=re.escape(message)):
        Registry().register(env)
    Registry().register(LanternEnv())


async def test_a_schema_that_cannot_check_the_arguments_is_the_environments_failure() -> None:
    # a $ref that resolves nowhere passes check_schema, and raised at the call: an unclassified failure, INFRA_ERROR,
    # retried on fresh sandboxes and never naming the tool
    dangling = Tool("lost", "x", {"type": "object", "properties": {"a": {"$ref": "#/$defs/nowhere"}}}, _look)
    (tool,) = get_tools((dangling,))
    with pytest.raises(EnvironmentBroken, match="tool 'lost': its parameters could not check the arguments"):
        await call_tool(tool, None, '{"a": 1}', 5)  # type: ignore[arg-type]


async def _encodes(sandbox: Sandbox, args: Mapping[str, Any], timeout_s: float) -> ToolResult:
    return ToolResult(str(args["cmd"]).encode().decode())


async def test_a_tools_schema_stays_within_itself_and_its_arguments_are_the_policys_mistakes() -> None:
    # a $ref outside the schema was fetched with urlopen, no timeout, at every call
    remote = {"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/schema.json"}}}
    with pytest.raises(InvalidRequestError, match="its parameters refer outside themselves"):
        get_tools((Tool("far", "x", remote, _look),))
    # a mapping of another kind is taken as JSON (json.dumps of it failed at every listing), and a tool given again
    # is not wrapped twice
    proxied = Tool("proxied", "x", MappingProxyType({"type": "object", "properties": {}}), _look)
    (tool,) = get_tools((proxied,))
    assert type(tool.parameters) is dict and get_tools((tool,)) == [tool]
    # a lone surrogate's escape the tool cannot encode: an observation, as for a built-in tool, never ENV_ERROR
    (encoding,) = get_tools(
        (Tool("enc", "x", {"type": "object", "properties": {"cmd": {"type": "string"}}}, _encodes),)
    )
    result = await call_tool(encoding, None, '{"cmd": "\\ud800"}', 5)  # type: ignore[arg-type]
    assert "lone surrogate" in result.output
