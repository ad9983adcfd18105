"""The OpenEnv facade with OpenEnv's own client on loopback: an episode on real sandboxes to a reward of 1 and of 0,
a disconnect in the middle that leaves no sandbox, bad actions that get error frames (the connection goes on), and
the standalone facade and both commands in front of a real orchestrator."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import docker
import pytest
from websockets.asyncio.client import ClientConnection

from orchestrator.openenv.config import OpenEnvConfig
from orchestrator.openenv.serving import start_facade
from orchestrator.service.registry import Registry
from tests.conftest import REPO, TEST_OWNER, until
from tests.openenv.facade import ENV, env_client, exchange, facade_url, http_get, open_sessions, ws_connect
from tests.orchestrator.servers import FAKE, serve

OPENENV = {"port": 0}


def _python(code: str) -> dict[str, object]:
    return {"name": "python", "arguments": {"code": code}}


async def test_an_episode_scores_1_and_a_wrong_answer_0(tmp_path: Path, base_image: str) -> None:
    task, other = Registry.from_entry_points().get(ENV).tasks()[:2]
    code, answer = task.reference[0].arguments["code"], str(task.data["answer"])
    async with serve(tmp_path, openenv=OPENENV) as orch, env_client(facade_url(orch)) as env:
        r = await env.reset(task_id=task.id)
        assert r.observation["text"] == task.prompt and r.reward is None and not r.done
        meta = r.metadata
        assert [t["function"]["name"] for t in meta["tools"]] == ["python", "submit"]
        assert meta["tools"][0]["function"]["parameters"]["required"] == ["code"]
        assert [m["role"] for m in meta["messages"]] == ["system", "user"]
        assert (meta["env"], meta["task_id"], meta["turn"]) == ("python-tool@1", task.id, 0)
        assert open_sessions(orch) == 1

        r = await env.step(_python(code))
        assert r.observation["text"].strip() == answer and r.reward == 0.0 and not r.done
        r = await env.step({"name": "submit", "arguments": {"answer": answer}})
        assert r.done and r.reward == 1.0
        assert r.metadata["status"] == "OK" and r.metadata["scored"] and r.metadata["terminated"]
        assert r.metadata["reward_components"] == {"exact_match": 1.0}
        state = await env.state()
        assert (state["episode_id"], state["step_count"], state["done"]) == (meta["session_id"], 2, True)
        with pytest.raises(RuntimeError, match=r"FAILED_PRECONDITION: .*has ended \(OK\)"):
            await env.step(_python("print(1)"))

        r = await env.reset(task_id=other.id)  # the same connection, a new episode
        r = await env.step({"answer": "certainly not the answer"})
        assert r.done and r.reward == 0.0 and r.metadata["status"] == "OK"  # a wrong answer is a scored 0
    await until(lambda: open_sessions(orch) == 0, "closed")


async def test_a_disconnect_mid_episode_closes_the_session(
    tmp_path: Path, base_image: str, docker_client: docker.DockerClient
) -> None:
    async with serve(tmp_path, openenv=OPENENV) as orch:
        env = env_client(facade_url(orch))
        await env.reset(task_id="py-001")
        r = await env.step(_python("import socket; print(socket.gethostname())"))
        container = r.observation["text"].strip()  # docker's default hostname: the container id's first 12 characters
        assert docker_client.containers.get(container).status == "running"
        assert open_sessions(orch) == 1
        ws = env._ws
        assert ws is not None
        ws.transport.abort()  # a trainer that dies: no close frame, no "close" message
        await until(lambda: open_sessions(orch) == 0, "closed")

        def gone() -> bool:
            try:
                docker_client.containers.get(container)
            except docker.errors.NotFound:
                return True
            return False

        await until(gone, "removed")


async def _expect_error(ws: ClientConnection, frame: str | bytes, code: str, *fragments: str) -> None:
    answer = await exchange(ws, frame)
    assert answer["type"] == "error" and answer["data"]["code"] == code, answer
    for fragment in fragments:
        assert fragment in answer["data"]["message"], answer


async def test_bad_actions_get_error_frames_and_the_connection_goes_on(tmp_path: Path) -> None:
    async with serve(tmp_path, backend=FAKE, openenv=OPENENV) as orch:
        url = facade_url(orch)
        async with env_client(url) as env:
            with pytest.raises(RuntimeError, match="no episode is running: send a reset first"):
                await env.step({"answer": "x"})
            with pytest.raises(RuntimeError, match=r"INVALID_ARGUMENT: task_id: python-tool@1 has no task 'nope'"):
                await env.reset(task_id="nope")
            with pytest.raises(RuntimeError, match="VALIDATION_ERROR"):
                await env.reset(task="py-000")  # not an option
            with pytest.raises(RuntimeError, match="max_turns: Input should be less than or equal to 1000"):
                await env.reset(max_turns=5000)
            await env.reset(task_id="py-000")
            with pytest.raises(RuntimeError, match=r"give either a tool call .* or a final answer"):
                await env.step({"name": "python", "answer": "both"})
            with pytest.raises(RuntimeError, match="give either a tool call"):
                await env.step({})
            with pytest.raises(RuntimeError, match="command: Extra inputs are not permitted"):
                await env.step({"name": "bash", "command": "ls"})
            with pytest.raises(RuntimeError, match="name: String should have at most 128 characters"):
                await env.step({"name": "x" * 200})
            r = await env.step({"name": "no-such-tool", "arguments": "{not json"})  # the policy's mistake: observed
            assert "no-such-tool" in r.observation["text"] and not r.done
            r = await env.step({"answer": "done"})
            assert r.done and r.metadata["status"] == "OK"

        async with ws_connect(url) as ws:  # frames OpenEnv's client never sends
            await _expect_error(ws, "{not json", "INVALID_JSON")
            await _expect_error(ws, b"\x00\x01", "INVALID_JSON", "send JSON text frames")
            await _expect_error(ws, json.dumps({"type": "mcp", "data": {"method": "tools/list"}}), "UNKNOWN_TYPE")
            mcp = {"type": "mcp", "data": {"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create"}}
            await _expect_error(ws, json.dumps(mcp), "UNKNOWN_TYPE", "MCP is not served")
            # the type written with an escape is "mcp" to OpenEnv too (it reached the MCP handler, which opens
            # sessions outside the websocket's lifetime)
            escaped = json.dumps(mcp).replace('"mcp"', '"\\u006dcp"')
            assert "\\u006dcp" in escaped and '"mcp"' not in escaped
            await _expect_error(ws, escaped, "UNKNOWN_TYPE", "MCP is not served")
            await _expect_error(ws, json.dumps({"type": "launch"}), "UNKNOWN_TYPE")
            await _expect_error(ws, json.dumps({"type": "step", "data": {"answer": 7}}), "VALIDATION_ERROR", "answer")
            answer = await exchange(ws, json.dumps({"type": "reset", "data": {"task_id": "py-000"}}))
            assert answer["type"] == "observation" and answer["data"]["observation"]["text"]
            assert open_sessions(orch) == 1
        await until(lambda: open_sessions(orch) == 0, "closed")


async def test_the_standalone_facade_in_front_of_a_running_orchestrator(tmp_path: Path) -> None:
    async with serve(tmp_path, backend=FAKE) as orch:
        facade = await start_facade(OpenEnvConfig(port=0), orch.address)
        try:
            status, listing = await http_get(facade.url, "/envs")
            assert status == 200
            assert {"name": ENV, "version": "1", "path": "/envs/python-tool@1"}.items() <= next(
                e for e in listing["environments"] if e["name"] == ENV
            ).items()
            status, body = await http_get(facade.url, "/envs/pyhton-tool/schema")
            assert status == 404 and "did you mean" in body["detail"], body
            status, body = await http_get(facade.url, "/envs/python-tool@1/metadata")
            assert status == 200 and body["name"] == "python-tool@1" and body["version"] == "1"
            status, body = await http_get(facade.url, "/envs/python-tool/schema")
            assert status == 200 and "answer" in body["action"]["properties"]
            async with env_client(facade.url, "python-tool@1") as env:
                r = await env.reset(task_id="py-000")
                assert r.metadata["env"] == "python-tool@1" and open_sessions(orch) == 1
        finally:
            await facade.close()
        await until(lambda: open_sessions(orch) == 0, "closed")


async def _line(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    while True:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 120)
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"no {prefix!r} line: {err[-2000:]}")
        if line.startswith(prefix):
            return line.split()[1]


def _envfleet(*args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "orchestrator.cli", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)


async def test_serve_openenv_port_and_the_openenv_command(tmp_path: Path) -> None:
    serve_args = ("--backend", "fake", "--owner", TEST_OWNER, "--workers", "0", "--metrics-port", "-1")
    server = _envfleet("serve", "--port", "0", "--data-dir", str(tmp_path), "--openenv-port", "0", *serve_args)
    procs = [server]
    try:
        address = await _line(server, "listening ")
        inside = (await _line(server, "openenv ")).removesuffix("/envs/")
        standalone = _envfleet("openenv", "--server", address, "--port", "0")
        procs.append(standalone)
        outside = (await _line(standalone, "openenv ")).removesuffix("/envs/")
        for url in (inside, outside):
            async with env_client(url) as env:
                r = await env.reset(task_id="py-000")
                assert r.metadata["task_id"] == "py-000"
                r = await env.step({"answer": "x"})
                assert r.done and r.metadata["status"] == "OK"
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(60)
    assert server.returncode == 0 and procs[-1].returncode == 0
