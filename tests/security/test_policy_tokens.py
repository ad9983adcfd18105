"""A hostile policy's token ids and logprobs: the server is the tenant's choice, and every id and logprob it returns
is kept in the rollout exactly. One the wire cannot carry (an id past int32, negative, a float or a bool; a NaN,
infinite or positive logprob; lists of unequal length) must end that rollout promptly as POLICY_ERROR with a message
that names the value and where it was: never a hang (a worker whose encoding raised sent no result, and the control
plane waited out the rollout's budget), never a stream that breaks on it, never a silent OK, never a clamped id.

Through real processes: the scripted policy server answers each bad value, a job runs on the fake backend, in the
control plane's own process (the default) and in a rollout worker process; the trainer reads the stream."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import PolicyResponseError, PolicyTokenError
from orchestrator.core.models import JobSpec, Rollout, RolloutStatus, Tokens
from orchestrator.rollout.policy import token_checks as checks
from orchestrator.rollout.policy.parsing import parse_chat_completion
from orchestrator.rollout.runner import WorkItem
from orchestrator.rollout.tito.policy import parse_completion
from orchestrator.server.convert import rollout_pb
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, Step, start_scripted_server
from orchestrator.worker.agent import WorkerAgent
from orchestrator.worker.outbox import Outbox
from protos import orchestrator_pb2 as pb
from protos import worker_pb2 as wpb
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, serve

NAN, INF = float("nan"), float("inf")
# a hang shows as this guard, far inside the rollout's own budget (which the old worker path waited out)
NO_HANG_S = 90.0
ROLLOUT_BUDGET_S = 600.0


def _entries(*logprobs: Any, token: str = "a") -> dict[str, Any]:
    return {"content": [{"token": token, "logprob": lp} for lp in logprobs]}


# (name, the fields the hostile server puts in choices[0], what the rollout's error must say)
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    (
        "id 2^31",
        {"token_ids": [1, 2**31]},
        "choices[0].token_ids[1] is 2147483648: a token id is an int in 0..2147483647",
    ),
    ("id 2^32", {"token_ids": [2**32]}, "choices[0].token_ids[0] is 4294967296"),
    ("id past 64 bits", {"token_ids": [2**70]}, "choices[0].token_ids[0] is 1.1805916207174113e+21 (a float)"),
    ("negative id", {"token_ids": [5, 6, -1]}, "choices[0].token_ids[2] is -1"),
    ("float id", {"token_ids": [7, 2.5]}, "choices[0].token_ids[1] is 2.5 (a float)"),
    ("integral float id", {"token_ids": [7.0]}, "choices[0].token_ids[0] is 7.0 (a float)"),
    ("bool id", {"token_ids": [True]}, "choices[0].token_ids[0] is true (a bool)"),
    ("string id", {"token_ids": ["7"]}, "choices[0].token_ids[0] is a str"),
    ("ids not a list", {"token_ids": {"0": 7}}, "choices[0].token_ids is a dict, expected a list of token ids"),
    (
        "id label past int32",
        {"token_ids": None, "logprobs": _entries(-1.0, token="token_id:4294967296")},
        "choices[0].logprobs.content[0].token is 4294967296",
    ),
    (
        "id label not decimal",
        {"token_ids": None, "logprobs": _entries(-1.0, -1.0, token="token_id:+5")},
        "choices[0].logprobs.content[0].token is 'token_id:' and 2 characters that are not a decimal token id",
    ),
    ("NaN logprob", {"token_ids": [7, 8], "logprobs": _entries(-0.5, NAN)}, "content[1].logprob is nan (a float)"),
    ("-inf logprob", {"token_ids": [7], "logprobs": _entries(-INF)}, "content[0].logprob is -inf (a float)"),
    ("+inf logprob", {"token_ids": [7], "logprobs": _entries(INF)}, "content[0].logprob is inf (a float)"),
    ("positive logprob", {"token_ids": [7], "logprobs": _entries(0.25)}, "content[0].logprob is 0.25 (a float)"),
    ("past float32", {"token_ids": [7], "logprobs": _entries(-1e39)}, "content[0].logprob is -1e+39 (a float)"),
    ("bool logprob", {"token_ids": [7], "logprobs": _entries(False)}, "content[0].logprob is false (a bool)"),
    ("null logprob", {"token_ids": [7], "logprobs": _entries(None)}, "content[0].logprob is null"),
    (
        "more ids than logprobs",
        {"token_ids": [7, 8, 9], "logprobs": _entries(-1.0, -1.0)},
        "returned 3 token ids (choices[0].token_ids) but 2 logprobs",
    ),
]
# the boundary values are fine and arrive exactly: the lowest and highest ids, logprobs of +0.0 and -0.0
EDGE_IDS = [0, checks.TOKEN_ID_MAX]
EDGE = {"token_ids": EDGE_IDS, "logprobs": _entries(0.0, -0.0)}


def _script(task_ids: list[str]) -> tuple[Script, dict[str, str]]:
    """One hostile answer per task (the first turn's), the edge values on the last task; and what each task's error
    must say."""
    tasks = {t: [Step(content="x", choice_fields=fields)] for t, (_, fields, _) in zip(task_ids, HOSTILE, strict=False)}
    tasks[task_ids[len(HOSTILE)]] = [Step(content="x", choice_fields=EDGE)]
    expected = {t: message for t, (_, _, message) in zip(task_ids, HOSTILE, strict=False)}
    return Script(tasks=tasks), expected


@pytest.fixture
def task_ids() -> list[str]:
    ids = [t.id for t in Registry.from_entry_points().get(ENV).tasks()]
    assert len(ids) > len(HOSTILE)
    return ids[: len(HOSTILE) + 1]


def _check(rollouts: list[Rollout], expected: dict[str, str], edge_task: str | None = None) -> None:
    """Each expected task's rollout is the policy error its message names; the edge task's is OK, exactly."""
    by_task = {r.task_id: r for r in rollouts}
    assert set(by_task) == set(expected) | ({edge_task} if edge_task else set())
    wrong = {}
    for task, message in expected.items():
        r = by_task[task]
        ok = (
            r.status == RolloutStatus.POLICY_ERROR
            and r.reward is None
            and r.error is not None
            and r.error.kind == PolicyTokenError.__name__
            and message in r.error.message
            and r.attempts == 1  # a policy's fault is not retried as infrastructure
        )
        if not ok:
            wrong[task] = (r.status, r.error)
    assert not wrong, f"rollouts that did not end as the policy error they are: {wrong}"
    if edge_task is None:
        return
    edge = by_task[edge_task]
    assert edge.status == RolloutStatus.OK, edge.error
    assert edge.tokens.status == "complete"
    assert edge.tokens.completion_ids[-2:] == EDGE_IDS  # exact, not clamped
    logprobs = edge.tokens.completion_logprobs[-2:]
    assert logprobs == [0.0, 0.0] and math.copysign(1, logprobs[1]) == -1  # -0.0 kept as sent, through float32


async def _run_job(tmp_path: Path, task_ids: list[str], **config: Any) -> None:
    script, expected = _script(task_ids)
    async with (
        await start_scripted_server(script) as policy,
        serve(tmp_path / "data", backend=FAKE, **config) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        if orch.workers is not None:
            await orch.workers.hub.wait_for_workers(1, timeout_s=120)
        spec = job(policy.url, task_ids, rollout_timeout_s=ROLLOUT_BUDGET_S, max_concurrency=len(task_ids))
        job_id = await client.submit(spec)
        try:
            async with asyncio.timeout(NO_HANG_S):
                rollouts = [r async for r in client.rollouts(job_id)]
        except TimeoutError:
            info = await client.get_job(job_id)
            pytest.fail(f"the job hung: {info.done} of {len(task_ids)} rollouts done after {NO_HANG_S:g}s")
    _check(rollouts, expected, task_ids[-1])


async def test_hostile_token_values_end_their_rollouts_as_policy_errors_on_the_default_path(
    tmp_path: Path, task_ids: list[str]
) -> None:
    await _run_job(tmp_path, task_ids)


async def test_hostile_token_values_end_their_rollouts_as_policy_errors_on_a_worker_process(
    tmp_path: Path, task_ids: list[str]
) -> None:
    await _run_job(tmp_path, task_ids, workers=1)


TITO_HOSTILE: list[tuple[dict[str, Any], str]] = [
    ({"token_ids": [2**31]}, "choices[0].token_ids[0] is 2147483648"),
    ({"token_ids": None, "logprobs": {"tokens": ["token_id:-7"]}}, "choices[0].logprobs.tokens[0] is -7"),
    ({"token_ids": [5], "logprobs": {"token_logprobs": [NAN]}}, "token_logprobs[0] is nan"),
    ({"token_ids": [5, 6], "logprobs": {"token_logprobs": [-1.0]}}, "2 token ids (choices[0].token_ids) but 1"),
]


async def test_hostile_token_values_in_tito_answers_end_their_rollouts_as_policy_errors(
    tmp_path: Path, task_ids: list[str]
) -> None:
    """Token-in, token-out: the server's /v1/completions answer is where the sampled ids come from."""
    pytest.importorskip("transformers")
    from orchestrator.testing.qwen_like import QWEN_LIKE_DIR

    tasks = task_ids[: len(TITO_HOSTILE)]
    script = Script(
        template="qwen3",
        tasks={t: [Step(content="x", choice_fields=f)] for t, (f, _) in zip(tasks, TITO_HOSTILE, strict=True)},
    )
    async with (
        await start_scripted_server(script) as policy,
        serve(tmp_path / "data", backend=FAKE, tokenizer_dirs=[QWEN_LIKE_DIR.parent]) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        chat = job(policy.url, tasks, rollout_timeout_s=ROLLOUT_BUDGET_S).model_dump()
        spec = JobSpec.model_validate(
            {**chat, "token_mode": "tito", "policy": {**chat["policy"], "tokenizer": QWEN_LIKE_DIR.name}}
        )
        job_id = await client.submit(spec)
        async with asyncio.timeout(NO_HANG_S):
            rollouts = [r async for r in client.rollouts(job_id)]
    _check(rollouts, {t: m for t, (_, m) in zip(tasks, TITO_HOSTILE, strict=True)})


# --- the parsers, value by value (the chat parser above; tito's /v1/completions answer here) ------------------------


@pytest.mark.parametrize(
    ("choice", "match"),
    [
        ({"token_ids": [2**31]}, r"choices\[0\]\.token_ids\[0\] is 2147483648"),
        ({"token_ids": [3, -2]}, r"choices\[0\]\.token_ids\[1\] is -2"),
        ({"token_ids": [False]}, r"choices\[0\]\.token_ids\[0\] is false \(a bool\)"),
        ({"token_ids": [1.5]}, r"choices\[0\]\.token_ids\[0\] is 1\.5 \(a float\)"),
        ({"logprobs": {"tokens": ["token_id:1", "token_id:2147483648"]}}, r"logprobs\.tokens\[1\] is 2147483648"),
        ({"token_ids": [1], "logprobs": {"token_logprobs": [NAN]}}, r"token_logprobs\[0\] is nan"),
        ({"token_ids": [1], "logprobs": {"token_logprobs": [0.5]}}, r"token_logprobs\[0\] is 0\.5"),
        ({"token_ids": [1], "logprobs": {"token_logprobs": [-(10**400)]}}, r"token_logprobs\[0\] is an int of"),
        ({"token_ids": [1], "logprobs": {"token_logprobs": "-1"}}, r"token_logprobs is not a list"),
        ({"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}}, r"2 token ids .* but 1 logprobs"),
    ],
)
def test_a_tito_answer_with_bad_tokens_is_a_policy_token_error(choice: dict[str, Any], match: str) -> None:
    with pytest.raises(PolicyTokenError, match=match):
        parse_completion({"choices": [{"text": "", **choice}]}, [1, 2, 3], 16, model="m")


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"prompt_token_ids": [1, 2**31]}, r"the policy server's prompt_token_ids\[1\] is 2147483648"),
        ({"prompt_token_ids": None, "choices_prompt": [-3]}, r"choices\[0\]\.prompt_token_ids\[0\] is -3"),
        ({"prompt_token_ids": "1 2 3"}, r"prompt_token_ids is a str, expected a list of token ids"),
    ],
)
def test_a_chat_answer_with_bad_prompt_ids_is_a_policy_token_error(body: dict[str, Any], match: str) -> None:
    choice: dict[str, Any] = {"message": {"content": "x"}, "prompt_token_ids": body.pop("choices_prompt", None)}
    with pytest.raises(PolicyTokenError, match=match):
        parse_chat_completion({**body, "choices": [choice]}, model="m")


