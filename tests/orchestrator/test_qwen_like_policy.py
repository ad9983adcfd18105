"""The scripted policy's qwen3 mode, a model server double: token-id prompts on /v1/completions, chat rendered and
parsed like vLLM serving Qwen3, answers sampled as ids and logged, max_tokens and max_model_len, and the real-world
failure it exists to show: a chat-mode rollout through the orchestrator arrives with `inconsistent` tokens."""

from __future__ import annotations

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

pytest.importorskip("transformers")

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import RolloutStatus
from orchestrator.service.registry import Registry
from orchestrator.testing.qwen_policy import COMPLETIONS_DEFAULT_MAX_TOKENS, QwenLikeModel
from orchestrator.testing.scripted_policy import Script, ScriptedServer, start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.orchestrator.conftest import ENV, job

REPO = Path(__file__).resolve().parents[2]
USER = "job1:t:0"
PYTHON = {"name": "python", "arguments": {"code": "print(2 + 2)"}}
STEPS = [{"tool_calls": [PYTHON]}, {"content": "Let me check.", "tool_calls": [PYTHON]}, {"content": "4"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
]
FIRST = [{"role": "system", "content": "You solve puzzles."}, {"role": "user", "content": "Compute 2 + 2."}]
TOKENS = {"return_token_ids": True, "logprobs": True, "return_tokens_as_token_ids": True}


@pytest.fixture
async def server() -> AsyncIterator[ScriptedServer]:
    s = await start_scripted_server(Script.model_validate({"template": "qwen3", "tasks": {"t": STEPS}}))
    yield s
    await s.close()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


def _observation(model: QwenLikeModel, result: str) -> list[int]:
    # the tokens between an assistant turn's <|im_end|> and the next generation prompt, as the template renders them
    return model.encode(
        f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


async def _complete(http: httpx.AsyncClient, server: ScriptedServer, prompt: Any, **kw: Any) -> httpx.Response:
    body = {"prompt": prompt, "user": USER, "return_token_ids": True, "logprobs": 0, "max_tokens": 200, **kw}
    return await http.post(f"{server.url}/completions", json=body)


async def test_token_id_prompts_answer_the_logged_sample(server: ScriptedServer, http: httpx.AsyncClient) -> None:
    model = server.app.model
    prompt = model.chat_prompt(FIRST, TOOLS, {})
    r = await _complete(http, server, prompt)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    (sample,) = server.samples
    assert (sample.user, sample.turn, sample.prompt_ids, sample.finish_reason) == (USER, 0, prompt, "stop")
    assert choice["prompt_token_ids"] == prompt and choice["token_ids"] == sample.ids
    assert choice["logprobs"]["token_logprobs"] == sample.logprobs and all(-5 <= lp < 0 for lp in sample.logprobs)
    assert len(choice["logprobs"]["tokens"]) == len(sample.ids) and choice["finish_reason"] == "stop"
    assert sample.ids[-1] == model.eos_id
    # <think>, then the call spaced unlike json.dumps; the text skips <|im_end|> as vLLM's does
    text = model.decode(sample.ids)
    assert text.startswith("<think>\n") and "\n</think>\n\n<tool_call>\n" in text
    assert '{"name":"python",  "arguments": {"code": "print(2 + 2)"}}\n</tool_call><|im_end|>' in text
    assert choice["text"] == text.removesuffix("<|im_end|>")
    # a sampled tokenization is not the canonical one: decoding and re-encoding gives other ids
    assert model.encode(text) != sample.ids

    # a retry is the same turn (read from the prompt) and samples the same ids
    again = (await _complete(http, server, prompt)).json()["choices"][0]
    assert again["token_ids"] == sample.ids and server.samples[1].turn == 0

    # token in, token out: the next prompt is exactly what was seen and sampled, plus the observation
    nxt = prompt + sample.ids + _observation(model, "4")
    second = (await _complete(http, server, nxt, return_tokens_as_token_ids=True)).json()["choices"][0]
    assert server.samples[2].turn == 1 and server.samples[2].prompt_ids == nxt
    assert second["token_ids"] == server.samples[2].ids
    assert second["logprobs"]["tokens"] == [f"token_id:{t}" for t in second["token_ids"]]
    assert "Let me check.\n<tool_call>" in second["text"]
    # the same prompt as a string samples the same turn too
    as_text = (await _complete(http, server, model.decode(nxt))).json()["choices"][0]
    assert (
        as_text["prompt_token_ids"] == model.encode(model.decode(nxt)) and as_text["token_ids"] == second["token_ids"]
    )


async def test_sampling_is_deterministic_per_rollout_and_turn(server: ScriptedServer, http: httpx.AsyncClient) -> None:
    prompt = server.app.model.chat_prompt(FIRST, None, {})
    a = (await _complete(http, server, prompt, user="job1:t:0")).json()["choices"][0]
    b = (await _complete(http, server, prompt, user="job2:t:5")).json()["choices"][0]
    assert server.samples[0].ids != server.samples[1].ids  # same step, other rollout: other reasoning or splits
    assert server.app.model.parse(a["token_ids"], 0).tool_calls == server.app.model.parse(b["token_ids"], 0).tool_calls
    restarted = await start_scripted_server(server.script)
    try:
        c = (await _complete(http, restarted, prompt, user="job1:t:0")).json()["choices"][0]
    finally:
        await restarted.close()
    assert c["token_ids"] == a["token_ids"] and c["logprobs"]["token_logprobs"] == a["logprobs"]["token_logprobs"]


async def test_chat_renders_and_parses_like_vllm(server: ScriptedServer, http: httpx.AsyncClient) -> None:
    model = server.app.model
    r = await http.post(
        f"{server.url}/chat/completions", json={"messages": FIRST, "tools": TOOLS, "user": USER, **TOKENS}
    )
    assert r.status_code == 200, r.text
    data = r.json()
    choice, (sample,) = data["choices"][0], server.samples
    prompt = model.encode(
        model.tokenizer.apply_chat_template(FIRST, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    )
    assert data["prompt_token_ids"] == prompt == sample.prompt_ids
    assert choice["token_ids"] == sample.ids
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == sample.logprobs
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in sample.ids]
    msg = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and msg["content"] == "\n\n"  # what vLLM leaves before a call
    assert msg["reasoning_content"].strip() and "<think>" not in msg["reasoning_content"]
    assert msg["tool_calls"] == [
        {"id": "call_0_0", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(2 + 2)"}'}}
    ]

    # the client sends the parsed message back; the server re-renders it: thinking gone, the call re-serialized
    history = [*FIRST, msg, {"role": "tool", "tool_call_id": "call_0_0", "content": "4"}]
    history.append({"role": "user", "content": "And 3 + 3?"})
    r2 = await http.post(
        f"{server.url}/chat/completions", json={"messages": history, "tools": TOOLS, "user": USER, **TOKENS}
    )
    nxt = r2.json()["prompt_token_ids"]
    assert server.samples[1].turn == 1 and nxt == server.samples[1].prompt_ids
    assert nxt[: len(prompt)] == prompt
    assert nxt[: len(prompt) + len(sample.ids)] != prompt + sample.ids  # the real-world failure
    rerendered = model.decode(nxt[len(prompt) :])
    assert "<think>" not in rerendered and '{"name": "python", "arguments": {"code": "print(2 + 2)"}}' in rerendered


async def test_max_tokens_cuts_with_length(server: ScriptedServer, http: httpx.AsyncClient) -> None:
    prompt = server.app.model.chat_prompt(FIRST, TOOLS, {})
    full = (await _complete(http, server, prompt)).json()["choices"][0]["token_ids"]
    cut = (await _complete(http, server, prompt, max_tokens=7)).json()["choices"][0]
    assert cut["finish_reason"] == "length" and cut["token_ids"] == full[:7] == server.samples[1].ids
    assert len(cut["logprobs"]["token_logprobs"]) == 7 and server.samples[1].finish_reason == "length"
    default = (await _complete(http, server, prompt, max_tokens=None)).json()["choices"][0]
    assert len(default["token_ids"]) == COMPLETIONS_DEFAULT_MAX_TOKENS and default["finish_reason"] == "length"
    # in chat, a call cut before its </tool_call> is no call: the text stays content
    r = await http.post(
        f"{server.url}/chat/completions",
        json={"messages": FIRST, "tools": TOOLS, "user": USER, "max_tokens": len(full) - 6, **TOKENS},
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
    assert "<tool_call>" in choice["message"]["content"] and choice["token_ids"] == full[: len(full) - 6]


async def test_max_model_len_is_enforced_like_vllm(http: httpx.AsyncClient) -> None:
    script = Script.model_validate({"template": "qwen3", "tasks": {"t": STEPS}, "max_model_len": 64})
    server = await start_scripted_server(script)
    try:
        models = (await http.get(f"{server.url}/models")).json()
        assert models["data"][0]["max_model_len"] == 64
        r = await _complete(http, server, [5] * 64, max_tokens=None)
        assert r.status_code == 400 and "maximum context length is 64 tokens" in r.json()["error"]["message"]
        r = await _complete(http, server, [5] * 60, max_tokens=5)
        assert r.status_code == 400 and "'max_tokens' is too large: 5" in r.json()["error"]["message"]
        r = await _complete(http, server, [5] * 60, max_tokens=None)  # the default is capped by the context
        assert r.json()["choices"][0]["finish_reason"] == "length" and len(server.samples[0].ids) == 4
        r = await http.post(f"{server.url}/chat/completions", json={"messages": FIRST, "tools": TOOLS, "user": USER})
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    finally:
        await server.close()


async def test_bad_requests_get_clear_400s(server: ScriptedServer, http: httpx.AsyncClient) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt": [1, 99999]}, "prompt[1] = 99999 is not a token id in [0, "),
        ({"prompt": [1, True]}, "prompt[1] = True is not a token id"),
        ({"prompt": [[1, 2]]}, "is not a token id"),
        ({"prompt": []}, "'prompt' must be a non-empty list of token ids or a string"),
        ({"prompt": [1], "logprobs": True}, "'logprobs' of /v1/completions is the number of top logprobs"),
        ({"prompt": [1], "max_tokens": 0}, "'max_tokens' must be a positive integer"),
        ({"prompt": [1], "n": 2}, "'n' must be 1"),
    ]
    for body, fragment in cases:
        r = await http.post(f"{server.url}/completions", json={"user": USER, **body})
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], (body, r.text)
    bad_args = {"role": "assistant", "tool_calls": [{"function": {"name": "python", "arguments": "{not json"}}]}
    r = await http.post(f"{server.url}/chat/completions", json={"messages": [*FIRST, bad_args], "user": USER})
    assert r.status_code == 400 and "arguments is not JSON" in r.json()["error"]["message"]
    r = await http.post(f"{server.url}/chat/completions", json={"messages": FIRST, "tools": "python"})
    assert r.status_code == 400 and "'tools' must be a list of objects" in r.json()["error"]["message"]
    assert server.samples == []


async def test_faults_and_toy_mode_routes(http: httpx.AsyncClient) -> None:
    steps = [{"error_status": 503, "fail_times": 1}, *STEPS]
    server = await start_scripted_server(Script.model_validate({"template": "qwen3", "tasks": {"t": steps}}))
    try:
        prompt = server.app.model.chat_prompt(FIRST, None, {})
        assert (await _complete(http, server, prompt)).status_code == 503
        assert (await _complete(http, server, prompt)).status_code == 200  # the retry of the same turn answers
        assert server.faults == 1 and server.requests == 2 and len(server.samples) == 1
    finally:
        await server.close()
    toy = await start_scripted_server(Script())
    try:
        r = await http.post(f"{toy.url}/completions", json={"prompt": [1]})
        assert r.status_code == 404 and "only the qwen3 template" in r.json()["error"]["message"]
        assert toy.app._model is None
    finally:
        await toy.close()


def test_toy_mode_does_not_import_transformers() -> None:
    code = (
        "import sys, asyncio\n"
        "from orchestrator.testing.scripted_policy import Script, start_scripted_server\n"
        "async def main():\n"
        "    s = await start_scripted_server(Script())\n"
        "    await s.close()\n"
        "asyncio.run(main())\n"
        "assert 'transformers' not in sys.modules and 'tokenizers' not in sys.modules, 'imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


async def test_a_chat_mode_rollout_against_the_qwen3_double_arrives_inconsistent(
    fake_client: EnvfleetClient, task_ids: list[str], registry: Registry
) -> None:
    """The real-world failure, reproduced: a good, scored episode whose tokens cannot be stitched in chat mode."""
    script = reference_script(registry.get(ENV)).model_copy(update={"template": "qwen3"})
    server = await start_scripted_server(script)
    try:
        job_id = await fake_client.submit(job(server.url, task_ids[:1]))
        (rollout,) = [r async for r in fake_client.rollouts(job_id)]
    finally:
        await server.close()
    assert rollout.status == RolloutStatus.OK and rollout.reward == 1.0, rollout.error
    assert sum(1 for t in rollout.turns if t.role == "assistant") >= 2
    assert len(server.samples) >= 2 and [s.turn for s in server.samples[:2]] == [0, 1]
    t = rollout.tokens
    assert t.status == "inconsistent"
    assert t.prompt_ids == t.completion_ids == t.completion_mask == t.completion_logprobs == []


def test_cli_template_flag_serves_token_id_prompts(tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"tasks": {"t": [{"content": "from the CLI"}]}}))
    cmd = [sys.executable, "-m", "orchestrator.testing.scripted_policy", "--script", str(script), "--template", "qwen3"]
    proc = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("listening http://127.0.0.1:"), line
        r = httpx.post(
            f"{line.split()[1]}/completions",
            json={"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "user": USER, "max_tokens": 99},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].endswith("</think>\n\nfrom the CLI")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
