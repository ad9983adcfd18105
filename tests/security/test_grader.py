"""The grader runs clean: a usercustomize.py (or a module named like one the grader imports) that the policy
planted does not run when the hidden tests or a declarative scoring command run. What the solution does to the
hidden tests' grader scores what it passed; what fails before the solution runs is the sandbox's, never a 0."""

from __future__ import annotations

import json
import time

import pytest

import environments.code_tests as code_tests
from environments.code_tests import SOLUTION, CodeTestsEnv, hidden_tests_passed
from orchestrator.backends.docker import DockerBackend
from orchestrator.core import sandbox as sandbox_module
from orchestrator.core.environment import Episode, ScoringContext, Task
from orchestrator.core.errors import SandboxError, SandboxUnavailableError
from orchestrator.core.sandbox import Hardening, Limits, Sandbox, SandboxSpec
from orchestrator.service.declarative import make_environment, parse_spec

EPISODE = Episode(turns=[], answer="wrong", finish="submit")
# the base image's own user (uid 1000) has HOME=/tmp: its user site directory is writable by the policy
SPEC = {"hardening": Hardening(user="1000:1000")}


async def _plant(s: Sandbox, text: str) -> None:
    """What a policy can leave behind: a usercustomize.py in its user site, a json.py in the workspace."""
    site = (await s.exec(["python3", "-c", "import site; print(site.getusersitepackages())"])).stdout.decode().strip()
    assert site.startswith("/tmp/.local/lib/python3"), site
    await s.write_file(f"{site}/usercustomize.py", text.encode())
    await s.write_file("json.py", text.encode())
    # the plant works for any python the policy starts itself
    assert (await s.exec(["python3", "-c", "pass"])).stdout != b""


async def test_hidden_tests_do_not_run_a_planted_usercustomize(backend: DockerBackend, base_image: str) -> None:
    task = CodeTestsEnv().tasks()[0]
    perfect = 'import os\nprint(\'{"passed": 99, "total": 99}\', flush=True)\nos._exit(0)\n'
    async with await backend.create(SandboxSpec(image=base_image, **SPEC)) as s:
        await s.write_file(SOLUTION, f"def {task.data['function']}(*args):\n    return None\n".encode())
        await _plant(s, perfect)
        assert await hidden_tests_passed(ScoringContext(s, task, EPISODE)) == 0.0
        # and the real solution still passes: the clean grader grades
        ref = task.reference[0].arguments["content"]
        await s.write_file(SOLUTION, ref.encode())
        assert await hidden_tests_passed(ScoringContext(s, task, EPISODE)) == 1.0


async def test_a_declarative_scoring_command_does_not_run_a_planted_usercustomize(
    backend: DockerBackend, base_image: str
) -> None:
    grader = "python3 -c 'import json, sys; json.load(sys.stdin); print(json.dumps({\"reward\": 0.25}))'"
    spec = parse_spec(
        {
            "name": "clean-grader",
            "version": "1",
            "tools": ["bash", "submit"],
            "tasks": [{"id": "t1", "prompt": "p", "reference": [{"name": "submit", "arguments": {"answer": "x"}}]}],
            "scoring": {"command": grader, "timeout_s": 20},
        }
    )
    env = make_environment(spec)
    perfect = f"import os\nprint({json.dumps(json.dumps({'reward': 1.0}))}, flush=True)\nos._exit(0)\n"
    async with await backend.create(SandboxSpec(image=base_image, **SPEC)) as s:
        await _plant(s, perfect)
        score = await env.score(s, Task(id="t1", prompt="p"), EPISODE)
        assert score.reward == 0.25


async def test_a_solution_cannot_score_itself(backend: DockerBackend, base_image: str) -> None:
    # the solution's code ran in the grader's own process: it could print the counts and leave, return an object
    # equal to anything, or read the expected values from the runner's variables. It now runs in a child that
    # never holds them, and the counts are checked against the task's cases
    task = CodeTestsEnv().tasks()[0]
    fn = task.data["function"]
    cheats = {
        "prints the counts": 'import os\nprint(\'{"passed": 100, "total": 1}\', flush=True)\nos._exit(0)\n',
        "equal to anything": f"class Any:\n    __eq__ = lambda self, other: True\ndef {fn}(*args):\n    return Any()\n",
        "reads the expected": (
            f"import sys\ndef {fn}(*args):\n"
            "    return next(e for a, e in sys.modules['__main__'].cases if a == list(args))\n"
        ),
    }
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        for how, code in cheats.items():
            await s.write_file(SOLUTION, code.encode())
            assert await hidden_tests_passed(ScoringContext(s, task, EPISODE)) == 0.0, how
        await s.write_file(SOLUTION, task.reference[0].arguments["content"].encode())
        assert await hidden_tests_passed(ScoringContext(s, task, EPISODE)) == 1.0


