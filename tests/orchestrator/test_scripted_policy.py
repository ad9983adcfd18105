"""The toy tokenizer and the scripted OpenAI-compatible server, spoken to over raw HTTP/1.1 and run as a CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from orchestrator.testing import toy_tokenizer as toy
from orchestrator.testing.scripted_policy import (
    MAX_BODY,
    Script,
    ScriptedPolicyApp,
    ScriptedServer,
    Step,
    sample_of,
    start_scripted_server,
    task_of,
)

REPO = Path(__file__).resolve().parents[2]


# --- toy tokenizer ---------------------------------------------------------------------------------------------------


def _assistant(content: str | None, calls: list[tuple[str, dict[str, Any]]], turn: int) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [
            {"id": f"call_{turn}_{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate(calls)
        ]
    return msg


def test_encoding_and_special_tokens() -> None:
    assert toy.encode("Hi") == [ord("H") + 16, ord("i") + 16]
    assert toy.encode("é") == [0xC3 + 16, 0xA9 + 16]
    assert toy.decode(toy.encode("héllo ✓")) == "héllo ✓"
    assert toy.prompt_ids([{"role": "user", "content": "a"}]) == [toy.USER, ord("a") + 16, toy.END, toy.ASSISTANT]
    assert toy.prompt_ids([]) == [toy.ASSISTANT]
    assert (toy.SYSTEM, toy.USER, toy.ASSISTANT, toy.TOOL, toy.END) == (1, 2, 3, 4, 5)
    assert toy.token_text(ord("a") + 16) == "a" and toy.token_text(toy.END) == "<|end|>"
    with pytest.raises(ValueError, match="unknown message role 'robot'"):
        toy.prompt_ids([{"role": "robot", "content": "x"}])


def test_same_message_same_tokens() -> None:
    a = _assistant(None, [("bash", {"cmd": "ls", "flags": ["-l"]})], 0)
    # key order, extra fields and content null vs "" do not change the rendering
    b = json.loads(json.dumps(a))
    b["tool_calls"][0] = {"function": dict(reversed(b["tool_calls"][0]["function"].items())), **b["tool_calls"][0]}
    b["tool_calls"][0]["index"] = 0
    b["content"] = ""
    assert toy.completion_ids(a) == toy.completion_ids(b)
    assert toy.render_message_body(a).startswith('[{"function":{"arguments":')


def test_prefix_property_over_a_multi_turn_conversation_with_tool_calls() -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Fix the bug in ünïcode.py"},
    ]
    turns = [
        _assistant("Looking.", [("bash", {"cmd": "cat ünïcode.py"})], 0),
        _assistant(None, [("write_file", {"path": "a.py", "text": "x = 1\n"}), ("bash", {"cmd": "pytest -q"})], 1),
        _assistant("Fixed it.", [], 2),
    ]
    for turn, reply in enumerate(turns):
        before = toy.prompt_ids(msgs)
        observations = [
            {"role": "tool", "tool_call_id": tc["id"], "content": f"output {turn}"}
            for tc in reply.get("tool_calls", [])
        ]
        msgs = [*msgs, reply, *observations]
        after = toy.prompt_ids(msgs)
        completion = toy.completion_ids(reply)
        assert after[: len(before) + len(completion)] == before + completion
        assert completion[-1] == toy.END and toy.END not in completion[:-1]


_text = st.text(max_size=20)
_args = st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), _text), max_size=3)
_calls = st.lists(st.tuples(st.text(min_size=1, max_size=8), _args), max_size=3)


@settings(max_examples=30, deadline=None)
@given(
    history=st.lists(st.tuples(st.sampled_from(["system", "user", "tool"]), _text), min_size=1, max_size=4),
    content=st.one_of(st.none(), _text),
    calls=_calls,
    after=st.lists(_text, max_size=3),
)
def test_prefix_property_holds_for_any_conversation(
    history: list[tuple[str, str]], content: str | None, calls: list[tuple[str, dict[str, Any]]], after: list[str]
) -> None:
    msgs = [{"role": r, "content": c} for r, c in history]
    reply = _assistant(content, calls, 0)
    later = [*msgs, reply, *({"role": "tool", "content": c} for c in after)]
    expected = toy.prompt_ids(msgs) + toy.completion_ids(reply)
    assert toy.prompt_ids(later)[: len(expected)] == expected


def test_logprob_is_deterministic_and_in_range() -> None:
    values = [toy.logprob(t, p) for t in range(300) for p in range(50)]
    assert all(-5 <= v < 0 for v in values)
    assert toy.logprob(42, 7) == toy.logprob(42, 7) == -(((42 * 31 + 7 * 17) % 97) + 1) / 20


# --- script model ----------------------------------------------------------------------------------------------------


def test_task_of_a_rollout_id() -> None:
    assert task_of("job1:task-a:0") == "task-a"
    assert task_of("job1:repo:issue:12:3") == "repo:issue:12"  # task ids may contain ':'
    assert task_of("job1::0") == ""
    assert task_of("no-colons") is None
    assert task_of("job:0") is None
    assert task_of("") is None
    assert sample_of("job1:repo:issue:12:3") == 3 and sample_of("job1:t:x") is None and sample_of("t") is None


def test_script_validation() -> None:
    with pytest.raises(ValidationError, match="Extra inputs"):
        Script.model_validate({"tasks": {}, "latency": 1})
    with pytest.raises(ValidationError, match="either an error_status or a hang"):
        Step(error_status=500, hang=True)
    with pytest.raises(ValidationError, match="fail_times needs a fault"):
        Step(content="x", fail_times=1)
    with pytest.raises(ValidationError):
        Step(error_status=200)
    with pytest.raises(ValidationError, match="fault_samples needs a fault"):
        Step(content="x", fault_samples=[1])


async def test_a_fault_can_hit_some_samples_of_a_group_only() -> None:
    # one failed sample inside a group: the step's fault for sample 1, its normal answer for the others
    steps = [{"content": "ok", "error_status": 400, "fault_samples": [1], "fail_times": 1}]
    server = await start_scripted_server(Script.model_validate({"tasks": {"t": steps}}))
    try:
        async with httpx.AsyncClient() as http:

            async def status(user: str) -> int:
                body = {"messages": [{"role": "user", "content": "q"}], "user": user}
                r = await http.post(f"{server.url}/chat/completions", json=body)
                return r.status_code

            assert [await status(u) for u in ("j:t:0", "j:t:1", "j:t:2", "j:t:1")] == [200, 400, 200, 200]
        assert server.faults == 1  # fail_times counts the faulted sample's attempts only
    finally:
        await server.close()


# --- the server over raw HTTP ----------------------------------------------------------------------------------------


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    script = Script.model_validate({"tasks": {"t": [{"content": "héllo"}, {"hang": True}]}})
    s = await start_scripted_server(script)
    yield s
    await s.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], Any]:
    status_line = await reader.readline()
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, json.loads(body) if headers.get("content-type") == "application/json" else body


def _request(method: str, path: str, body: bytes = b"", extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def _chat(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload).encode()


async def test_routes_keep_alive_and_errors(server: ScriptedServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        # several requests on one keep-alive connection
        writer.write(_request("GET", "/health"))
        assert (await _read_response(reader))[::2] == (200, {"status": "ok"})
        writer.write(_request("GET", "/v1/models"))
        status, headers, models = await _read_response(reader)
        # HTTP/1.1 keeps the connection open unless told otherwise: no "Connection: close"
        assert (status, headers.get("connection"), models["data"][0]["id"]) == (200, None, "policy")
        writer.write(_request("GET", "/v2/nothing"))
        assert (await _read_response(reader))[0] == 404
        writer.write(_request("GET", "/v1/chat/completions"))
        assert (await _read_response(reader))[0] == 405
        writer.write(_request("POST", "/v1/chat/completions", b'{"messages": [oops'))
        status, headers, err = await _read_response(reader)
        assert status == 400 and headers["content-type"] == "application/json"
        assert "not valid JSON" in err["error"]["message"] and err["error"]["code"] == 400
        writer.write(_request("POST", "/v1/chat/completions", _chat({"messages": []})))
        assert "non-empty list" in (await _read_response(reader))[2]["error"]["message"]
        writer.write(_request("POST", "/v1/chat/completions", _chat({"messages": [{"role": "robot"}]})))
        assert "unknown message role" in (await _read_response(reader))[2]["error"]["message"]
        # still the same connection, and now a real completion; Connection: close is honoured
        body = _chat({"messages": [{"role": "user", "content": "hi"}], "user": "j:t:0", "logprobs": True})
        writer.write(_request("POST", "/v1/chat/completions", body, "Connection: close\r\n"))
        status, headers, resp = await _read_response(reader)
        assert (status, headers["connection"]) == (200, "close")
        assert await reader.read() == b""  # the server closed the connection
    finally:
        writer.close()
    choice = resp["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "héllo", "tool_calls": []}
    assert choice["finish_reason"] == "stop" and "token_ids" not in choice and "prompt_token_ids" not in resp
    ids = toy.completion_ids(choice["message"])
    # without return_tokens_as_token_ids the token is its text, vLLM style
    assert [e["token"] for e in choice["logprobs"]["content"]] == [toy.token_text(t) for t in ids]
    assert choice["logprobs"]["content"][1]["token"] == "bytes:\\xc3"
    assert [e["bytes"] for e in choice["logprobs"]["content"][:2]] == [[ord("h")], [0xC3]]
    prompt = toy.prompt_ids([{"role": "user", "content": "hi"}])
    assert resp["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt) + len(ids),
    }
    assert server.requests == 4


async def test_malformed_request_line_gets_400_and_close(server: ScriptedServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"NONSENSE\r\n\r\n")
    status, headers, _ = await _read_response(reader)  # uvicorn's own answer, before the app sees anything
    assert (status, headers["connection"]) == (400, "close")
    assert await reader.read() == b""
    writer.close()
    assert server.requests == 0


async def test_a_port_in_use_raises_instead_of_exiting(server: ScriptedServer) -> None:
    with pytest.raises(OSError, match="in use"):
        await start_scripted_server(Script(), port=server.port)
    assert (await _get_health(server.url)) == {"status": "ok"}  # the first server is untouched


async def _get_health(url: str) -> Any:
    async with httpx.AsyncClient() as c:
        return (await c.get(url.removesuffix("/v1") + "/health")).json()


async def test_a_body_over_the_cap_gets_413(server: ScriptedServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    try:
        # answered from the header, before a byte of the body is sent
        writer.write(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: {MAX_BODY + 1}\r\n\r\n".encode()
        )
        status, _, err = await asyncio.wait_for(_read_response(reader), 5)
    finally:
        writer.close()
    assert status == 413 and err["error"]["message"] == f"body over {MAX_BODY} bytes"


async def test_a_hang_holds_the_connection_and_close_ends_it(server: ScriptedServer) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "héllo"}]
    writer.write(_request("POST", "/v1/chat/completions", _chat({"messages": msgs, "user": "j:t:0"})))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(reader.read(1), 0.3)
    assert server.faults == 1
    await asyncio.wait_for(server.close(), 3)  # a hanging handler does not block shutdown: it answers 503
    status, _, err = await asyncio.wait_for(_read_response(reader), 3)
    assert status == 503 and err["error"]["message"] == "the scripted server is shutting down"
    assert await asyncio.wait_for(reader.read(), 3) == b""
    writer.close()


async def test_tokens_as_ids_and_server_without_tokens() -> None:
    script = Script.model_validate({"default": [{"tool_calls": [{"name": "submit", "arguments": {"answer": "4"}}]}]})
    payload: dict[str, Any] = {
        "messages": [{"role": "user", "content": "2+2?"}],
        "logprobs": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    for tokens in (True, False):
        s = await start_scripted_server(script, tokens=tokens)
        try:
            async with httpx.AsyncClient() as c:
                resp = (await c.post(f"{s.url}/chat/completions", json=payload)).json()
        finally:
            await s.close()
        choice = resp["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["content"] is None
        assert choice["message"]["tool_calls"] == [
            {"id": "call_0_0", "type": "function", "function": {"name": "submit", "arguments": '{"answer": "4"}'}}
        ]
        if tokens:
            ids = toy.completion_ids(choice["message"])
            assert resp["prompt_token_ids"] == toy.prompt_ids(payload["messages"])
            assert choice["token_ids"] == ids
            assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]
            assert [e["logprob"] for e in choice["logprobs"]["content"]] == [
                toy.logprob(t, i) for i, t in enumerate(ids)
            ]
        else:
            assert "prompt_token_ids" not in resp and "token_ids" not in choice and choice["logprobs"] is None
            assert resp["usage"]["completion_tokens"] > 0


async def test_latency_is_simulated() -> None:
    s = await start_scripted_server(Script(latency_s=0.2))
    try:
        async with httpx.AsyncClient() as c:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            r = await c.post(f"{s.url}/chat/completions", json={"messages": [{"role": "user", "content": "?"}]})
            assert loop.time() - t0 >= 0.2
    finally:
        await s.close()
    assert r.json()["choices"][0]["message"]["content"] == "I cannot solve this."


async def test_latency_jitter_spreads_answers_the_same_way_in_every_run() -> None:
    """latency_s +- latency_jitter_s, drawn from the rollout and turn: the answers of a batch that started together
    drift apart, the same way in every run (a new app, as another process would be), and each is held that long."""
    script = Script(latency_s=1.0, latency_jitter_s=0.5)
    drawn = [ScriptedPolicyApp(script)._latency(f"job:t{i}:0", turn) for i in range(200) for turn in range(3)]
    assert drawn == [ScriptedPolicyApp(script)._latency(f"job:t{i}:0", turn) for i in range(200) for turn in range(3)]
    assert all(0.5 <= t <= 1.5 for t in drawn)
    assert min(drawn) < 0.6 and max(drawn) > 1.4 and abs(sum(drawn) / len(drawn) - 1.0) < 0.05
    assert ScriptedPolicyApp(Script(latency_s=0.2, latency_jitter_s=5))._latency("job:t0:0", 0) >= 0
    assert ScriptedPolicyApp(Script(latency_s=0.2))._latency("job:t0:0", 0) == 0.2
    with pytest.raises(ValidationError):
        Script(latency_jitter_s=-1)

    quick = Script(latency_s=0.3, latency_jitter_s=0.2)
    user = min((f"job:t{i}:0" for i in range(50)), key=lambda u: -ScriptedPolicyApp(quick)._latency(u, 0))
    s = await start_scripted_server(quick)
    try:
        async with httpx.AsyncClient() as c:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            body = {"messages": [{"role": "user", "content": "?"}], "user": user}
            (await c.post(f"{s.url}/chat/completions", json=body)).raise_for_status()
            assert loop.time() - t0 >= ScriptedPolicyApp(quick)._latency(user, 0) > 0.45
    finally:
        await s.close()


# --- the CLI ---------------------------------------------------------------------------------------------------------


def test_cli_serves_until_sigterm(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"tasks": {"t": [{"content": "from the CLI"}]}}))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "orchestrator.testing.scripted_policy",
            "--script",
            str(script),
            "--port",
            "0",
            "--no-tokens",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("listening http://127.0.0.1:") and line.endswith("/v1"), line
        url = line.split()[1]
        r = httpx.post(
            f"{url}/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "user": "j:t:0", "return_token_ids": True},
        )
        assert r.json()["choices"][0]["message"]["content"] == "from the CLI"
        assert "prompt_token_ids" not in r.json()  # --no-tokens
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_rejects_a_bad_script(tmp_path: Path) -> None:
    script = tmp_path / "bad.json"
    script.write_text(json.dumps({"tasks": {"t": [{"contents": "typo"}]}}))
    r = subprocess.run(
        [sys.executable, "-m", "orchestrator.testing.scripted_policy", "--script", str(script)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "cannot load script" in r.stderr and "contents" in r.stderr
