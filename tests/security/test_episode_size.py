"""Neither a policy nor a session's tenant can write an episode without end. A policy's answer may be up to 32 MiB
and max_turns up to 1000: in this process's rollouts (workers=0) the whole episode went to the result log, on the
host's disk; on a worker, an encoded rollout over 16 MiB was refused as an infrastructure failure, masked from
training, which a policy can learn to reach instead of a low reward. A session's action may be 4 Mi characters, and
its steps were kept in memory until the session ended. An episode keeps at most EPISODE_BYTES, counted as the log's
JSON holds it (a control character is six bytes there); past that it ends TRUNCATED and is scored. So does a
conversation the inference server refuses as over the model's context (a 400 saying so, from vLLM or SGLang).

Through real processes: the scripted policy server, the real gRPC server on the fake backend, in this process and
on a worker process, and the trainer's stream; a session over the real gRPC API."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import Rollout, RolloutStatus
from orchestrator.rollout.step import EPISODE_BYTES
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step, start_scripted_server
from orchestrator.worker.results import MAX_ROLLOUT_BYTES
from protos import orchestrator_pb2 as pb
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, serve


@pytest.mark.parametrize("workers", [0, 1], ids=["in-process", "worker"])
@pytest.mark.parametrize(
    ("content", "json_bytes"),
    [("x" * (2 << 20), 2 << 20), ("\x01" * (1 << 19), 6 << 19)],
    ids=["text", "escaped"],
)
async def test_a_policy_that_writes_without_end_is_truncated_and_scored(
    tmp_path: Path, workers: int, content: str, json_bytes: int
) -> None:
    # every turn writes `content` and calls a tool the environment does not have (answered at once), for as many
    # turns as python-tool allows (8): 16 MiB of text, or 24 MiB once escaped
    script = Script(default=[Step(content=content, tool_calls=[ScriptedToolCall(name="nothing")])] * 16)
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    async with (
        await start_scripted_server(script, tokens=False) as scripted,
        serve(tmp_path / "data", backend=FAKE, workers=workers) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        job_id = await client.submit(job(scripted.url, [task_id], max_turns=16))
        async with asyncio.timeout(120):
            [rollout] = [r async for r in client.rollouts(job_id)]
    assert rollout.status == RolloutStatus.TRUNCATED, rollout.error
    assert rollout.reward is not None  # scored as a cut episode is, not masked
    written = [t for t in rollout.turns if t.role == "assistant"]
    # the turn that would cross the budget is dropped whole: as many turns as fit, and no more
    assert len(written) == EPISODE_BYTES // json_bytes - 1 or len(written) == EPISODE_BYTES // json_bytes
    assert len(rollout.model_dump_json()) <= EPISODE_BYTES + (1 << 20) < MAX_ROLLOUT_BYTES


async def test_a_session_that_writes_without_end_is_truncated_and_scored(tmp_path: Path) -> None:
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    arguments = '{"code": "' + "x" * (3 << 20) + '"}'  # a 3 MiB tool call: the first two fit, the third does not
    async with serve(tmp_path / "data", backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        session = await client.session_stub.Reset(pb.ResetRequest(env=ENV, task_id=task_id, max_turns=100))
        steps = []
        for n in range(3):
            call = pb.ToolCall(id=f"c{n}", name="nothing", arguments=arguments)
            steps.append(
                await client.session_stub.Step(
                    pb.StepRequest(session_id=session.session_id, action=pb.Action(tool_call=call)), timeout=60
                )
            )
    assert [s.status for s in steps[:2]] == [pb.ROLLOUT_STATUS_UNSPECIFIED] * 2  # still running
    last = steps[2]
    assert last.status == pb.ROLLOUT_STATUS_TRUNCATED and last.truncated and not last.terminated
    assert last.HasField("reward")  # scored, as a cut episode is
    assert last.info.turn == 2  # the step that would cross the budget is not kept


async def _one_rollout(tmp_path: Path, script: Script) -> Rollout:
    """The rollout of a one-task job of the python tool against the scripted policy (chat mode, no token ids)."""
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    async with (
        await start_scripted_server(script, tokens=False) as scripted,
        serve(tmp_path / "data", backend=FAKE) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        job_id = await client.submit(job(scripted.url, [task_id]))
        async with asyncio.timeout(60):
            [rollout] = [r async for r in client.rollouts(job_id)]
    return rollout


# what vLLM answers a request over the model's context (vllm-project/vllm#20409), and SGLang
VLLM_CONTEXT = (
    "This model's maximum context length is 32768 tokens. However, you requested 33792 tokens (32768 in the "
    "messages, 1024 in the completion). Please reduce the length of the messages or completion."
)
SGLANG_CONTEXT = "The input (40000 tokens) is longer than the model's context length (32768 tokens)."


@pytest.mark.parametrize(
    ("message", "status"),
    [
        (VLLM_CONTEXT, RolloutStatus.TRUNCATED),
        (SGLANG_CONTEXT, RolloutStatus.TRUNCATED),
        ("Invalid 'tools': unknown parameter", RolloutStatus.POLICY_ERROR),  # any other 400 stays a failure
    ],
    ids=["vllm", "sglang", "other"],
)
async def test_a_conversation_over_the_models_context_is_truncated_and_scored(
    tmp_path: Path, message: str, status: RolloutStatus
) -> None:
    # the policy's observations grow the conversation until the server refuses it: in chat mode that 400 was a
    # POLICY_ERROR, masked, where the token-in, token-out client (which counts) ended the episode TRUNCATED
    call = Step(tool_calls=[ScriptedToolCall(name="python", arguments={"code": "print(1)"})])
    rollout = await _one_rollout(tmp_path, Script(default=[call, Step(error_status=400, error_message=message)]))
    assert rollout.status == status, rollout.error
    if status == RolloutStatus.TRUNCATED:
        assert rollout.reward == 0.0 and [t.role for t in rollout.turns][-2:] == ["assistant", "tool"]
    else:
        assert rollout.reward is None and rollout.error is not None and "HTTP 400" in rollout.error.message


async def test_a_first_prompt_over_the_models_context_is_a_policy_error_never_scored(tmp_path: Path) -> None:
    # the server refuses the task's very first request (the job's max_tokens, or its prompt, is over the model's
    # context): the episode ended TRUNCATED before the policy acted, and its empty answer was scored 0 as if it had
    # tried, every rollout of the job alike
    rollout = await _one_rollout(tmp_path, Script(default=[Step(error_status=400, error_message=VLLM_CONTEXT)]))
    assert rollout.status == RolloutStatus.POLICY_ERROR and rollout.reward is None
    assert rollout.error is not None and "first prompt does not fit the model's context" in rollout.error.message


@pytest.mark.parametrize(("calls", "name"), [(2000, ""), (20, "n" * 200_000)], ids=["many-calls", "long-names"])
def test_the_episode_budget_counts_what_the_rollout_holds(calls: int, name: str) -> None:
    # the budget counted texts and arguments only: 2,000 calls a turn, or 20 with junk names of 200k characters, took
    # a rollout within it to 19-27 MiB, over what a worker may send, and a scored rollout was an INFRA_ERROR, masked,
    # on workers alone (the same one was scored by the control plane's own runner)
    from orchestrator.core.models import ToolCallRecord, Turn
    from orchestrator.rollout.step import EpisodeState, record_assistant

    state = EpisodeState({}, [])
    turn = 0
    while True:
        made = [ToolCallRecord(id=f"call-{turn}-{i}", name=name, arguments="{}") for i in range(calls)]
        if not state.fits("", *(x for c in made for x in (c.arguments, c.name, c.id)), calls=len(made)):
            break
        record_assistant(state, "", made)
        for c in made:
            state._keep(Turn(role="tool", text="error: unknown tool", tool_call_id=c.id, name=c.name))
        turn += 1
    rollout = Rollout(
        id="j:t:0",
        job_id="j",
        env="e",
        task_id="t",
        group_id="j:t",
        sample_index=0,
        status=RolloutStatus.TRUNCATED,
        reward=0.0,
        turns=state.turns,
    )
    assert turn > 0
    assert len(rollout.model_dump_json().encode()) <= EPISODE_BYTES < MAX_ROLLOUT_BYTES


def test_the_opening_messages_count_in_the_episodes_budget() -> None:
    # the opening turns (the environment's prompt) were added to the turns but not to the cheap bound, so an episode
    # with a 7 MiB prompt took a 1 MiB turn (6 MiB by the bound) and went past EPISODE_BYTES
    from orchestrator.rollout.step import EpisodeState, record_opening

    env = Registry.from_entry_points().get(ENV)
    state = EpisodeState.start(env)
    record_opening(state, [{"role": "system", "content": "s"}, {"role": "user", "content": "p" * (7 << 20)}])
    assert [t.role for t in state.turns] == ["system", "user"]
    assert not state.fits("x" * (1 << 20))
    assert state.fits("x" * (512 << 10))


async def test_opening_messages_over_the_budget_are_the_environments_error() -> None:
    # counted now, an opening over the budget made the first turn's fits() fail after a paid generation: an empty
    # episode scored TRUNCATED, which is no outcome of the policy's
    from orchestrator.core.errors import EnvironmentBroken
    from orchestrator.core.policy import Sampling
    from orchestrator.rollout.episode import run_episode

    base = Registry.from_entry_points().get(ENV)

    class Huge(type(base)):  # type: ignore[misc]
        def messages(self, task: object) -> list[dict[str, str]]:
            return [{"role": "user", "content": "p" * (9 << 20)}]

    class NoCall:
        async def complete(self, *a: object, **k: object) -> None:
            raise AssertionError("the policy was asked")

        def for_episode(self, **k: object) -> NoCall:
            return self

    with pytest.raises(EnvironmentBroken, match="over the episode's budget"):
        await run_episode(Huge(), base.tasks()[0], None, NoCall(), Sampling(), 4, "r", [])  # type: ignore[arg-type]