def test_a_chat_answer_that_carries_fewer_tokens_than_it_sampled_never_passes_them_as_complete() -> None:
    # a turn that wrote something with an empty list of token entries: its text came back in the next prompt and
    # was counted an observation (mask 0), the rollout's tokens "complete" though the policy's own were in them
    choice = {"finish_reason": "stop", "message": {"content": "hello"}, "logprobs": {"content": []}}
    c = parse_chat_completion({"choices": [choice]}, model="m")
    assert c.completion_ids is None and c.logprobs is None  # missing, never empty
    # one that says how many it sampled is held to it
    counted = {"choices": [{**choice, "token_ids": [5, 6], "logprobs": None}], "usage": {"completion_tokens": 3}}
    with pytest.raises(PolicyTokenError, match=r"carries 2 token ids .* but says it sampled 3"):
        parse_chat_completion(counted, model="m")
    whole = {"choices": [{**choice, "token_ids": [5, 6], "logprobs": None}], "usage": {"completion_tokens": 2}}
    assert parse_chat_completion(whole, model="m").completion_ids == [5, 6]


def test_an_answer_that_sampled_no_tokens_is_a_policy_failure_never_an_empty_turn() -> None:
    # a finished request samples at least its stop token: an empty list was a broken server's, and its empty turn was
    # scored as the policy's answer (typically 0, with "complete" tokens of a zero-length turn)
    empty = {"text": "", "token_ids": [], "finish_reason": "stop", "logprobs": {"tokens": [], "token_logprobs": []}}
    for choice in (empty, {**empty, "finish_reason": None}, {**empty, "token_ids": None}):
        with pytest.raises(PolicyResponseError, match="the server sampled no tokens"):
            parse_completion({"choices": [choice]}, [1, 2, 3], 16, model="m")
    chat = {"finish_reason": "stop", "message": {"content": ""}, "token_ids": [], "logprobs": {"content": []}}
    with pytest.raises(PolicyResponseError, match="the server sampled no tokens"):
        parse_chat_completion({"choices": [chat]}, model="m")
    # a chat server that returns no ids at all is not one that sampled none: its tokens are missing, the turn is kept
    bare = parse_chat_completion({"choices": [{"finish_reason": "stop", "message": {"content": ""}}]}, model="m")
    assert bare.completion_ids is None and bare.text == ""
    # nor is one whose logprob entries leave the stop token out (OpenAI's, llama.cpp's): an empty answer is the policy's
    entries = {"finish_reason": "stop", "message": {"content": ""}, "logprobs": {"content": []}}
    assert parse_chat_completion({"choices": [entries]}, model="m").text == ""


