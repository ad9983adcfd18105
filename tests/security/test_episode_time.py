"""A policy cannot spend its way to a masked rollout. A rollout's time (rollout_timeout_s) covered its sandbox, its
setup, its episode and its scoring alike, and ran out as TIMEOUT, which carries no reward and is masked from training:
a losing policy gained by making slow tool calls (each up to the tool's timeout, as many a turn as it liked) until
the time was gone. Its tool calls now end when only the scoring's reserve is left (a quarter of the rollout's time,
at most 300 s), and the episode with them: TRUNCATED ("time"), and scored. So does a generation seen streaming in
past that point: a policy that wrote on into the scoring's reserve made its rollout TIMEOUT. A silent one is not cut:
a hung inference server is no outcome of the policy's, and stays TIMEOUT (tests/orchestrator/test_e2e.py). The time
counts from the end of the environment's setup: a slow sandbox takes none of it.

Through real processes: the scripted policy server and the real gRPC server on the fake backend, whose every command
takes 2 s."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Task
from orchestrator.core.errors import PolicyError
from orchestrator.core.models import JobSpec, Rollout, RolloutStatus, TaskSelection
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.episode import _PastDeadline
from orchestrator.rollout.policy import http
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.rollout.runner import WorkItem
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step, start_scripted_server
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, local_runner, serve


async def _spending(tmp_path: Path, **fleet: float) -> Rollout:
    """The one rollout of a policy that makes a tool call a turn, for python-tool's 8 turns, on the fake backend
    where each call takes 2 s (16 s in all) and `fleet` sets the rest; the rollout has 8 s."""
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    slow = Step(tool_calls=[ScriptedToolCall(name="python", arguments={"code": "print(1)"})])
    async with (
        await start_scripted_server(Script(default=[slow] * 8), tokens=False) as scripted,
        serve(tmp_path / "data", backend=FAKE.model_copy(update={"exec_latency_s": 2.0, **fleet})) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        job_id = await client.submit(job(scripted.url, [task_id], rollout_timeout_s=8, max_infra_retries=0))
        async with asyncio.timeout(60):
            [rollout] = [r async for r in client.rollouts(job_id)]
    return rollout


async def test_a_policy_that_spends_the_rollouts_time_is_truncated_and_scored(tmp_path: Path) -> None:
    # 8 s in all: the episode ends when 2 s are left (a quarter), three calls in
    rollout = await _spending(tmp_path)
    assert (rollout.status, rollout.reward, rollout.error) == (RolloutStatus.TRUNCATED, 0.0, None)
    assert rollout.timing is not None and 5.5 < rollout.timing.total < 8
    calls = [c for t in rollout.turns if t.role == "assistant" for c in t.tool_calls or ()]
    answered = [t for t in rollout.turns if t.role == "tool"]
    assert len(answered) in (2, 3) and len(calls) == len(answered)
    # the call the deadline cut stopped there by its own timeout: its command (and what it started) was killed before
    # the episode ended, not left to a cancel that envd notices later, while the grader starts
    assert "timed out" in answered[-1].text


async def test_a_slow_sandbox_leaves_the_policy_all_of_its_time(tmp_path: Path) -> None:
    # the episode's time counted from the attempt's start: a sandbox that took 2.5 s of an 8 s rollout left the same
    # policy 3.5 s of the 6 it has, one tool call where a quick fleet gave it two or three, and the episode it cut
    # short was scored beside its group's. The fleet's part has a limit of its own (tests/orchestrator/test_e2e.py)
    rollout = await _spending(tmp_path, create_latency_s=2.5)
    assert (rollout.status, rollout.reward, rollout.error) == (RolloutStatus.TRUNCATED, 0.0, None)
    assert rollout.timing is not None and rollout.timing.sandbox_acquire >= 2.5
    assert 5.5 < rollout.timing.total - rollout.timing.sandbox_acquire < 8
    assert len([t for t in rollout.turns if t.role == "tool"]) in (2, 3)


async def test_a_generation_streaming_past_the_episodes_time_is_truncated_and_scored(tmp_path: Path) -> None:
    # a tool call, then an answer that streams for 16 s (8 pieces, 2 s apart) in a rollout of 8 s: it ran on past
    # the episode's 6 s and the scoring's reserve, and the rollout's deadline made it TIMEOUT, masked
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    call = Step(tool_calls=[ScriptedToolCall(name="python", arguments={"code": "print(1)"})])
    rambling = Step(content="word " * 4000, chunk_delay_s=2.0)
    async with (
        await start_scripted_server(Script(default=[call, rambling]), tokens=False) as scripted,
        serve(tmp_path / "data", backend=FAKE) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        spec = JobSpec(
            env=ENV,
            tasks=TaskSelection(kind="ids", ids=[task_id]),
            policy=PolicyEndpoint(base_url=scripted.url, model="scripted", stream=True, request_timeout_s=30),
            rollout_timeout_s=8,
            max_infra_retries=0,
        )
        job_id = await client.submit(spec)
        async with asyncio.timeout(60):
            [rollout] = [r async for r in client.rollouts(job_id)]
    assert (rollout.status, rollout.reward, rollout.error) == (RolloutStatus.TRUNCATED, 0.0, None)
    assert rollout.timing is not None and 5.5 < rollout.timing.total < 8
    assert [t.role for t in rollout.turns if t.role != "user" and t.role != "system"] == ["assistant", "tool"]


async def _request(reader: asyncio.StreamReader) -> bool:
    """Read one HTTP request off a keep-alive connection; False once the client has closed it."""
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    if not line:
        return False
    await reader.readexactly(length)
    return True


@pytest.mark.parametrize("answer", ["503", "aborted"])
async def test_a_failing_server_past_the_episodes_time_is_not_cut_as_the_policys(answer: str) -> None:
    # the cut takes bytes seen within the last seconds for a generation going on: an error's body (a 503 of an
    # overloaded server) or an aborted stream's, then retried, read as one, and the fleet's fault was scored 0
    if answer == "503":
        reply = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 17\r\n\r\n"
        reply += b'{"error": "busy"}'
    else:  # a stream cut short (no finish_reason, no [DONE]): the generation was aborted, and is asked for again
        event = b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'
        reply = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        reply += f"Content-Length: {len(event)}\r\n\r\n".encode() + event

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while await _request(reader):
                writer.write(reply)
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    endpoint = PolicyEndpoint(
        base_url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1",
        stream=True,
        max_retries=8,
        outage_wait_s=0,  # a 503 and an aborted stream are a server down or busy: no wait past the retries here
    )
    policy = OpenAIPolicy(endpoint, backoff_base_s=0.3, backoff_cap_s=0.3)
    try:
        cut = _PastDeadline(asyncio.get_running_loop().time() + 0.5)
        with pytest.raises(PolicyError):  # its retries ran out: POLICY_ERROR, masked, as before
            async with cut:
                await policy.complete([{"role": "user", "content": "hi"}], [], Sampling())
        assert not cut.expired()
    finally:
        await policy.aclose()
        server.close()


async def test_a_generation_after_retries_past_the_deadline_has_the_time_the_retries_took() -> None:
    # two 503s and their pauses take the call close to the episode's deadline, and the third attempt's stream past
    # it: cut there, the server's lost time was the policy's TRUNCATED 0
    pieces = [
        b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "an answer"}}]}\n\n',
        b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n',
        b"data: [DONE]\n\n",
    ]
    busy = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    served = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while await _request(reader):
                served += 1
                if served <= 2:
                    writer.write(busy)
                    await writer.drain()
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                )
                for piece in pieces:  # 0.6 s of streaming
                    writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                    await writer.drain()
                    await asyncio.sleep(0.3)
                writer.write(b"0\r\n\r\n")
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    endpoint = PolicyEndpoint(base_url=f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", stream=True)
    policy = OpenAIPolicy(endpoint, backoff_base_s=0.4, backoff_cap_s=0.4)
    try:
        # 1.5 s: the 503s and their pauses take about 0.8 s, the stream 0.9 s from there
        cut = _PastDeadline(asyncio.get_running_loop().time() + 1.5)
        async with cut:
            c = await policy.complete([{"role": "user", "content": "hi"}], [], Sampling())
        assert not cut.expired() and c.text == "an answer" and served == 3
    finally:
        await policy.aclose()
        server.close()


async def test_the_time_failed_attempts_took_moves_the_cut_no_later_than_its_limit() -> None:
    # failed attempts move the cut on by the time they took, but only so far: past the rollout's own end the policy
    # that wrote on was TIMEOUT, masked, and one whose own output made the server fail gained time from it
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    cut = _PastDeadline(t0 + 0.2, cut_by=t0 + 0.5)
    with pytest.raises(TimeoutError):
        async with cut:
            progress = http.PROGRESS.get()
            assert progress is not None
            progress.lost = 100.0  # as if the server had failed for that long
            while loop.time() - t0 < 3:  # and streams on
                progress.last = loop.time()
                await asyncio.sleep(0.02)
    assert cut.expired() and 0.5 <= loop.time() - t0 < 1.5


async def test_an_environments_own_time_for_the_agent_ends_the_episode_and_it_is_scored(tmp_path: Path) -> None:
    # Harbor's [agent] timeout_sec is the agent's whole run: it capped each tool call only, so an agent that made
    # slow calls had the rollout's time (here 60 s), not the task's 3 s
    class Hurried(type(Registry.from_entry_points().get(ENV))):  # type: ignore[misc]
        def episode_timeout_s(self, task: Task) -> float:
            return 3.0

    env = Hurried()
    task = env.tasks()[0]
    slow = Step(tool_calls=[ScriptedToolCall(name="python", arguments={"code": "print(1)"})])
    async with (
        await start_scripted_server(Script(default=[slow] * 8), tokens=False) as scripted,
        serve(tmp_path / "data", backend=FAKE.model_copy(update={"exec_latency_s": 2.0})) as orch,
    ):
        policy = OpenAIPolicy(PolicyEndpoint(base_url=scripted.url, model="scripted"))
        try:
            item = WorkItem("direct", task, 0, time.monotonic())
            spec = job(scripted.url, [task.id], rollout_timeout_s=60, max_infra_retries=0)
            async with asyncio.timeout(30):
                rollout = await local_runner(orch).run(item, env, spec, policy, "v1")
        finally:
            await policy.aclose()
    assert (rollout.status, rollout.reward, rollout.error) == (RolloutStatus.TRUNCATED, 0.0, None)
    assert rollout.timing is not None and 2.5 < rollout.timing.generation + rollout.timing.tools < 5
    answered = [t for t in rollout.turns if t.role == "tool"]
    assert len(answered) in (1, 2) and "timed out" in answered[-1].text
