"""SessionService over real gRPC: an episode to its end and the gymnasium wrapper under gymnasium's own checker on real
sandboxes; truncation, bad requests, failures that are never a reward, and expiry (bookkeeping) on the fake backend."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import docker
import grpc
import pytest
from gymnasium.utils.env_checker import check_env

from integrations.session import AsyncSessions, SyncSessions
from orchestrator.backends.config import FakeBackendConfig
from orchestrator.backends.fake import FakeBackend, FakeExec
from orchestrator.client.gym import SessionEnv, parse_action
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Environment, Rubric, ScoringContext, Task, ToolInvocation
from orchestrator.core.errors import SandboxDiedError
from orchestrator.core.models import JobSpec, RolloutStatus, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.core.sandbox import ExecResult
from orchestrator.rollout.policy.base import ToolCall
from orchestrator.server.app import Orchestrator
from orchestrator.service.registry import Registry
from protos import orchestrator_pb2 as pb
from tests.conftest import TEST_OWNER
from tests.orchestrator.conftest import ENV
from tests.orchestrator.servers import FAKE, expect_error, serve


def tool(name: str, **arguments: object) -> pb.Action:
    return pb.Action(tool_call=pb.ToolCall(name=name, arguments=json.dumps(arguments)))


async def test_episode_to_terminal_with_reward_and_status(client: EnvfleetClient, registry: Registry) -> None:
    task = registry.get(ENV).tasks()[0]
    code, answer = task.reference[0].arguments["code"], str(task.data["answer"])
    stub = client.session_stub
    r = await stub.Reset(pb.ResetRequest(env=ENV, task_id=task.id))
    assert r.observation.text == task.prompt
    assert [m.role for m in r.observation.messages] == ["system", "user"]
    assert [t.name for t in r.observation.tools] == ["python", "submit"]
    assert json.loads(r.observation.tools[0].parameters_json)["required"] == ["code"]
    assert (r.info.env, r.info.task_id, r.info.turn) == ("python-tool@1", task.id, 0)
    sid = r.session_id

    s = await stub.Step(pb.StepRequest(session_id=sid, action=tool("python", code=code)))
    assert s.observation.strip() == answer
    assert s.reward == 0.0 and not s.terminated and not s.truncated and s.status == pb.ROLLOUT_STATUS_UNSPECIFIED
    s = await stub.Step(pb.StepRequest(session_id=sid, action=tool("bash", command="ls")))
    assert "unknown tool 'bash'" in s.observation and not s.terminated
    s = await stub.Step(pb.StepRequest(session_id=sid, action=tool("submit", answer=answer)))
    assert s.terminated and not s.truncated and s.status == pb.ROLLOUT_STATUS_OK
    assert s.HasField("reward") and s.reward == 1.0
    assert dict(s.reward_components) == {"exact_match": 1.0} and s.metrics["tool_calls"] == 3.0
    assert s.info.turn == 3

    await expect_error(
        stub.Step(pb.StepRequest(session_id=sid, action=tool("python", code="1"))),
        grpc.StatusCode.FAILED_PRECONDITION,
        "has ended (OK)",
    )
    assert not (await stub.Close(pb.CloseSessionRequest(session_id=sid))).was_running
    await expect_error(
        stub.Step(pb.StepRequest(session_id=sid, action=tool("python", code="1"))),
        grpc.StatusCode.NOT_FOUND,
        "was closed",
    )


async def test_final_answer_turn_limit_and_bad_requests(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, registry: Registry
) -> None:
    stub = fake_client.session_stub  # the session's bookkeeping: no command output is looked at
    r = await stub.Reset(pb.ResetRequest(env=ENV, seed=7))
    again = await stub.Reset(pb.ResetRequest(env=ENV, seed=7))
    assert r.info.task_id == again.info.task_id  # a seed picks the same task
    s = await stub.Step(pb.StepRequest(session_id=r.session_id, action=pb.Action(final_answer="no idea")))
    assert s.terminated and s.status == pb.ROLLOUT_STATUS_OK and s.reward == 0.0  # a wrong answer is a scored 0

    t = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-001", max_turns=1))
    s = await stub.Step(pb.StepRequest(session_id=t.session_id, action=tool("python", code="print(1)")))
    assert s.truncated and not s.terminated and s.status == pb.ROLLOUT_STATUS_TRUNCATED and s.reward == 0.0
    assert fake_orchestrator.pool is not None  # a session's tool call is in the same histogram as a job's
    assert fake_orchestrator.pool.metrics.registry.get_sample_value("envfleet_tool_exec_seconds_count") == 1
    assert (await stub.Close(pb.CloseSessionRequest(session_id=again.session_id))).was_running

    await expect_error(stub.Reset(pb.ResetRequest(env="pyhton-tool")), grpc.StatusCode.NOT_FOUND, "did you mean")
    await expect_error(stub.Reset(pb.ResetRequest(env=ENV, task_id="nope")), grpc.StatusCode.INVALID_ARGUMENT, "nope")
    await expect_error(
        stub.Reset(pb.ResetRequest(env=ENV, max_turns=-1)), grpc.StatusCode.INVALID_ARGUMENT, "max_turns"
    )
    # more turns than the environment allows is the environment's number, as a job's rollouts get
    longer = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-001", max_turns=1000))
    assert longer.info.max_turns == registry.get(ENV).max_turns < 1000
    await expect_error(stub.Step(pb.StepRequest(session_id="x" * 24)), grpc.StatusCode.INVALID_ARGUMENT, "action")
    await expect_error(
        stub.Step(pb.StepRequest(session_id="x" * 24, action=pb.Action(final_answer=""))),
        grpc.StatusCode.NOT_FOUND,
        "no session",
    )


async def test_infrastructure_failure_is_never_a_reward(
    client: EnvfleetClient, docker_client: docker.DockerClient
) -> None:
    stub = client.session_stub
    r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-002"))
    s = await stub.Step(
        pb.StepRequest(
            session_id=r.session_id, action=tool("python", code="import socket; print(socket.gethostname())")
        )
    )
    container = s.observation.strip()  # docker's default hostname: the container id's first 12 characters
    await asyncio.to_thread(docker_client.api.kill, container)
    s = await stub.Step(pb.StepRequest(session_id=r.session_id, action=tool("python", code="print(1)")))
    assert s.status == pb.ROLLOUT_STATUS_INFRA_ERROR and not s.HasField("reward")
    assert s.truncated and not s.terminated and s.error.kind == "SandboxDiedError", s.error


async def test_idle_sessions_expire(tmp_path: Path) -> None:
    # steps come every 0.4 s, well inside the 1 s TTL even on a loaded host; the other session idles past it
    async with (
        serve(tmp_path, backend=FAKE, sessions={"idle_ttl_s": 1.0}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        stub = client.session_stub
        r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        live = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        for _ in range(4):  # steps keep a session alive
            await asyncio.sleep(0.4)
            await stub.Step(pb.StepRequest(session_id=live.session_id, action=tool("python", code="print(1)")))
        await expect_error(
            stub.Step(pb.StepRequest(session_id=r.session_id, action=pb.Action(final_answer="1"))),
            grpc.StatusCode.NOT_FOUND,
            "expired after 1s idle",
        )
        await expect_error(
            stub.Close(pb.CloseSessionRequest(session_id=r.session_id)), grpc.StatusCode.NOT_FOUND, "expired"
        )
        await asyncio.sleep(1.5)
        assert orch.sessions is not None and orch.sessions.open_sessions() == 0  # the reaper took the idle one too


@pytest.mark.parametrize("found_by", ["the step", "the health check"])
async def test_a_sandbox_killed_mid_session_is_never_a_reward(tmp_path: Path, found_by: str) -> None:
    # found by the next step, or by the health check between steps (until then, the idle expiry of 600 s, it held
    # its capacity and the tenant's slot): the step answers the same either way, INFRA_ERROR
    used: list[str] = []

    def remember(cmd: FakeExec) -> ExecResult:
        used.append(cmd.sandbox_name)
        return ExecResult(0, cmd.stdin, b"")

    backend = FakeBackendConfig(owner=TEST_OWNER, exec_handler=remember)
    probe_s = 0.2 if found_by == "the health check" else 3600.0
    async with (
        serve(tmp_path, backend=backend, sessions={"probe_interval_s": probe_s}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        stub = client.session_stub
        r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-002"))
        s = await stub.Step(pb.StepRequest(session_id=r.session_id, action=tool("python", code="print(2)")))
        assert s.observation == "print(2)" and not s.terminated
        assert isinstance(orch.backend, FakeBackend) and orch.sessions is not None
        [victim] = [sb.id for sb in await orch.backend.list_owned() if sb.name == used[0]]
        orch.backend.kill(victim)
        if found_by == "the health check":
            for _ in range(50):
                if orch.sessions.open_sessions() == 0:
                    break
                await asyncio.sleep(0.1)
            assert orch.sessions.open_sessions() == 0 and orch.jobs.scheduler.reserved == 0
        s = await stub.Step(pb.StepRequest(session_id=r.session_id, action=tool("python", code="print(1)")))
    assert s.status == pb.ROLLOUT_STATUS_INFRA_ERROR and not s.HasField("reward")
    assert s.truncated and not s.terminated and s.error.kind == "SandboxDiedError", s.error
    if found_by == "the health check":
        assert "the sandbox died between steps" in s.error.message
        assert used.count(used[0]) == 1  # the step ran nothing on the dead sandbox


async def test_a_session_closed_during_a_step_answers_its_steps_not_found_and_goes_back_once(tmp_path: Path) -> None:
    # a close while a step ran destroyed the sandbox under it: the step answered INFRA_ERROR (or a reward, had it
    # been scoring), the one queued behind it ran on the closed session, and both returned the sandbox to the pool
    # again, so the pool's busy count fell one too low each time
    backend = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=0.5)
    async with serve(tmp_path, backend=backend) as orch, EnvfleetClient(orch.address) as client:
        stub = client.session_stub
        a = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-001"))  # another, still open
        running, queued = (
            stub.Step(pb.StepRequest(session_id=a.session_id, action=tool("python", code="print(1)"))) for _ in "ab"
        )
        await asyncio.sleep(0.2)
        assert (await stub.Close(pb.CloseSessionRequest(session_id=a.session_id))).was_running
        await expect_error(running, grpc.StatusCode.NOT_FOUND, "was closed")
        await expect_error(queued, grpc.StatusCode.NOT_FOUND, "was closed")
        assert orch.sessions is not None and orch.pool is not None
        assert orch.sessions.open_sessions() == 1 and orch.pool.busy == 1


async def test_a_close_while_the_ending_steps_sandbox_is_recycled_keeps_the_steps_reward(tmp_path: Path) -> None:
    # the step had scored the episode and was resetting its sandbox for the next session when the close came: the
    # close answered "ended", and the step answered NOT_FOUND, its reward thrown away
    backend = FakeBackendConfig(owner=TEST_OWNER, reset_latency_s=2.0)
    async with serve(tmp_path, backend=backend) as orch, EnvfleetClient(orch.address) as client:
        stub = client.session_stub
        r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        ending = asyncio.ensure_future(
            stub.Step(pb.StepRequest(session_id=r.session_id, action=pb.Action(final_answer="no idea")))
        )
        await asyncio.sleep(0.5)  # scored; its sandbox is being reset
        assert not ending.done()
        assert not (await stub.Close(pb.CloseSessionRequest(session_id=r.session_id))).was_running
        s = await ending
        assert s.terminated and s.status == pb.ROLLOUT_STATUS_OK and s.HasField("reward") and s.reward == 0.0
        assert orch.pool is not None and orch.pool.busy == 0


async def test_a_session_whose_steps_overlap_still_ends_at_its_lifetime(tmp_path: Path) -> None:
    # the expiry checks skip a session while a step holds it: a client that sent each step before the last one
    # ended was never checked, and its session outlived max_lifetime_s until the sweep took its sandbox mid-step
    backend = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=0.5)
    async with (
        serve(tmp_path, backend=backend, sessions={"max_lifetime_s": 1.0}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        stub = client.session_stub
        r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))

        def step() -> grpc.aio.UnaryUnaryCall:
            return stub.Step(pb.StepRequest(session_id=r.session_id, action=tool("python", code="print(1)")))

        pending = step()
        for _ in range(6):  # 3 s of steps, each sent while the one before it runs
            await asyncio.sleep(0.25)
            following = step()
            with contextlib.suppress(grpc.aio.AioRpcError):
                await pending
            pending = following
        await expect_error(pending, grpc.StatusCode.NOT_FOUND, "maximum session lifetime")
        assert orch.sessions is not None and orch.sessions.open_sessions() == 0


async def test_a_step_whose_call_is_cancelled_runs_to_its_end(tmp_path: Path) -> None:
    # cut by its client's deadline during the tool call, the step left the assistant's call without its tool turn,
    # and the next step reused its id (call-0): the transcript the scorer reads had two calls of one id, one unanswered
    backend = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=1.0)
    async with serve(tmp_path, backend=backend) as orch, EnvfleetClient(orch.address) as client:
        stub = client.session_stub
        r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        cut = stub.Step(pb.StepRequest(session_id=r.session_id, action=tool("python", code="print(1)")), timeout=0.3)
        await expect_error(cut, grpc.StatusCode.DEADLINE_EXCEEDED)
        s = await stub.Step(pb.StepRequest(session_id=r.session_id, action=tool("python", code="print(2)")))
        assert s.observation == "print(2)" and not s.terminated
        assert orch.sessions is not None
        turns = orch.sessions._sessions[r.session_id].state.turns
        calls = [c.id for t in turns for c in t.tool_calls]
        answered = [t.tool_call_id for t in turns if t.role == "tool"]
        assert calls == answered and len(set(calls)) == 2, [(t.role, t.text[:20]) for t in turns]


async def test_a_step_whose_call_gives_up_before_its_turn_takes_no_step(tmp_path: Path) -> None:
    # queued behind a running step, a call cut by its deadline ran its action later all the same: a turn spent on
    # an action whose outcome nobody saw, and run twice when the client retried it
    backend = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=1.0)
    async with serve(tmp_path, backend=backend) as orch, EnvfleetClient(orch.address) as client:
        stub = client.session_stub
        r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        first = stub.Step(pb.StepRequest(session_id=r.session_id, action=tool("python", code="print(1)")))
        await asyncio.sleep(0.2)  # it runs
        queued = stub.Step(pb.StepRequest(session_id=r.session_id, action=tool("python", code="print(2)")), timeout=0.3)
        await expect_error(queued, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert (await first).info.turn == 1
        await asyncio.sleep(1.5)  # a step that still ran would be done by now
        assert orch.sessions is not None
        session = orch.sessions._sessions[r.session_id]
        assert session.turn == 1 and "print(2)" not in [t.text for t in session.state.turns if t.role == "tool"]
        s = await stub.Step(pb.StepRequest(session_id=r.session_id, action=tool("python", code="print(3)")))
        assert s.observation == "print(3)" and s.info.turn == 2


async def test_an_ended_session_keeps_no_transcript(tmp_path: Path) -> None:
    # an ended session answers Step and Close until it idles out, and held its whole transcript meanwhile: only the
    # open ones count against sessions.max_per_tenant, so a loop of Reset and a 1 MiB final answer grew the server
    async with (
        serve(tmp_path, backend=FAKE, sessions={"max_per_tenant": 2}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        stub = client.session_stub
        ids = []
        for _ in range(20):
            r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
            await stub.Step(pb.StepRequest(session_id=r.session_id, action=pb.Action(final_answer="x" * (1 << 20))))
            ids.append(r.session_id)
        assert orch.sessions is not None
        # nor were the ended sessions themselves forgotten before they idled out: a tenant keeps its newest
        # max_per_tenant, the older ones leave tombstones (capped) that still say how they ended
        assert set(orch.sessions._sessions) == set(ids[-2:])
        kept = [orch.sessions._sessions[i] for i in ids[-2:]]
        assert all(s.ended is not None for s in kept)
        assert sum(len(t.text) for s in kept for t in s.state.turns) == 0
        again = stub.Step(pb.StepRequest(session_id=ids[-1], action=pb.Action(final_answer="1")))
        await expect_error(again, grpc.StatusCode.FAILED_PRECONDITION, "has ended (OK)")
        forgotten = stub.Step(pb.StepRequest(session_id=ids[0], action=pb.Action(final_answer="1")))
        await expect_error(forgotten, grpc.StatusCode.NOT_FOUND, "has ended (OK); call Reset")
        # and the tenant's open sessions are not touched by it
        r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        assert orch.sessions.open_sessions() == 1 and r.session_id in orch.sessions._sessions


async def test_a_session_gets_no_warm_sandbox_whose_lease_ends_before_its_lifetime_could(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the sweep removes a sandbox when its lease ends, in use or not; a recycled one's lease runs from its creation
    from orchestrator.backends.fake import FakeSandbox

    async with (
        serve(tmp_path, backend=FAKE, sessions={"max_lifetime_s": 1000.0}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        assert orch.sessions is not None
        stub = client.session_stub

        async def episode() -> str:
            r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
            assert orch.sessions is not None
            sandbox = orch.sessions._sessions[r.session_id].sandbox
            assert sandbox.spec.ttl_s >= 2000  # recyclable for a lifetime's worth
            await stub.Step(pb.StepRequest(session_id=r.session_id, action=pb.Action(final_answer="1")))  # recycled
            return sandbox.name

        first = await episode()
        assert await episode() == first  # warm, and the same one
        monkeypatch.setattr(FakeSandbox, "lease_left_s", lambda self: 900.0)  # less than the 1000 s a session may live
        assert await episode() != first


def _gym_episode(address: str, task_id: str, code: str, answer: str) -> None:
    env = SessionEnv(address, ENV)
    try:
        check_env(env, skip_render_check=True)
        obs, info = env.reset(options={"task_id": task_id})
        assert "python" in obs and [t["function"]["name"] for t in info["tools"]] == ["python", "submit"]
        obs, reward, terminated, truncated, info = env.step(json.dumps({"name": "python", "arguments": {"code": code}}))
        assert obs.strip() == answer and reward == 0.0 and not terminated and not truncated
        obs, reward, terminated, truncated, info = env.step(
            json.dumps({"name": "submit", "arguments": {"answer": answer}})
        )
        assert (reward, terminated, truncated, info["status"]) == (1.0, True, False, "OK")
        env.reset(seed=3)
        _, reward, terminated, _, info = env.step('{"answer": "wrong"}')
        assert (reward, terminated, info["status"]) == (0.0, True, "OK")
        with pytest.raises(grpc.RpcError):  # the episode is over
            env.step("again")
    finally:
        env.close()
        env.close()


async def test_gymnasium_wrapper_passes_check_env(
    client: EnvfleetClient, registry: Registry, orchestrator: object
) -> None:
    task = registry.get(ENV).tasks()[4]
    address = client.target
    await asyncio.to_thread(
        _gym_episode, address, task.id, task.reference[0].arguments["code"], str(task.data["answer"])
    )


async def test_a_gym_step_longer_than_the_clients_call_deadline_keeps_its_result(tmp_path: Path) -> None:
    # Step had Reset's deadline (300 s): a final step whose grader ran longer (a step's budget is the tool call and
    # up to the grader's own timeouts) was scored by the server and its reward lost here, the episode over on retry
    backend = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=1.5)
    async with serve(tmp_path, backend=backend) as orch, EnvfleetClient(orch.address) as client:

        def episode() -> tuple[str, str]:
            env = SessionEnv(client.target, ENV, timeout_s=0.5)  # Reset's and Close's deadline only
            try:
                env.reset(options={"task_id": "py-000"})
                obs, _, _, _, info = env.step(json.dumps({"name": "python", "arguments": {"code": "print(7)"}}))
                return obs, info["status"]
            finally:
                env.close()

        obs, status = await asyncio.to_thread(episode)
        assert obs.strip() == "print(7)" and status == ""  # the fake echoes the command; the episode goes on


async def test_resets_look_their_task_up_without_walking_the_environments_list(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each Reset copied the environment's task list and scanned it for the id: 3.4 ms of the event loop a Reset at
    # 100,000 tasks (a declarative environment's most)
    async with serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        assert orch.sessions is not None
        env = orch.sessions._registry.get(ENV)
        listed = env.tasks()
        calls: list[int] = []

        def counted() -> Sequence[Task]:
            calls.append(1)
            return listed

        monkeypatch.setattr(env, "tasks", counted)
        for task_id in ("py-000", "py-001", "py-000", ""):
            r = await client.session_stub.Reset(pb.ResetRequest(env=ENV, task_id=task_id))
            assert r.info.task_id == (task_id or r.info.task_id)
            await client.session_stub.CloseSession(pb.CloseSessionRequest(session_id=r.session_id))
        await expect_error(
            client.session_stub.Reset(pb.ResetRequest(env=ENV, task_id="py-nope")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "has no task",
        )
    assert len(calls) == 1, calls


def _sync_step(target: str, call: ToolCall, timeout_s: float = 300.0, step_timeout_s: float | None = None) -> str:
    """One step of a fresh session through the blocking SyncSessions: its observation."""
    blocking = SyncSessions(target, timeout_s=timeout_s, step_timeout_s=step_timeout_s)
    try:
        opened = blocking.reset(ENV, task_id="py-000")
        observation = blocking.step(opened.session_id, call).observation
        blocking.close(opened.session_id)
        return observation
    finally:
        blocking.shutdown()


async def test_the_adapters_sessions_keep_a_step_longer_than_their_call_deadline(tmp_path: Path) -> None:
    # the verl and SkyRL adapters gave Step Reset's deadline (300 s): a final step graded longer was scored by the
    # server, and the client got DEADLINE_EXCEEDED (no episode outcome), then closed the session mid-grading
    backend = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=1.5)
    call = ToolCall("call_0", "python", json.dumps({"code": "print(7)"}))
    async with serve(tmp_path, backend=backend) as orch, EnvfleetClient(orch.address) as client:
        sessions = AsyncSessions(client, timeout_s=0.5)  # Reset's and Close's deadline only
        opening = await sessions.reset(ENV, task_id="py-000")
        result = await sessions.step(opening.session_id, call)
        await sessions.close(opening.session_id)
        assert result.observation.strip() == "print(7)" and result.status is None

        blocking = functools.partial(_sync_step, client.target, call, timeout_s=0.5)
        assert (await asyncio.to_thread(blocking)).strip() == "print(7)"


async def test_a_policys_lone_surrogate_escape_is_a_step_not_a_client_crash(tmp_path: Path) -> None:
    # json reads "\ud800" as a lone surrogate, which protobuf refuses (UTF-8 has none): text the policy wrote raised
    # UnicodeEncodeError out of env.step and out of the adapters' episodes, an outcome no trainer handles
    async with serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        sessions = AsyncSessions(client)
        opening = await sessions.reset(ENV, task_id="py-000")
        lone = json.loads('"\\ud800"')
        result = await sessions.step(opening.session_id, ToolCall(lone, "python" + lone, json.dumps({"code": "1"})))
        assert not result.terminated and result.status is None  # an unknown tool: the policy's error, told to it
        result = await sessions.step(opening.session_id, "the answer " + lone)
        assert result.terminated and result.status == RolloutStatus.OK and result.reward == 0.0
        await sessions.close(opening.session_id)

        def gym_episode() -> list[tuple[str, float, bool]]:
            env = SessionEnv(client.target, ENV)
            try:
                env.reset(options={"task_id": "py-000"})
                steps = []
                for action in (
                    '{"name": "python\\ud800", "id": "\\udfff", "arguments": "{\\"code\\": 1}"}',
                    '{"answer": "\\ud800"}',
                ):
                    _, reward, terminated, _, info = env.step(action)
                    steps.append((info["status"], reward, terminated))
                return steps
            finally:
                env.close()

        assert await asyncio.to_thread(gym_episode) == [("", 0.0, False), ("OK", 0.0, True)]


async def test_a_tool_call_that_names_no_tool_is_the_policys_error_not_a_refused_step(tmp_path: Path) -> None:
    # a parser reads an unclosed <tool_call> (a thought that mentions the tag, a sample cut inside a call) as a call
    # with no name: the session refused it INVALID_ARGUMENT, the policy's own text failing the adapter's whole batch,
    # where a job's rollout tells the policy and goes on
    async with serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        stub = client.session_stub
        r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        nameless = pb.Action(tool_call=pb.ToolCall(id="c0", name="", arguments='{"code": "print(1)"}'))
        s = await stub.Step(pb.StepRequest(session_id=r.session_id, action=nameless))
        assert "names no tool" in s.observation and not s.terminated and not s.status, s
        s = await stub.Step(pb.StepRequest(session_id=r.session_id, action=pb.Action(final_answer="0")))
        assert s.terminated and s.status == pb.ROLLOUT_STATUS_OK
        # nor is a name of any length the model wrote (one over 128 characters was refused, failing the batch)
        long_name = pb.Action(tool_call=pb.ToolCall(id="c1", name="x" * 5000, arguments="{}"))
        r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        s = await stub.Step(pb.StepRequest(session_id=r.session_id, action=long_name))
        assert "unknown tool" in s.observation and len(s.observation) < 1000 and not s.status, s


async def test_a_truncated_gym_step_that_failed_is_no_reward_of_0(tmp_path: Path) -> None:
    # on_failure="truncate" returned reward 0.0 for an infrastructure failure: a wrapper that reads no info (vector
    # autoreset, most of them) trained on it as a score
    def broken(cmd: FakeExec) -> ExecResult:
        raise SandboxDiedError("the sandbox died")

    backend = FakeBackendConfig(owner=TEST_OWNER, exec_handler=broken)
    async with serve(tmp_path, backend=backend) as orch, EnvfleetClient(orch.address) as client:

        def episode() -> tuple[float, bool, dict[str, Any]]:
            env = SessionEnv(client.target, ENV, on_failure="truncate")
            try:
                env.reset(options={"task_id": "py-000"})
                _, reward, _, truncated, info = env.step(json.dumps({"name": "python", "arguments": {"code": "1"}}))
                return reward, truncated, info
            finally:
                env.close()

        reward, truncated, info = await asyncio.to_thread(episode)
        # the failed call is in the tool time histogram, as the ones that end are; and a job's alike
        exec_count = "envfleet_tool_exec_seconds_count"
        assert orch.pool is not None
        assert orch.pool.metrics.registry.get_sample_value(exec_count) == 1
        spec = JobSpec(
            env=ENV,
            tasks=TaskSelection(kind="ids", ids=["py-000"]),
            policy=PolicyEndpoint(base_url=REPLAY_URL),
            max_infra_retries=0,
        )
        (r,) = [r async for r in client.rollouts(await client.submit(spec))]
        assert r.status.value == "INFRA_ERROR" and orch.pool.metrics.registry.get_sample_value(exec_count) == 2
    assert math.isnan(reward) and truncated and info["scored"] is False and info["status"] == "INFRA_ERROR", info


async def test_closing_every_session_mid_step_releases_each_sandbox_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # at shutdown the sandboxes went back to the pool without the sessions marked released: a step still running
    # released its sandbox again when it ended, and the pool's counts drifted
    backend = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=1.0)
    async with serve(tmp_path, backend=backend) as orch, EnvfleetClient(orch.address) as client:
        assert orch.sessions is not None
        stub = client.session_stub
        r = await stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        pool = orch.sessions._pool
        release, released = pool.release, []

        async def counted(sandbox: Any, *args: Any, **kw: Any) -> Any:
            released.append(sandbox.name)
            return await release(sandbox, *args, **kw)

        monkeypatch.setattr(pool, "release", counted)
        step = asyncio.ensure_future(
            stub.Step(pb.StepRequest(session_id=r.session_id, action=tool("python", code="print(1)")))
        )
        await asyncio.sleep(0.3)  # the step runs its tool call
        await orch.sessions.close_all()
        with contextlib.suppress(grpc.aio.AioRpcError):
            await step
        await asyncio.sleep(1.5)  # past the step's own end
        assert len(released) == 1, released


async def test_a_reset_whose_environment_cannot_make_its_messages_opens_no_session(tmp_path: Path) -> None:
    """An environment's messages() that raises is its failure (FAILED_PRECONDITION), and no session stays open: made
    after the session opened, it was INTERNAL, and the session the caller never heard of held a sandbox and the
    host's capacity until its idle ttl (64 such resets locked the tenant out)."""
    from environments.python_tool import PythonToolEnv

    class Broken(PythonToolEnv):
        name = "broken-messages"

        def messages(self, task: Task) -> list[dict[str, Any]]:
            raise RuntimeError("no template")

    registry = Registry.from_entry_points()
    registry.register(Broken())
    async with serve(tmp_path, registry, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        for _ in range(3):
            await expect_error(
                client.session_stub.Reset(pb.ResetRequest(env="broken-messages", task_id="py-000")),
                grpc.StatusCode.FAILED_PRECONDITION,
                "opening messages of task py-000 could not be made: RuntimeError: 'no template'",
            )
        assert orch.sessions is not None and orch.sessions.open_sessions() == 0


async def test_an_environments_own_time_for_the_agent_ends_a_session_and_it_is_scored(tmp_path: Path) -> None:
    # Harbor's [agent] timeout_sec is the agent's whole run: a session (the verl and OpenEnv integrations drive
    # Harbor tasks through them) ran on to its 24 h lifetime, each tool call capped alone
    base = Registry.from_entry_points().get(ENV)

    class Hurried(type(base)):  # type: ignore[misc, valid-type]
        name = "hurried-tool"

        def episode_timeout_s(self, task: Task) -> float:
            return 3.0

    registry = Registry.from_entry_points()
    registry.register(Hurried())
    task = Hurried().tasks()[0]
    slow = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=2.0)
    async with serve(tmp_path / "data", registry, backend=slow) as orch, EnvfleetClient(orch.address) as client:
        stub = client.session_stub
        sid = (await stub.Reset(pb.ResetRequest(env="hurried-tool", task_id=task.id))).session_id
        first = await stub.Step(pb.StepRequest(session_id=sid, action=tool("python", code="1")))
        assert not first.terminated and not first.truncated and first.info.turn == 1
        # 1 s left: the call is stopped there by its own timeout, and the episode ends, scored
        second = await stub.Step(pb.StepRequest(session_id=sid, action=tool("python", code="2")))
        assert second.truncated and second.status == pb.ROLLOUT_STATUS_TRUNCATED and second.reward == 0.0
        assert "timed out" in second.observation and second.info.turn == 2
        # the client's own time between steps (its generation) is the agent's too: a step past it is not taken
        sid = (await stub.Reset(pb.ResetRequest(env="hurried-tool", task_id=task.id))).session_id
        await asyncio.sleep(3.2)
        late = await stub.Step(pb.StepRequest(session_id=sid, action=tool("python", code="1")))
        assert late.truncated and late.info.turn == 0 and late.observation == "" and late.reward == 0.0