def test_the_parsers_bounds_are_the_wires_own() -> None:
    """The bounds are the protobuf contract's (ids int32, logprobs float32): at them a value is kept exactly, through
    the parser and the encoding; one past them the parser refuses it, where the encoding would have raised after the
    rollout ran (what a worker met) or, for a NaN, choked on what pydantic writes for it (null)."""
    fields = pb.Tokens.DESCRIPTOR.fields_by_name
    assert fields["prompt_ids"].type == fields["completion_ids"].type == fields["prompt_ids"].TYPE_INT32
    assert fields["completion_logprobs"].type == fields["completion_logprobs"].TYPE_FLOAT
    assert np.iinfo(np.int32).max == checks.TOKEN_ID_MAX
    assert -float(np.finfo(np.float32).max) == checks.LOGPROB_MIN

    def parsed(ids: list[Any], logprobs: list[Any]) -> tuple[list[int], list[float] | None]:
        answer = {"choices": [{"token_ids": ids, "logprobs": {"token_logprobs": logprobs}}]}
        s = parse_completion(answer, [1], 4, model="m")
        return s.ids, s.logprobs

    def encoded(ids: list[int], logprobs: list[float]) -> pb.Tokens:
        tokens = Tokens.model_construct(
            status="complete", prompt_ids=[0], completion_ids=ids, completion_mask=[1] * len(ids)
        )
        tokens.completion_logprobs = logprobs
        r = Rollout(
            id="j:t:0", job_id="j", env="e@1", task_id="t", group_id="j:t", sample_index=0, status="OK", reward=1.0
        )
        return rollout_pb(r.model_copy(update={"tokens": tokens}).model_dump_json()).tokens

    edge = (EDGE_IDS, [0.0, checks.LOGPROB_MIN])
    assert parsed(*edge) == edge
    at = encoded(*edge)
    assert (list(at.completion_ids), list(at.completion_logprobs)) == edge
    with pytest.raises(PolicyTokenError, match="is 2147483648"):
        parsed([checks.TOKEN_ID_MAX + 1], [0.0])
    with pytest.raises(ValueError, match="out of range"):
        encoded([checks.TOKEN_ID_MAX + 1], [0.0])
    with pytest.raises(PolicyTokenError, match="is nan"):
        parsed([1], [NAN])
    with pytest.raises(TypeError):
        encoded([1], [NAN])


