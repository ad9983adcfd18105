"""Token-in, token-out rollouts against the policy double's qwen3 mode (a Qwen3-like tokenizer and template that
drops old thinking and re-serializes tool calls): tito gives `complete` tokens whose ids and logprobs are, id for id,
the double's sample log, on a 6-turn episode of every built-in environment; the mask is 1 exactly on sampled ids;
max_model_len truncates with consistent arrays; chat mode on the same script arrives `inconsistent`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from orchestrator.backends.docker.config import DockerBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Environment, Task
from orchestrator.core.models import JobSpec, Rollout, RolloutStatus, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.testing.qwen_like import QWEN_LIKE_DIR
from orchestrator.testing.scripted_policy import Sample, Script, ScriptedServer, Step, start_scripted_server
from orchestrator.testing.scripts import filler_steps, long_script
from tests.conftest import TEST_OWNER, owned_containers

TOKENIZER = QWEN_LIKE_DIR.name  # resolved in QWEN_LIKE_DIR.parent, the server's tokenizer directory
TURNS = 6


def six_turn_steps(env: Environment, task: Task) -> list[Step]:
    return filler_steps(env, task, TURNS)


def qwen_script(env: Environment, tasks: Sequence[Task], max_model_len: int | None = None) -> Script:
    return long_script(env, tasks, turns=TURNS, max_model_len=max_model_len)


def spec(env: str, tasks: Sequence[Task], url: str, **kw: object) -> JobSpec:
    tokenizer = kw.pop("tokenizer", TOKENIZER)
    stream = bool(kw.pop("stream", False))
    return JobSpec.model_validate(
        {
            "env": env,
            "tasks": TaskSelection(kind="ids", ids=[t.id for t in tasks]),
            "policy": PolicyEndpoint(base_url=url, model="qwen-like", tokenizer=str(tokenizer), stream=stream),
            "max_turns": TURNS + 2,
            **kw,
        }
    )


def samples_of(server: ScriptedServer, rollout: Rollout) -> list[Sample]:
    return sorted((s for s in server.samples if s.user == rollout.id), key=lambda s: s.turn)


def observation_text(result: str) -> str:
    """What the Qwen-like template writes after an assistant turn's <|im_end|> for one tool result, up to the next
    generation prompt (as Qwen3's does)."""
    return f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def assert_exact(rollout: Rollout, samples: list[Sample], server: ScriptedServer) -> None:
    """The rollout's tokens are the double's samples, id for id and logprob for logprob, with the observation
    tokens between them (mask 0, logprob 0) the template's own rendering of each tool result, and exactly the
    context the double saw at each next turn."""
    t = rollout.tokens
    assert t.status == "complete", (rollout.id, t.status)
    assert len(t.completion_ids) == len(t.completion_mask) == len(t.completion_logprobs)
    assert t.prompt_ids == samples[0].prompt_ids
    context = t.prompt_ids + t.completion_ids
    at = len(t.prompt_ids)
    sampled_positions: list[int] = []
    for s in samples:
        assert context[: len(s.prompt_ids)] == s.prompt_ids, f"turn {s.turn}: the double saw another context"
        at = len(s.prompt_ids)
        assert context[at : at + len(s.ids)] == s.ids, f"turn {s.turn}: the sampled ids differ"
        sampled_positions += range(at - len(t.prompt_ids), at - len(t.prompt_ids) + len(s.ids))
        at += len(s.ids)
    assert at == len(context), "tokens after the last sample"
    ones = [i for i, m in enumerate(t.completion_mask) if m == 1]
    assert ones == sampled_positions, "the mask is 1 exactly on the sampled ids"
    # the wire carries logprobs as float32: equal at that precision, bit for bit
    sent = np.array([lp for s in samples for lp in s.logprobs], dtype=np.float32)
    assert np.array_equal(np.array([t.completion_logprobs[i] for i in ones], dtype=np.float32), sent)
    assert all(t.completion_logprobs[i] == 0.0 for i, m in enumerate(t.completion_mask) if m == 0)
    assert set(t.completion_mask) <= {0, 1}
    # each observation span (between two samples) is the template's rendering of that turn's tool result
    results = [turn.text for turn in rollout.turns if turn.role == "tool"]
    for s, following, result in zip(samples, samples[1:], results, strict=False):
        span = following.prompt_ids[len(s.prompt_ids) + len(s.ids) :]
        assert span == server.app.model.encode(observation_text(result)), f"turn {s.turn}: observation tokens"


@pytest.fixture
async def tito_orchestrator(tmp_path: Path, base_image: str) -> AsyncIterator[Orchestrator]:
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path / "data",
            backend=DockerBackendConfig(owner=TEST_OWNER),
            tokenizer_dirs=[QWEN_LIKE_DIR.parent],
        )
    )
    yield orch
    await orch.stop(grace=1)