async def test_a_grader_that_fails_before_the_solution_runs_is_the_sandboxs_failure_not_a_0(
    backend: DockerBackend, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the grader that said nothing (no python3 in the image, a prctl refused, the sandbox gone) scored 0, the
    # policy's failure, for a solution nobody ran
    task = CodeTestsEnv().tasks()[0]
    monkeypatch.setattr(code_tests, "RUNNER", "import sys; sys.exit('no grader here')")
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        await s.write_file(SOLUTION, task.reference[0].arguments["content"].encode())
        with pytest.raises(SandboxError, match=r"before it ran the solution.*no grader here"):
            await hidden_tests_passed(ScoringContext(s, task, EPISODE))


async def test_what_a_solution_does_to_the_grader_scores_0_and_never_masks_it(
    backend: DockerBackend, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # once the grader says it runs the solution, its failure is the solution's doing: junk its JSON reader cannot
    # hold, a hang (the grader ends it on its own clock, long before its command's timeout), the sandbox's memory
    # run out (the solution's processes are the kernel's first choice), processes that outlive the solution
    monkeypatch.setattr(code_tests, "TEST_TIMEOUT_S", 3.0)
    monkeypatch.setattr(sandbox_module, "PROBE_SLOW_S", 30.0)  # a hang looks at the host's pace: not what this tests
    task = CodeTestsEnv().tasks()[0]
    fn = task.data["function"]
    cheats = {
        "junk on its pipe": "import os, sys\nos.write(int(sys.argv[3]), b'[' * 100000)\nos._exit(0)\n",
        "never ends": f"def {fn}(*args):\n    while True:\n        pass\n",
        "memory": f"def {fn}(*args):\n    x = [b'x' * (1 << 20) for _ in range(1 << 12)]\n",
        "children left behind": (
            f"import os, time\ndef {fn}(*args):\n    if os.fork() == 0:\n        time.sleep(600)\n    time.sleep(600)\n"
        ),
    }
    spec = SandboxSpec(image=base_image, limits=Limits(memory_mb=256, pids=256))
    async with await backend.create(spec) as s:
        for how, code in cheats.items():
            await s.write_file(SOLUTION, code.encode())
            t0 = time.monotonic()
            assert await hidden_tests_passed(ScoringContext(s, task, EPISODE)) == 0.0, how
            # the grader's own clock ended it, not its command's timeout
            assert time.monotonic() - t0 < 3.0 + code_tests.GRADER_SLACK_S / 2, how
        await s.write_file(SOLUTION, task.reference[0].arguments["content"].encode())
        assert await hidden_tests_passed(ScoringContext(s, task, EPISODE)) == 1.0


async def test_a_solution_that_hangs_scores_the_cases_it_answered_where_the_host_keeps_time(
    backend: DockerBackend, base_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the child answered all the calls at once at the end: a solution right on two cases and hanging on the third
    # scored 0, and a host too slow to run a right one in time scored it 0 as well, the fleet's failure as a reward
    monkeypatch.setattr(code_tests, "TEST_TIMEOUT_S", 3.0)
    task = CodeTestsEnv().tasks()[0]
    fn, total = task.data["function"], len(task.data["cases"])
    two_then_hangs = (
        task.reference[0].arguments["content"]
        + f"\n_real, _calls = {fn}, []\ndef {fn}(*args):\n    _calls.append(1)\n"
        + "    while len(_calls) > 2:\n        pass\n    return _real(*args)\n"
    )
    async with await backend.create(SandboxSpec(image=base_image)) as s:
        await s.write_file(SOLUTION, two_then_hangs.encode())
        monkeypatch.setattr(sandbox_module, "PROBE_SLOW_S", 30.0)  # a busy CI host's shell is not what this tests
        assert await hidden_tests_passed(ScoringContext(s, task, EPISODE)) == 2 / total
        monkeypatch.setattr(sandbox_module, "PROBE_SLOW_S", 0.0)  # the host as too slow to keep time
        with pytest.raises(SandboxUnavailableError, match="the hidden tests ran past their 3s"):
            await hidden_tests_passed(ScoringContext(s, task, EPISODE))


@pytest.mark.parametrize("case", ["never-ends", "slow-once", "left-broken", "slow-host"])
async def test_a_declarative_scoring_command_past_its_timeout_runs_again_then_scores_0(
    backend: DockerBackend, base_image: str, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the scoring command runs the policy's program: one that never ends ran the command past its timeout, which was
    # a ScoringError (ENV_ERROR, masked) where the program's outcome is a 0. Once more first: a run past its time may
    # be the host's doing (here, the first run only: it leaves a mark and sleeps). A second run that fails may be the
    # first's leftovers ("left-broken": a 0 too), and two runs past their time on a sandbox that does not run `true`
    # in time are the host's (INFRA_ERROR, retried)
    import orchestrator.core.sandbox as sandbox_module

    endless = case in ("never-ends", "slow-host")
    second = "exit 3" if case == "left-broken" else "echo '{\"reward\": 1}'"
    grader = (
        'if [ ! -e /tmp/ran ]; then touch /tmp/ran; sleep 30; fi; python3 "$ENVFLEET_WORKSPACE/sol.py" >&2; ' + second
    )
    if case == "slow-host":
        monkeypatch.setattr(sandbox_module, "PROBE_SLOW_S", 0.0)  # any time at all is too slow
    spec = parse_spec(
        {
            "name": "runs-the-solution",
            "version": "1",
            "tools": ["bash", "submit"],
            "tasks": [{"id": "t1", "prompt": "p", "reference": [{"name": "submit", "arguments": {"answer": "x"}}]}],
            "scoring": {"command": grader, "timeout_s": 2},
        }
    )
    env = make_environment(spec)
    task = env.tasks()[0]
    assert env.scoring_timeout_s(task) >= 2 * 2  # the rollout keeps both runs' time for scoring
    async with await backend.create(SandboxSpec(image=base_image, **SPEC)) as s:
        await s.write_file("sol.py", b"while True:\n    pass\n" if endless else b"print('done')\n")
        t0 = time.monotonic()
        if case == "slow-host":
            with pytest.raises(SandboxError, match="the host, not the policy, is slow"):
                await env.score(s, task, EPISODE)
            return
        score = await env.score(s, task, EPISODE)
    if case == "slow-once":
        assert (score.reward, score.metrics) == (1.0, {"scoring_ran_again_after_timeout": 1.0})
    else:
        assert (score.reward, score.metrics) == (0.0, {"scoring_timed_out": 1.0})
        assert time.monotonic() - t0 >= 2  # it did run past its time


@pytest.mark.parametrize("cheat", ["exits", "floods", "prints no reward"])
async def test_a_declarative_scoring_command_the_policys_program_breaks_scores_0(
    backend: DockerBackend, base_image: str, cheat: str
) -> None:
    # the scoring command runs the policy's program: one that ended the grader non-zero (os._exit), flooded its output
    # past the cap, or left it no reward line made a ScoringError, ENV_ERROR, masked: the policy's way out of a
    # certain 0 whenever it could not solve the task. A check (registration, the checker) still gets the grader's
    # error, with its message: there a failing grader is the finding
    from orchestrator.service.declarative.env import strict_scoring
    from orchestrator.service.declarative.errors import ScoringError

    programs = {
        "exits": "import os\nos._exit(3)\n",
        "floods": "import sys\nsys.stderr.write('x' * (2 << 20))\n",
        "prints no reward": "print('I give up')\n",
    }
    spec = parse_spec(
        {
            "name": "runs-the-solution",
            "version": "1",
            "tools": ["bash", "submit"],
            "tasks": [{"id": "t1", "prompt": "p", "reference": [{"name": "submit", "arguments": {"answer": "x"}}]}],
            "scoring": {"command": 'python3 "$ENVFLEET_WORKSPACE/sol.py"', "timeout_s": 20},
        }
    )
    env = make_environment(spec)
    task = env.tasks()[0]
    async with await backend.create(SandboxSpec(image=base_image, **SPEC)) as s:
        await s.write_file("sol.py", programs[cheat].encode())
        score = await env.score(s, task, EPISODE)
        assert (score.reward, score.metrics) == (0.0, {"scoring_failed": 1.0})
        with strict_scoring(), pytest.raises(ScoringError):
            await env.score(s, task, EPISODE)
        await s.write_file("sol.py", b"print('{\"reward\": 0.5}')\n")  # an honest program is graded as before
        assert (await env.score(s, task, EPISODE)).reward == 0.5


def test_the_checker_takes_no_score_given_past_the_graders_time() -> None:
    # an empty answer scored 0 by a grader that ran past its time twice passed the checker's "empty scores 0"
    from orchestrator.core.environment import Score
    from orchestrator.service.checker import _in_time

    task = Task(id="t1", prompt="p")
    assert _in_time(task, "an empty answer", Score(0.0, {}, {"scoring_timed_out": 1.0})) == [
        "task t1: the scoring command ran past its timeout for an empty answer (scoring_timed_out)"
    ]
    assert _in_time(task, "the reference solution", Score(1.0, {}, {"scoring_ran_again_after_timeout": 1.0}))
    assert _in_time(task, "an empty answer", Score(0.0, {}, {"tool_calls": 2.0})) == []
