"""A generation the policy server did not finish is never scored. vLLM and SGLang answer a request they aborted (a
weight sync pauses or aborts what is running) with HTTP 200, the partial text and tokens, and finish_reason "abort";
some servers say "error". Taken as the model's turn, that partial answer (or a tool call cut short, a submit
included) was scored: an infrastructure failure passing as a reward. It is retried as a 5xx is, within the
endpoint's max_retries, and then ends POLICY_ERROR without a reward. A finish_reason the client does not know is a
POLICY_ERROR that names it; a turn a content filter cut is TRUNCATED, as one cut at max_tokens is, and no tool call
of a cut turn runs (a submit cut at max_tokens scored 1.0 in chat mode).

Through real processes: the scripted policy server answers each case, a job runs on the fake backend behind the
real gRPC server, the trainer reads the stream; the chat and the token-in, token-out (tito) paths."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import PolicyError, PolicyResponseError
from orchestrator.core.models import JobSpec, Rollout, RolloutStatus
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.rollout.policy.parsing import parse_chat_completion
from orchestrator.rollout.tito.policy import parse_completion
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step, start_scripted_server
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, serve

NO_HANG_S = 90.0
RETRIES = 1  # each failed generation is asked for twice


def _submit_step(task_index: int, finish_reason: str | None = None) -> Step:
    """The task's correct submit call: scored 1.0 when it is taken as the model's turn."""
    task = Registry.from_entry_points().get(ENV).tasks()[task_index]
    submit = next(inv for inv in task.reference if inv.name == "submit")
    return Step(
        tool_calls=[ScriptedToolCall(name="submit", arguments=dict(submit.arguments))], finish_reason=finish_reason
    )


@pytest.fixture
def task_ids() -> list[str]:
    return [t.id for t in Registry.from_entry_points().get(ENV).tasks()][:6]


async def _run(
    tmp_path: Path,
    script: Script,
    task_ids: list[str],
    *,
    server: dict[str, Any] | None = None,
    spec: dict[str, Any] | None = None,
    policy: dict[str, Any] | None = None,
) -> tuple[dict[str, Rollout], int]:
    """Run one job of `task_ids` against the scripted server (`server`, `spec` and `policy`: settings added to the
    orchestrator's config, the job spec and its policy endpoint); the rollouts by task, and the completion requests
    the policy server received."""
    async with (
        await start_scripted_server(script) as scripted,
        serve(tmp_path / "data", backend=FAKE, **(server or {})) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        chat = job(scripted.url, task_ids, max_concurrency=len(task_ids)).model_dump()
        # no wait for a server down or busy (a generation aborted is one): what the retries make of each answer
        endpoint = {**chat["policy"], "max_retries": RETRIES, "outage_wait_s": 0, **(policy or {})}
        job_id = await client.submit(JobSpec.model_validate({**chat, **(spec or {}), "policy": endpoint}))
        async with asyncio.timeout(NO_HANG_S):
            rollouts = [r async for r in client.rollouts(job_id)]
        return {r.task_id: r for r in rollouts}, scripted.requests


def _unscored(r: Rollout, kind: str, message: str) -> str | None:
    """Why `r` is not the POLICY_ERROR it must be (None when it is): no reward, no tool call of the failed turn."""
    ran = [c.name for t in r.turns for c in (t.tool_calls or [])]
    if r.status != RolloutStatus.POLICY_ERROR or r.reward is not None or r.error is None:
        return f"{r.status} reward={r.reward} error={r.error}"
    if r.error.kind != kind or message not in r.error.message:
        return f"error {r.error.kind}: {r.error.message}"
    if ran:
        return f"the failed turn's tool calls ran: {ran}"
    return None


async def test_an_aborted_generation_is_retried_then_a_policy_error_never_a_reward(
    tmp_path: Path, task_ids: list[str]
) -> None:
    aborted, cut_submit, errored, unknown, filtered, solved = task_ids
    length_cut = Registry.from_entry_points().get(ENV).tasks()[6].id
    script = Script(
        tasks={
            aborted: [Step(content="The answer is 22435", finish_reason="abort")],
            cut_submit: [_submit_step(1, "abort")],  # the correct answer, in a call the server never finished
            errored: [Step(content="partial", finish_reason="error")],
            unknown: [Step(content="x", finish_reason="eos_or_something")],
            filtered: [Step(content="partial", finish_reason="content_filter")],
            solved: [_submit_step(5)],
            # cut at max_tokens while writing the call: the server parsed one, but its turn did not end
            length_cut: [_submit_step(6, "length")],
        }
    )
    by_task, requests = await _run(tmp_path, script, [*task_ids, length_cut])
    failed_turn = "did not finish the generation"
    wrong = {
        task: why
        for task, why in {
            aborted: _unscored(by_task[aborted], "GenerationAborted", f"{failed_turn} (finish_reason 'abort')"),
            cut_submit: _unscored(by_task[cut_submit], "GenerationAborted", "finish_reason 'abort'"),
            errored: _unscored(by_task[errored], "GenerationAborted", "finish_reason 'error'"),
            unknown: _unscored(
                by_task[unknown], "PolicyResponseError", "choices[0].finish_reason is 'eos_or_something'"
            ),
        }.items()
        if why is not None
    }
    assert not wrong, wrong
    error = by_task[aborted].error
    assert error is not None and f"(attempt {RETRIES + 1} of {RETRIES + 1})" in error.message, error
    # a content filter cut the turn: the model's own answer, but not a finished one
    assert by_task[filtered].status == RolloutStatus.TRUNCATED, by_task[filtered].error
    # a call in a turn cut at max_tokens never runs (the correct submit scored 1.0): TRUNCATED, as tito drops it
    cut = by_task[length_cut]
    assert (cut.status, cut.reward) == (RolloutStatus.TRUNCATED, 0.0), (cut.status, cut.reward, cut.error)
    assert not [c.name for t in cut.turns for c in (t.tool_calls or [])]
    assert by_task[solved].status == RolloutStatus.OK and by_task[solved].reward == 1.0, by_task[solved].error
    # the three failed generations were each asked for again; an unknown finish_reason is not a server hiccup
    assert requests == 3 * (RETRIES + 1) + 1 + 1 + 1 + 1


async def test_an_aborted_tito_generation_is_a_policy_error_never_a_reward(tmp_path: Path, task_ids: list[str]) -> None:
    """Token-in, token-out: the /v1/completions answer's finish_reason, the tool parser never run on a cut sample."""
    pytest.importorskip("transformers")
    from orchestrator.testing.qwen_like import QWEN_LIKE_DIR

    aborted, cut_submit, solved = task_ids[:3]
    script = Script(
        template="qwen3",
        tasks={
            aborted: [Step(content="The answer is", finish_reason="abort")],
            cut_submit: [_submit_step(1, "abort")],
            solved: [_submit_step(2)],
        },
    )
    by_task, requests = await _run(
        tmp_path,
        script,
        [aborted, cut_submit, solved],
        server={"tokenizer_dirs": [QWEN_LIKE_DIR.parent]},
        spec={"token_mode": "tito"},
        policy={"tokenizer": QWEN_LIKE_DIR.name},
    )
    for task in (aborted, cut_submit):
        why = _unscored(by_task[task], "GenerationAborted", "(finish_reason 'abort')")
        assert why is None, (task, why)
    assert by_task[solved].status == RolloutStatus.OK and by_task[solved].reward == 1.0, by_task[solved].error
    assert requests == 2 * (RETRIES + 1) + 1


# --- the client's retry and the parsers, value by value -----------------------------------------------------------

Respond = Callable[[int], bytes]


@pytest.fixture
async def answering_server() -> AsyncIterator[Callable[[Respond], Awaitable[str]]]:
    """HTTP servers on loopback; `respond(n)` is the JSON body of the n-th request's 200 answer."""
    servers: list[asyncio.Server] = []

    async def start(respond: Respond) -> str:
        count = 0

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal count
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            body = respond(count)
            count += 1
            head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()


def _chat(content: str, finish_reason: Any) -> bytes:
    return json.dumps({"choices": [{"message": {"content": content}, "finish_reason": finish_reason}]}).encode()


async def test_an_aborted_generation_is_asked_for_again(
    answering_server: Callable[[Respond], Awaitable[str]],
) -> None:
    """The weight sync is over by the next attempt: the turn is the one the server finished, never the partial."""
    url = await answering_server(lambda n: _chat("partial", "abort") if n == 0 else _chat("final", "stop"))
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, max_retries=1), backoff_base_s=0.01)
    try:
        completion = await policy.complete([{"role": "user", "content": "hi"}], [], Sampling())
    finally:
        await policy.aclose()
    assert (completion.text, completion.finish_reason) == ("final", "stop")

    url = await answering_server(lambda n: _chat("partial", "abort"))
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, max_retries=2, outage_wait_s=0), backoff_base_s=0.01)
    try:
        with pytest.raises(
            PolicyError, match=r"did not finish the generation \(finish_reason 'abort'\).*attempt 3 of 3"
        ):
            await policy.complete([{"role": "user", "content": "hi"}], [], Sampling())
    finally:
        await policy.aclose()