@pytest.fixture
async def client(tito_orchestrator: Orchestrator) -> AsyncIterator[EnvfleetClient]:
    async with EnvfleetClient(tito_orchestrator.address) as c:
        yield c


async def _run(client: EnvfleetClient, job: JobSpec) -> list[Rollout]:
    return [r async for r in client.rollouts(await client.submit(job))]


@pytest.mark.parametrize("name", ["python-tool", "code-tests", "swe"])
async def test_tito_tokens_are_the_servers_samples_for_every_builtin(name: str, client: EnvfleetClient) -> None:
    env = Registry.from_entry_points().get(name)
    tasks = env.tasks()[:2]
    server = await start_scripted_server(qwen_script(env, tasks))
    try:
        rollouts = await _run(client, spec(name, tasks, server.url))
    finally:
        await server.close()
    assert len(rollouts) == 2
    for r in rollouts:
        assert r.status == RolloutStatus.OK, r.error
        assert r.reward == 1.0, r.reward_components  # the reference solution, after the filler turns
        samples = samples_of(server, r)
        assert [s.turn for s in samples] == list(range(TURNS))
        assert sum(1 for turn in r.turns if turn.role == "assistant") == TURNS
        assert_exact(r, samples, server)
        # the double's reasoning and its oddly spaced tool-call JSON are in the ids, as sampled
        text = server.app.model.decode(r.tokens.completion_ids)
        assert "<think>" in text and '{"name":"' in text


async def test_streamed_tito_and_chat_answers_are_as_exact_as_whole_ones(client: EnvfleetClient) -> None:
    # the JobSpec's policy asks for streams (through the API, to the rollout's client); the double streams each
    # sample in pieces, token ids and logprobs cut between chunks
    env = Registry.from_entry_points().get("python-tool")
    tasks = env.tasks()[:1]
    server = await start_scripted_server(qwen_script(env, tasks))
    try:
        (tito,) = await _run(client, spec("python-tool", tasks, server.url, stream=True))
        (chat,) = await _run(client, spec("python-tool", tasks, server.url, stream=True, token_mode="chat"))
    finally:
        await server.close()
    assert tito.status == chat.status == RolloutStatus.OK and tito.reward == chat.reward == 1.0
    assert server.app.streamed == server.requests == 2 * TURNS
    assert_exact(tito, samples_of(server, tito), server)


async def test_chat_mode_on_the_same_script_is_inconsistent(client: EnvfleetClient) -> None:
    env = Registry.from_entry_points().get("python-tool")
    tasks = env.tasks()[:1]
    server = await start_scripted_server(qwen_script(env, tasks))
    try:
        (chat,) = await _run(client, spec("python-tool", tasks, server.url, tokenizer="", token_mode="chat"))
        (tito,) = await _run(client, spec("python-tool", tasks, server.url))
    finally:
        await server.close()
    assert chat.status == tito.status == RolloutStatus.OK
    assert chat.reward == tito.reward == 1.0
    assert chat.tokens.status == "inconsistent" and chat.tokens.completion_ids == []
    assert tito.tokens.status == "complete"


