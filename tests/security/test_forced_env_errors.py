"""A policy cannot turn a rollout heading for 0 into ENV_ERROR. Under RL a rollout that ends ENV_ERROR is masked
from training instead of scored, so a losing policy gains by breaking its own grading; whatever the policy does is
graded, and a wrong answer scores 0 (status OK).

- A declarative scoring command got the answer in ENVFLEET_ANSWER as well as on stdin: a NUL in it made envd refuse
  the command, 65,536 two-byte characters (the cut counted characters) made execve fail with E2BIG, and an unpaired
  surrogate could not be encoded into envd's request at all.
  And an answer of 6 million two-byte characters (a 12 MB response) made the episode's JSON for stdin 72 MB, over the
  64 MiB of one gRPC message: INFRA_ERROR, retried and never scored (it is over an episode's budget now: TRUNCATED).
- A lone surrogate from the policy server (an answer's text: the worker's result could not be encoded), in a bash
  command (envd's request could not be), or in a component's name a scorer printed (the rollout could not be
  stored, and its job waited for it for ever): each is U+FFFD, or the tool's error, now.
- code-tests wrote its hidden tests to the fixed path /tmp/.envfleet-hidden, in the /tmp the policy writes: a
  directory of mode 0, a file or a link planted there, or a full /tmp, made the grader's write fail.

Real Docker, the real server and its runner, the scripted policy double."""

from __future__ import annotations

import asyncio
import json
import shlex
from pathlib import Path
from typing import Any, cast

import pytest

from environments.code_tests import SOLUTION, CodeTestsEnv
from environments.swe.env import TESTS_RERUN_METRIC, SweEnv, _hunks
from environments.swe.evaluate import EvaluationError, evaluate_in_sandbox
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core import sandbox as sandbox_module
from orchestrator.core.models import JobSpec, Rollout, RolloutStatus, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.core.sandbox import Sandbox
from orchestrator.core.tools import BUILTIN_TOOLS, call_tool
from orchestrator.service.declarative.env import MAX_ANSWER_ENV, answer_env
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step, start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.orchestrator.servers import serve
from tests.orchestrator.test_registration import to_pb

EXPECTED = "42"
# The scoring command reports what reached it in ENVFLEET_ANSWER (its length in bytes, -1 when unset) beside the
# reward, which it computes from the exact answer on stdin.
GRADER = (
    'python3 -I -c \'import json, os, sys; e = json.load(sys.stdin); a = os.environb.get(b"ENVFLEET_ANSWER"); '
    'print(json.dumps({"reward": float(e["answer"] == e["data"]["expected"]), '
    '"env_answer_bytes": -1 if a is None else len(a)}))\''
)
# What the policy submits, and how many bytes of it ENVFLEET_ANSWER carries: NUL and an unpaired surrogate, which no
# environment variable can hold, become U+FFFD (3 bytes); a long answer is cut at 64 KiB, counted in bytes.
ANSWERS: dict[str, tuple[str, int]] = {
    "right": (EXPECTED, 2),
    "nul": ("4\x002", 5),
    "two-byte": ("\u00e9" * 65536, 64 << 10),
    "surrogate": ("\ud800", 3),
}
# the final text of a policy that stops without submit is its answer: this one is 7 MB, and six times as long as
# JSON's escapes on stdin, where it is twice (the answer, and the turn's text): 42 MB, streamed. One of 12 MB (72 MB
# on stdin, over the 64 MiB of one gRPC message) was INFRA_ERROR; it is over an episode's budget now (step.py,
# EPISODE_BYTES), so its turn is dropped and the episode ends TRUNCATED: scored, never masked (`endless`).
HUGE = ("\u00e9" * 3_500_000, 64 << 10)
ENDLESS = "\u00e9" * 6_000_000


def _declarative_spec() -> dict[str, Any]:
    return {
        "name": "forced-env-error",
        "version": "1",
        "tools": ["bash", "submit"],
        "tasks": [
            {
                "id": tid,
                "prompt": "Submit 42.",
                "data": {"expected": EXPECTED},
                "reference": [{"name": "submit", "arguments": {"answer": EXPECTED}}],
            }
            for tid in [*ANSWERS, "huge", "endless"]
        ],
        "scoring": {"command": GRADER, "timeout_s": 30},
        "limits": {"memory_mb": 256, "pids": 64},
        "max_turns": 2,
        "tool_timeout_s": 20,
    }