def test_a_gym_action_the_server_would_refuse_is_made_one_it_takes() -> None:
    # the policy's text raised out of env.step: an integer past Python's digit limit (ValueError, not a
    # JSONDecodeError), and a tool call id over the server's 128 characters (INVALID_ARGUMENT)
    digits = "9" * 5000
    assert parse_action(digits).final_answer == digits
    call = parse_action(json.dumps({"name": "python", "id": "x" * 200, "arguments": {"code": "1"}})).tool_call
    assert (call.id, call.name, json.loads(call.arguments)) == ("", "python", {"code": "1"})
    assert parse_action(json.dumps({"name": "python", "id": "c1"})).tool_call.id == "c1"


_SEEN: list[list[str]] = []


async def _roles(ctx: ScoringContext) -> float:
    _SEEN.append([t.role for t in ctx.episode.turns])
    return 1.0


class _Roles(Environment):
    """Records the roles of the episode its scorer is given."""

    name: ClassVar[str] = "roles"
    tools: ClassVar[tuple[str, ...]] = ("submit",)
    rubric: ClassVar[Rubric] = Rubric([("roles", _roles, 1.0)])

    def tasks(self) -> list[Task]:
        return [Task(id="t", prompt="say x", reference=(ToolInvocation("submit", {"answer": "x"}),))]


