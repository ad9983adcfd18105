"""A malformed tool call is the policy's, and earns its score. In chat mode each assistant call goes back to the
server in the next request, and servers decode its arguments to render the conversation (vLLM json.loads each one):
text that was no JSON got the next request a 400, the episode ended POLICY_ERROR, masked, and the malformed call
escaped the 0 it earned. The call still runs with what the model wrote (the tool's answer says what is wrong); the
request carries "{}" in its place. The scripted server decodes the arguments as vLLM does."""

from __future__ import annotations

import asyncio
from pathlib import Path

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import RolloutStatus
from orchestrator.rollout.policy.parsing import parse_chat_completion
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step, start_scripted_server
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, serve


def _call(call_id: str, arguments: str) -> dict[str, object]:
    return {"id": call_id, "type": "function", "function": {"name": "python", "arguments": arguments}}


def test_a_call_whose_arguments_are_no_json_object_goes_back_as_an_empty_object() -> None:
    written = ["not json", '"a string"', "[1, 2]", "[" * 5000, '{"code": "print(1)"}']
    message = {"role": "assistant", "content": None, "tool_calls": [_call(f"c{i}", a) for i, a in enumerate(written)]}
    c = parse_chat_completion({"choices": [{"finish_reason": "tool_calls", "message": message}]}, model="m")
    assert [t.arguments for t in c.tool_calls] == written  # the tools get what the model wrote
    echoed = [w["function"]["arguments"] for w in c.raw_message["tool_calls"]]
    assert echoed == ["{}", "{}", "{}", "{}", '{"code": "print(1)"}']


async def test_a_malformed_call_is_answered_and_the_episode_scored(tmp_path: Path) -> None:
    task = Registry.from_entry_points().get(ENV).tasks()[0]
    submit = next(inv for inv in task.reference if inv.name == "submit")
    malformed = {"message": {"role": "assistant", "content": None, "tool_calls": [_call("c0", "print(1")]}}
    script = Script(
        tasks={
            task.id: [
                Step(choice_fields={**malformed, "finish_reason": "tool_calls"}),
                Step(tool_calls=[ScriptedToolCall(name="submit", arguments=dict(submit.arguments))]),
            ]
        }
    )
    async with (
        await start_scripted_server(script) as scripted,
        serve(tmp_path / "data", backend=FAKE) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        job_id = await client.submit(job(scripted.url, [task.id]))
        async with asyncio.timeout(90):
            (rollout,) = [r async for r in client.rollouts(job_id)]
    assert rollout.status == RolloutStatus.OK and rollout.reward == 1.0, rollout.error
    observed = [t.text for t in rollout.turns if t.role == "tool"]
    assert observed and "JSON" in observed[0], observed