def swe_registry() -> tuple[Registry, SweEnv]:
    """The plug-ins' registry, and its swe environment."""
    registry = Registry.from_entry_points()
    env = registry.get("swe")
    assert isinstance(env, SweEnv)
    return registry, env


async def _run(client: EnvfleetClient, env: str, script: Script) -> dict[str, Rollout]:
    policy = await start_scripted_server(script, tokens=False)
    try:
        job_id = await client.submit(
            JobSpec(
                env=env,
                tasks=TaskSelection(kind="ids", ids=list(script.tasks)),
                policy=PolicyEndpoint(base_url=policy.url, model="scripted"),
            )
        )
        async with asyncio.timeout(240):
            return {r.task_id: r async for r in client.rollouts(job_id)}
    finally:
        await policy.close()


async def test_any_answer_is_graded(tmp_path: Path, base_image: str) -> None:
    script = Script(
        tasks={
            tid: [Step(tool_calls=[ScriptedToolCall(name="submit", arguments={"answer": answer})])]
            for tid, (answer, _) in ANSWERS.items()
        }
        | {"huge": [Step(content=HUGE[0])], "endless": [Step(content=ENDLESS)]}
    )
    async with serve(tmp_path, Registry.from_entry_points()) as orch, EnvfleetClient(orch.address) as client:
        await client.env_stub.Register(to_pb(_declarative_spec()))
        got = await _run(client, "forced-env-error", script)
    endless = got.pop("endless")
    assert (endless.status, endless.reward, endless.error) == (RolloutStatus.TRUNCATED, 0.0, None)
    outcomes = {tid: (r.status, r.reward, r.error.message if r.error else "") for tid, r in got.items()}
    expected = {**ANSWERS, "huge": HUGE}
    assert outcomes == {tid: (RolloutStatus.OK, float(tid == "right"), "") for tid in expected}
    assert {tid: r.reward_components for tid, r in got.items()} == {
        tid: {"env_answer_bytes": env_bytes} for tid, (_, env_bytes) in expected.items()
    }


# Surrogates from the policy server itself, not inside a tool call's arguments: an answer whose text has a lone one
# (the json module keeps the escape's value, where orjson refuses it) made the worker's result unencodable, and a
# bash command with one could not be put into envd's request: both ended INFRA_ERROR, retried and masked.
SURROGATES = {
    "text": [Step(content="4\ud8002")],
    "command": [
        Step(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "echo \ud800"})]),
        Step(tool_calls=[ScriptedToolCall(name="submit", arguments={"answer": EXPECTED})]),
    ],
}


# A scorer's output names its components: one that echoes what the sandbox holds (a test's name the policy chose) may
# name one with a lone surrogate's escape, and the rollout could not be stored: its job waited for it for ever.
ECHOING_GRADER = "printf '%s\\n' '{\"reward\": 1, \"\\ud800 passed\": 1}'"


async def test_surrogates_from_the_policy_are_graded(tmp_path: Path, base_image: str) -> None:
    spec = _declarative_spec()
    spec["tasks"] = [{**spec["tasks"][0], "id": tid} for tid in SURROGATES]
    echoing = {**spec, "name": "echoing-scorer", "scoring": {"command": ECHOING_GRADER, "timeout_s": 30}}
    echoing["tasks"] = [{**spec["tasks"][0], "id": "echo"}]
    async with serve(tmp_path, Registry.from_entry_points()) as orch, EnvfleetClient(orch.address) as client:
        await client.env_stub.Register(to_pb(spec))
        await client.env_stub.Register(to_pb(echoing))
        got = await _run(client, "forced-env-error", Script(tasks=SURROGATES))
        echoed = await _run(client, "echoing-scorer", Script(tasks={"echo": SURROGATES["command"][1:]}))
    outcomes = {tid: (r.status, r.reward, r.error.message if r.error else "") for tid, r in got.items()}
    assert outcomes == {"text": (RolloutStatus.OK, 0.0, ""), "command": (RolloutStatus.OK, 1.0, "")}, outcomes
    echo = echoed["echo"]
    assert (echo.status, echo.reward, echo.reward_components) == (RolloutStatus.OK, 1.0, {"\ufffd passed": 1.0})
    assert got["text"].turns[-1].text == "4\ufffd2"
    turns = [(t.role, t.text) for t in got["command"].turns]
    assert any(role == "tool" and "lone surrogate" in text for role, text in turns), turns


