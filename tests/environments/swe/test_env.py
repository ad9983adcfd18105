"""The swe RL environment: reference solutions as tool calls, and a full rollout through the orchestrator with the
scripted policy applying the gold fix through the tools (scored resolved) and one submitting nothing (scored 0)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from environments.swe.env import SweEnv, reference_solution, workspace_diff
from environments.swe.instance import SweInstance
from environments.swe.script import make_bundle
from orchestrator.backends.docker import DockerBackend
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, RolloutStatus, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.core.sandbox import SandboxSpec
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step, start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.environments.swe.conftest import Tiny


def test_reference_solution_is_the_gold_patch_as_edits(tiny: Tiny) -> None:
    calls = reference_solution(tiny.pytest)
    assert [c.name for c in calls] == ["str_replace", "submit"]
    args = calls[0].arguments
    assert args["path"] == "calc.py" and "if x > lo:" in args["old_str"] and "if x < lo:" in args["new_str"]
    # applying the edit to the buggy file gives the fixed file
    assert tiny.bad.replace(args["old_str"], args["new_str"]) == tiny.good
    assert tiny.bad.count(args["old_str"]) == 1


def test_tasks_come_from_the_shipped_dataset(shipped: list[SweInstance]) -> None:
    env = SweEnv()
    tasks = env.tasks()
    assert [t.id for t in tasks] == sorted(i.instance_id for i in shipped)
    for task in tasks:
        inst = env.instance(task)
        assert inst.problem_statement.strip() in task.prompt and inst.patch not in task.prompt
        assert task.reference[-1].name == "submit"


async def test_rollout_through_the_orchestrator(client: EnvfleetClient) -> None:
    env = SweEnv()
    solved, idle = env.tasks()[0], env.tasks()[1]
    script = reference_script(env, [solved])
    script = Script(tasks={**script.tasks, idle.id: [Step(tool_calls=[ScriptedToolCall(name="submit")])]})
    server = await start_scripted_server(script)
    try:
        spec = JobSpec(
            env="swe",
            tasks=TaskSelection(kind="ids", ids=[solved.id, idle.id]),
            policy=PolicyEndpoint(base_url=server.url),
        )
        rollouts = {r.task_id: r async for r in client.rollouts(await client.submit(spec))}
    finally:
        await server.close()
    good, none = rollouts[solved.id], rollouts[idle.id]
    assert good.status == RolloutStatus.OK, good.error
    assert good.reward == 1.0 and good.reward_components == {"resolved": 1.0}
    assert good.metrics["patch_applied"] == 1.0 and good.metrics["fail_to_pass_rate"] == 1.0
    tool_turns = [t for t in good.turns if t.role == "tool"]
    assert [t.name for t in tool_turns][-1] == "submit" and all("error" not in t.text for t in tool_turns)
    assert none.status == RolloutStatus.OK and none.reward == 0.0 and none.metrics["patch_applied"] == 0.0


async def test_the_workspace_diff_of_a_file_that_is_not_utf8_still_applies(
    tiny: Tiny, backend: DockerBackend, base_image: str
) -> None:
    # the diff was decoded with U+FFFD for what is not UTF-8 and encoded again for the grader: the context of a
    # latin-1 line no longer matched, the patch did not apply, and a right fix scored 0
    setup = (
        "set -e; cd /workspace; printf 'name = \"caf\\351\"\\nx = 1\\n' > m.py; g='git --git-dir=/tmp/g.git'; "
        "$g init -q; $g --work-tree=/workspace add -A; "
        "$g -c user.name=t -c user.email=t@t --work-tree=/workspace commit -qm base; $g rev-parse HEAD"
    )
    async with await backend.create(SandboxSpec(image=base_image)) as sb:
        r = await sb.exec(["sh", "-c", setup])
        assert r.exit_code == 0, r
        base = r.stdout.decode().strip()
        await sb.write_file("/workspace/m.py", b'name = "caf\xe9"\nx = 2\n')  # the fix, beside the latin-1 line
        instance = cast(SweInstance, SimpleNamespace(base_commit=base, instance_id="latin-1"))
        diff = await workspace_diff(sb, instance, "/tmp/g.git", "/tmp/agent.index")
        patch = make_bundle(tiny.pytest, diff, nonce="n").files["model.patch"]  # what the grader applies
        assert b"caf\xe9" in patch
        fresh = "mkdir /tmp/fresh && git --git-dir=/tmp/g.git --work-tree=/tmp/fresh checkout -q HEAD -- . && "
        applied = await sb.exec(["sh", "-c", fresh + "cd /tmp/fresh && git apply - && cat m.py"], stdin=patch)
        assert applied.exit_code == 0, applied
        assert applied.stdout == b'name = "caf\xe9"\nx = 2\n'


async def test_the_agents_files_never_become_objects_of_the_pristine_repository(
    backend: DockerBackend, base_image: str
) -> None:
    # the diff's `git add` wrote every file of the agent's into the pristine repository's objects, and the grader then
    # copied that repository: tens of thousands of small files fit once in /tmp and not twice, the copy failed, and
    # "Reset Failed" made a rollout heading for 0 an infrastructure failure (masked)
    setup = (
        "set -e; cd /workspace; echo 'x = 1' > m.py; g='git --git-dir=/tmp/g.git'; $g init -q; "
        "$g --work-tree=/workspace add -A; $g -c user.name=t -c user.email=t@t --work-tree=/workspace commit -qm base; "
        "$g rev-parse HEAD"
    )
    count = "find /tmp/g.git/objects -type f | wc -l"
    async with await backend.create(SandboxSpec(image=base_image)) as sb:
        r = await sb.exec(["sh", "-c", setup])
        assert r.exit_code == 0, r
        instance = cast(SweInstance, SimpleNamespace(base_commit=r.stdout.decode().strip(), instance_id="objects"))
        before = (await sb.exec(["sh", "-c", count])).stdout
        r = await sb.exec(["sh", "-c", "cd /workspace && for i in $(seq 200); do echo $i > f$i.txt; done"])
        assert r.exit_code == 0, r
        diff = await workspace_diff(sb, instance, "/tmp/g.git", "/tmp/agent.index")
        assert diff is not None and diff.count(b"diff --git") == 200
        assert (await sb.exec(["sh", "-c", count])).stdout == before
        assert (await sb.exec(["ls", "/tmp"])).stdout == b"g.git\n", "the diff's index and objects are gone"