async def test_a_server_that_aborts_for_a_while_is_waited_out_and_an_error_is_not(
    answering_server: Callable[[Respond], Awaitable[str]],
) -> None:
    """A weight sync that aborts every request for longer than the retries' second or two is waited out
    (PolicyEndpoint.outage_wait_s), never taken as a turn; finish_reason "error" is the server failing this request,
    retried max_retries times only; a server that aborts for good is a POLICY_ERROR once the wait is over."""
    hi = [{"role": "user", "content": "hi"}]
    url = await answering_server(lambda n: _chat("partial", "abort") if n < 6 else _chat("final", "stop"))
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, max_retries=0, outage_wait_s=30), backoff_base_s=0.01)
    try:
        assert (await policy.complete(hi, [], Sampling())).text == "final"
    finally:
        await policy.aclose()

    asked = 0

    def errored(n: int) -> bytes:
        nonlocal asked
        asked += 1
        return _chat("partial", "error")

    url = await answering_server(errored)
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, max_retries=1, outage_wait_s=30), backoff_base_s=0.01)
    try:
        with pytest.raises(PolicyError, match=r"finish_reason 'error'\).*\(attempt 2 of 2\)$"):
            await policy.complete(hi, [], Sampling())
    finally:
        await policy.aclose()
    assert asked == 2

    url = await answering_server(lambda n: _chat("partial", "abort"))
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, max_retries=0, outage_wait_s=0.3), backoff_base_s=0.01)
    try:
        with pytest.raises(PolicyError, match=r"finish_reason 'abort'\).*down or busy.* outage_wait_s \(0\.3s\)"):
            await policy.complete(hi, [], Sampling())
    finally:
        await policy.aclose()