@pytest.mark.parametrize(
    "raw", ['{"command": ' + "[" * 100_000, '{"command": 1' + "0" * 5000 + "}"], ids=["deep", "long-integer"]
)
async def test_tool_arguments_the_json_module_cannot_read_are_the_tools_error(raw: str) -> None:
    # RecursionError and ValueError (Python's 4,300-digit limit) escaped call_tool: INFRA_ERROR, masked and retried
    # on fresh sandboxes, for text the policy wrote. Refused before any sandbox is touched.
    result = await call_tool(BUILTIN_TOOLS["bash"], cast(Sandbox, None), raw, 5.0)
    assert result.output.startswith("error: arguments are not JSON this tool reads"), result.output


# What the policy leaves in its sandbox before it submits a wrong solution: each made the grader's write of the hidden
# tests fail. A full /tmp is the policy's own doing (the sandbox's /tmp starts empty), and the grader needs none of it.
PLANTS = {
    "mode-0 directory": "mkdir -m 0 /tmp/.envfleet-hidden",
    "file": "printf x > /tmp/.envfleet-hidden",
    "link": "ln -s /nonexistent/dir /tmp/.envfleet-hidden",
    "full /tmp": "cat /dev/zero > /tmp/fill; df -k /tmp | tail -n 1",
}
FILL_TMP = PLANTS["full /tmp"]


def _plant_then(command: str, solution: str) -> list[Step]:
    return [
        Step(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": command})]),
        Step(tool_calls=[ScriptedToolCall(name="write_file", arguments={"path": SOLUTION, "content": solution})]),
        Step(tool_calls=[ScriptedToolCall(name="submit", arguments={"answer": ""})]),
    ]


async def test_what_the_policy_leaves_in_tmp_does_not_stop_the_hidden_tests(tmp_path: Path, base_image: str) -> None:
    tasks = list(CodeTestsEnv().tasks())[: len(PLANTS) + 1]
    wrong = {t.id: f"def {t.data['function']}(*args):\n    return None\n" for t in tasks}
    plants = dict(zip((t.id for t in tasks), PLANTS.items(), strict=False))
    # and the grader still grades: the right solution in a sandbox whose /tmp is full scores 1
    control = tasks[len(PLANTS)]
    steps = {tid: _plant_then(command, wrong[tid]) for tid, (_, command) in plants.items()}
    steps[control.id] = _plant_then(FILL_TMP, str(control.reference[0].arguments["content"]))
    async with serve(tmp_path, Registry.from_entry_points()) as orch, EnvfleetClient(orch.address) as client:
        got = await _run(client, CodeTestsEnv.name, Script(tasks=steps))
    outcomes = {
        plants[tid][0] if tid in plants else "control": (r.status, r.reward, r.error.message if r.error else "")
        for tid, r in got.items()
    }
    assert outcomes == {
        **{how: (RolloutStatus.OK, 0.0, "") for how in PLANTS},
        "control": (RolloutStatus.OK, 1.0, ""),
    }
    r = got[control.id]
    # the plant took effect: the fill ran into the cap of /tmp
    fill_output = json.dumps([t.model_dump() for t in r.turns])
    assert "No space left on device" in fill_output, fill_output[:2000]


async def test_a_grader_left_a_program_that_never_ends_scores_0_past_the_rollouts_time(
    tmp_path: Path, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # scoring had what was left of the rollout's time (a quarter of it kept back), less than the hidden tests' own
    # timeout: a solution that never ends, with the episode run to its end, made the rollout's deadline fire in the
    # grader, a masked TIMEOUT where the grader's own timeout scores 0
    import environments.code_tests as code_tests

    monkeypatch.setattr(code_tests, "TEST_TIMEOUT_S", 4.0)
    task = CodeTestsEnv().tasks()[0]
    endless = f"def {task.data['function']}(*args):\n    while True:\n        pass\n"
    steps = [
        Step(tool_calls=[ScriptedToolCall(name="write_file", arguments={"path": SOLUTION, "content": endless})]),
        Step(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "sleep 100"})]),  # to the episode's end
        Step(tool_calls=[ScriptedToolCall(name="submit", arguments={"answer": ""})]),
    ]
    policy = await start_scripted_server(Script(tasks={task.id: steps}), tokens=False)
    try:
        async with serve(tmp_path, Registry.from_entry_points()) as orch, EnvfleetClient(orch.address) as client:
            spec = JobSpec(
                env=CodeTestsEnv.name,
                tasks=TaskSelection(kind="ids", ids=[task.id]),
                policy=PolicyEndpoint(base_url=policy.url, model="scripted"),
                rollout_timeout_s=8.0,  # 2 s kept for scoring, the tests take 4
                max_infra_retries=0,
            )
            job_id = await client.submit(spec)
            async with asyncio.timeout(120):
                (r,) = [r async for r in client.rollouts(job_id)]
    finally:
        await policy.close()
    assert (r.status, r.reward) == (RolloutStatus.TRUNCATED, 0.0), (r.status, r.error)
    assert r.timing.scoring >= 4.0