async def test_a_sessions_scorer_sees_the_episode_a_jobs_does(tmp_path: Path) -> None:
    # a session's episode began at the first step, a job's with the opening (system, user): a rubric that read the
    # prompt or counted turns scored the same trajectory one way in a job and another in a session
    _SEEN.clear()
    registry = Registry()
    registry.register(_Roles())
    async with serve(tmp_path, registry, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        spec = JobSpec(env="roles", policy=PolicyEndpoint(base_url=REPLAY_URL))
        (rollout,) = [r async for r in client.rollouts(await client.submit(spec))]
        assert rollout.reward == 1.0, rollout.error
        sid = (await client.session_stub.Reset(pb.ResetRequest(env="roles", task_id="t"))).session_id
        step = await client.session_stub.Step(pb.StepRequest(session_id=sid, action=tool("submit", answer="x")))
        assert step.reward == 1.0 and step.terminated
        await client.session_stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    job_roles, session_roles = _SEEN
    assert job_roles[:2] == ["system", "user"] and session_roles == job_roles, _SEEN


async def test_a_step_whose_answer_is_lost_is_asked_again_at_its_turn_and_never_runs_twice(tmp_path: Path) -> None:
    # a Step's answer lost (a dropped connection, the caller's deadline) failed the episode as INFRA_ERROR, though
    # the server ran the step to its end: a final step's reward was thrown away and the adapter ran the episode
    # again. The clients send it again at its turn, and the server answers what that step did
    backend = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=1.0)
    call = ToolCall("call_0", "python", json.dumps({"code": "print(7)"}))
    async with serve(tmp_path, backend=backend) as orch, EnvfleetClient(orch.address) as client:
        sessions = AsyncSessions(client, step_timeout_s=0.3)  # each step's answer is past it: lost, asked again
        opening = await sessions.reset(ENV, task_id="py-000")
        sid = opening.session_id
        result = await sessions.step(sid, call)
        assert result.observation.strip() == "print(7)" and result.status is None
        stub = client.session_stub
        # the step ran once: the session is at turn 1, where the next one goes
        await expect_error(
            stub.Step(pb.StepRequest(session_id=sid, action=tool("submit", answer="7"), turn=2)),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"session {sid} is at turn 1, not 2",
        )
        final = await stub.Step(pb.StepRequest(session_id=sid, action=tool("submit", answer="7"), turn=1))
        assert final.terminated and final.status == pb.ROLLOUT_STATUS_OK
        # the final step sent again, the episode ended: the same answer, its reward, and no second action
        again = await stub.Step(pb.StepRequest(session_id=sid, action=tool("submit", answer="7"), turn=1))
        assert again == final and final.info.steps_by_turn
        # another action at that turn is no resend (two clients on one session, a stale turn): refused
        await expect_error(
            stub.Step(pb.StepRequest(session_id=sid, action=tool("submit", answer="wrong"), turn=1)),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"session {sid} took another action at turn 1",
        )
        await expect_error(
            stub.Step(pb.StepRequest(session_id=sid, action=tool("submit", answer="7"))),
            grpc.StatusCode.FAILED_PRECONDITION,
            "has ended (OK)",
        )
        await sessions.close(sid)

        blocking = functools.partial(_sync_step, client.target, call, step_timeout_s=0.3)
        assert (await asyncio.to_thread(blocking)).strip() == "print(7)"