@pytest.mark.parametrize(
    ("finish_reason", "kept"),
    [
        ("stop", "stop"),
        ("length", "length"),
        ("tool_calls", "tool_calls"),
        ("function_call", "function_call"),
        ("content_filter", "content_filter"),
        ("eos_token", "eos_token"),  # TGI's names for a stop
        ("stop_sequence", "stop_sequence"),
        (None, "unknown"),  # not said: as before, a finished turn
    ],
)
def test_the_finish_reasons_a_turn_may_end_with(finish_reason: str | None, kept: str) -> None:
    choice = {"message": {"content": "x"}, "finish_reason": finish_reason}
    assert parse_chat_completion({"choices": [choice]}, model="m").finish_reason == kept
    sample = parse_completion({"choices": [{"token_ids": [1], "finish_reason": finish_reason}]}, [7], 4, model="m")
    assert sample.finish_reason == kept


@pytest.mark.parametrize(
    ("finish_reason", "error", "match"),
    [
        ("abort", PolicyError, r"did not finish the generation \(finish_reason 'abort'\)"),
        ("error", PolicyError, r"did not finish the generation \(finish_reason 'error'\)"),
        ("ABORT", PolicyResponseError, r"choices\[0\]\.finish_reason is 'ABORT', which this client does not know"),
        ("", PolicyResponseError, r"choices\[0\]\.finish_reason is '', which"),
        (
            "aws-secret-0123456789-from-the-metadata-service/" * 4,
            PolicyResponseError,
            r"choices\[0\]\.finish_reason is a string of 192 characters, which",
        ),
        ({"type": "abort"}, PolicyResponseError, r"choices\[0\]\.finish_reason is a dict, expected a string"),
        (1.5, PolicyResponseError, r"choices\[0\]\.finish_reason is a float, expected a string"),
    ],
)
def test_a_finish_reason_that_is_no_finished_turn_is_refused(finish_reason: Any, error: type, match: str) -> None:
    choice = {"message": {"content": "x"}, "finish_reason": finish_reason}
    with pytest.raises(error, match=match) as e:
        parse_chat_completion({"choices": [choice]}, model="m")
    assert "aws-secret" not in str(e.value)
    with pytest.raises(error, match=match):
        parse_completion({"choices": [{"token_ids": [1], "finish_reason": finish_reason}]}, [7], 4, model="m")