def test_the_answer_variable_is_cut_in_bytes_at_a_character_boundary() -> None:
    answer = "a" + "\U0001f600" * 20000  # four bytes each: the cut at 64 KiB falls inside one
    cut = answer_env(answer)
    assert len(cut.encode()) == 1 + 4 * ((MAX_ANSWER_ENV - 1) // 4) and answer.startswith(cut)
    assert answer_env("ok\x00\udfff") == "ok\ufffd\ufffd" and answer_env(None) == ""


async def test_a_workspace_made_unenterable_is_graded_not_masked(tmp_path: Path, base_image: str) -> None:
    # the grade's first step ran in the workspace (envd's default cwd): after the agent's `chmod 000 /workspace`
    # it could not start, and every wrong answer was an INFRA_ERROR, masked and retried
    env = SweEnv()
    idle = env.tasks()[1]
    lock = Step(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": "chmod 000 /workspace"})])
    steps = {idle.id: [lock, Step(tool_calls=[ScriptedToolCall(name="submit")])]}
    async with serve(tmp_path, Registry.from_entry_points()) as orch, EnvfleetClient(orch.address) as client:
        got = await _run(client, "swe", Script(tasks=steps))
    r = got[idle.id]
    assert (r.status, r.reward) == (RolloutStatus.OK, 0.0), (r.status, r.error)


async def test_a_full_tmp_does_not_stop_the_swe_grade(tmp_path: Path, base_image: str) -> None:
    # the grade unpacks a fresh copy of the repository in /tmp: a policy that filled /tmp (and planted a directory it
    # cannot enter) broke it, ENV_ERROR for a wrong patch, when it must score 0, and for a right one, which scores 1
    env = SweEnv()
    solved, idle = env.tasks()[0], env.tasks()[1]
    plant = "mkdir -m 0 /tmp/swe-grade-x; " + FILL_TMP
    fill = Step(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": plant})])
    script = reference_script(env, [solved])
    steps = {
        solved.id: [fill, *script.tasks[solved.id]],
        idle.id: [fill, Step(tool_calls=[ScriptedToolCall(name="submit")])],
    }
    async with serve(tmp_path, Registry.from_entry_points()) as orch, EnvfleetClient(orch.address) as client:
        got = await _run(client, "swe", Script(tasks=steps))
    outcomes = {tid: (r.status, r.reward, r.error.message if r.error else "") for tid, r in got.items()}
    assert outcomes == {solved.id: (RolloutStatus.OK, 1.0, ""), idle.id: (RolloutStatus.OK, 0.0, "")}
    assert "No space left on device" in json.dumps([t.model_dump() for t in got[idle.id].turns])


# appended to the module the fix edits: the tests import it, and it sleeps past their timeout (on the first run only,
# marked outside /tmp, which the rerun empties; or on every run)
SLOW_ONCE = (
    "\nimport os as _os, time as _time\n"
    "if not _os.path.exists('/workspace/.slow-once'):\n"
    "    open('/workspace/.slow-once', 'w').close()\n    _time.sleep(60)\n"
)
SLOW_ALWAYS = "\nimport time as _time\n_time.sleep(60)\n"
# ...and before it sleeps, a FIFO where the grader's pristine copy has its HEAD: a second run copied from that copy
# blocked in git before its tests started, the evaluation's failure (ENV_ERROR, masked) for what was a 0
STALLS_THE_COPY = (
    "\nimport glob as _glob, os as _os\nfor _git in _glob.glob('/tmp/swe-grade-*/base/.git'):\n"
    "    _os.remove(_git + '/HEAD')\n    _os.mkfifo(_git + '/HEAD')\n" + SLOW_ALWAYS
)


async def test_swe_tests_past_their_timeout_run_once_more_before_a_0(
    tmp_path: Path, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a busy host can hold a correct patch's tests past their timeout: graded at once, that was a 0. They run once
    # more (a second run most likely finishes): a right fix then scores 1, and code that never ends scores 0 again
    monkeypatch.setattr(sandbox_module, "PROBE_SLOW_S", 30.0)  # a busy CI host's shell is not what this tests
    registry, env = swe_registry()
    solved, stalling, other = env.tasks()[0], env.tasks()[1], env.tasks()[2]
    for task in (solved, stalling, other):
        inst = env.instance(task)
        runner = inst.test_runner.model_copy(update={"timeout_s": 20.0})
        env.instances[inst.instance_id] = inst.model_copy(update={"test_runner": runner})
    script = reference_script(env, [solved, stalling, other])

    def slowed(task: Any, code: str) -> list[Step]:
        path = _hunks(env.instance(task).patch)[0][0]
        cmd = f"printf %s {shlex.quote(code)} >> /workspace/{path}"
        return [Step(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": cmd})]), *script.tasks[task.id]]

    steps = {
        solved.id: slowed(solved, SLOW_ONCE),
        stalling.id: slowed(stalling, STALLS_THE_COPY),
        other.id: slowed(other, SLOW_ALWAYS),
    }
    async with serve(tmp_path, registry) as orch, EnvfleetClient(orch.address) as client:
        got = await _run(client, "swe", Script(tasks=steps))
    once, always = got[solved.id], got[other.id]
    assert (once.status, once.reward) == (RolloutStatus.OK, 1.0), (once.status, once.error)
    assert once.metrics[TESTS_RERUN_METRIC] == 1.0
    for slow in (always, got[stalling.id]):
        assert (slow.status, slow.reward) == (RolloutStatus.OK, 0.0), (slow.status, slow.error)
        assert slow.metrics[TESTS_RERUN_METRIC] == 1.0


async def test_a_swe_grader_set_up_past_its_time_runs_once_more_then_grades_never_an_env_error(
    tmp_path: Path, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the evaluation script ran past its time before the tests started (applying the patch, putting the tests back):
    # raised, that was an ENV_ERROR nobody retried, a policy's way out of its 0. Now it runs once more, as tests
    # past their time do, and past it twice on a host that keeps time is the patch's doing, graded
    monkeypatch.setattr(sandbox_module, "PROBE_SLOW_S", 30.0)  # a busy CI host's shell is not what this tests
    registry, env = swe_registry()
    once, always = env.tasks()[0], env.tasks()[1]
    calls: dict[str, int] = {}

    async def held(sandbox: Sandbox, inst: Any, diff: bytes, **kw: Any) -> Any:
        calls[inst.instance_id] = calls.get(inst.instance_id, 0) + 1
        if inst.instance_id == always.id or calls[inst.instance_id] == 1:
            raise EvaluationError(f"{inst.instance_id}: the evaluation script itself ran past 20s + margin")
        return await evaluate_in_sandbox(sandbox, inst, diff, **kw)

    monkeypatch.setattr("environments.swe.env.evaluate_in_sandbox", held)
    async with serve(tmp_path, registry) as orch, EnvfleetClient(orch.address) as client:
        got = await _run(client, "swe", reference_script(env, [once, always]))
    assert (got[once.id].status, got[once.id].reward) == (RolloutStatus.OK, 1.0), got[once.id].error
    assert (got[always.id].status, got[always.id].reward) == (RolloutStatus.OK, 0.0), got[always.id].error
    assert all(r.metrics[TESTS_RERUN_METRIC] == 1.0 for r in got.values())
    assert calls == {once.id: 2, always.id: 2}