@pytest.mark.parametrize("room", [40, 400])
async def test_max_model_len_truncates_with_consistent_arrays(room: int, client: EnvfleetClient) -> None:
    # room: tokens past the first prompt; 40 ends inside the first answer, 400 after some observations
    env = Registry.from_entry_points().get("python-tool")
    tasks = env.tasks()[:1]
    probe = await start_scripted_server(qwen_script(env, tasks))
    try:
        (full,) = await _run(client, spec("python-tool", tasks, probe.url))
    finally:
        await probe.close()
    limit = len(full.tokens.prompt_ids) + room
    assert limit < len(full.tokens.prompt_ids) + len(full.tokens.completion_ids)
    # the double refuses, as vLLM does, any request past its own context: the orchestrator must never send one
    server = await start_scripted_server(qwen_script(env, tasks, max_model_len=limit))
    try:
        (r,) = await _run(client, spec("python-tool", tasks, server.url, max_model_len=limit))
    finally:
        await server.close()
    assert r.status == RolloutStatus.TRUNCATED, r.error
    assert r.reward is not None
    t = r.tokens
    assert len(t.completion_ids) == len(t.completion_mask) == len(t.completion_logprobs)
    assert len(t.prompt_ids) + len(t.completion_ids) <= limit
    samples = samples_of(server, r)
    assert samples and all(len(s.prompt_ids) + len(s.ids) <= limit for s in samples), (
        "a request asked for more than the context holds"
    )
    assert_exact(r, samples, server)


async def test_tito_through_worker_processes(tmp_path: Path, base_image: str) -> None:
    """Worker processes load the tokenizer themselves, from the directories the control plane hands them."""
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=tmp_path / "data",
            backend=DockerBackendConfig(owner=TEST_OWNER),
            workers=1,
            tokenizer_dirs=[QWEN_LIKE_DIR.parent],
        )
    )
    env = Registry.from_entry_points().get("python-tool")
    tasks = env.tasks()[:2]
    server = await start_scripted_server(qwen_script(env, tasks))
    try:
        assert orch.workers is not None
        await orch.workers.hub.wait_for_workers(1, timeout_s=120)
        async with EnvfleetClient(orch.address) as c:
            rollouts = await _run(c, spec("python-tool", tasks, server.url))
    finally:
        await server.close()
        await orch.stop(grace=1)
    left = owned_containers()
    assert not left
    for r in rollouts:
        assert r.status == RolloutStatus.OK, r.error
        assert_exact(r, samples_of(server, r), server)


async def test_a_garbled_tool_call_is_a_tool_error_observation_not_a_crash(client: EnvfleetClient) -> None:
    env = Registry.from_entry_points().get("python-tool")
    task = env.tasks()[0]
    garbled = [
        Step(
            content='<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}\n</tool_call>'
        ),  # a brace short
        Step(content="<tool_call>\nrun the code please\n</tool_call>"),  # no JSON, no name
        *six_turn_steps(env, task)[-2:],
    ]
    server = await start_scripted_server(Script(template="qwen3", tasks={task.id: garbled}))
    try:
        (r,) = await _run(client, spec("python-tool", [task], server.url))
    finally:
        await server.close()
    assert r.status == RolloutStatus.OK and r.reward == 1.0, r.error
    tool_turns = [t.text for t in r.turns if t.role == "tool"]
    assert tool_turns[0].startswith("error: arguments are not valid JSON")
    assert tool_turns[1].startswith("error: the tool call names no tool")
    assert_exact(r, samples_of(server, r), server)


async def test_a_server_that_returns_no_token_ids_is_a_policy_error(client: EnvfleetClient) -> None:
    env = Registry.from_entry_points().get("python-tool")
    tasks = env.tasks()[:1]
    server = await start_scripted_server(qwen_script(env, tasks), tokens=False)
    try:
        (r,) = await _run(client, spec("python-tool", tasks, server.url))
    finally:
        await server.close()
    assert r.status == RolloutStatus.POLICY_ERROR and r.reward is None
    assert r.error is not None and "no sampled token ids" in r.error.message and "token_mode chat" in r.error.message