# --- belt and braces: whatever raises after a rollout ran, its assignment still gets a result ----------------------


class _Executor:
    """Stands in for the worker's LocalExecutor: returns a rollout the wire cannot carry, or raises."""

    def __init__(self, raises: bool) -> None:
        self.raises = raises

    async def run(self, item: WorkItem, env: object, spec: JobSpec) -> Rollout:
        if self.raises:
            raise RuntimeError("the executor broke")
        r = Rollout(
            id=item.id,
            job_id=item.job_id,
            env="python-tool@1",
            task_id=item.task.id,
            group_id=item.group_id,
            sample_index=item.sample_index,
            status=RolloutStatus.OK,
            reward=1.0,
        )
        # built past Tokens' own checks (which refuse an id past int32 now): what reaches the encoding is the test
        r.tokens = Tokens.model_construct(
            status="complete", prompt_ids=[1], completion_ids=[2**31], completion_mask=[1], completion_logprobs=[-1.0]
        )
        return r


@pytest.mark.parametrize(("raises", "match"), [(False, "ValueError: Value out of range"), (True, "the executor broke")])
async def test_a_worker_whose_encoding_or_executor_raises_still_answers_the_assignment(
    task_ids: list[str], raises: bool, match: str
) -> None:
    agent = WorkerAgent("unix:/nonexistent", "token", _Executor(raises), Registry.from_entry_points())  # type: ignore[arg-type]
    spec = job("http://127.0.0.1:9/v1", task_ids[:1])
    a = wpb.Assignment(
        assignment_id="a-1", job_id="job", job_spec_json=spec.model_dump_json().encode(), task_id=task_ids[0]
    )
    outbox: Outbox[wpb.WorkerMessage | wpb.RolloutResult] = Outbox()
    await agent._run(a, agent._carry(a), outbox, set())
    [result] = await asyncio.wait_for(outbox.get(), 5)
    assert isinstance(result, wpb.RolloutResult) and result.assignment_id == "a-1"
    assert not result.rollout_json and match in result.error, result.error


async def test_an_executor_that_raises_on_the_default_path_delivers_an_infra_error(
    tmp_path: Path, task_ids: list[str]
) -> None:
    async def broken(item: WorkItem, env: object, spec: JobSpec) -> Rollout:
        raise RuntimeError("the executor broke")

    async with serve(tmp_path / "data", backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        orch.jobs.executor.run = broken  # type: ignore[method-assign]
        job_id = await client.submit(job("http://127.0.0.1:9/v1", task_ids[:2]))
        async with asyncio.timeout(NO_HANG_S):
            rollouts = [r async for r in client.rollouts(job_id)]
    assert sorted(r.task_id for r in rollouts) == sorted(task_ids[:2])
    for r in rollouts:
        assert r.status == RolloutStatus.INFRA_ERROR and r.reward is None
        assert r.error is not None and r.error.kind == "RuntimeError" and "the executor broke" in r.error.message
