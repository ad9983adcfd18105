"""code-tests: write a function from its docstring. The reward is the fraction of hidden unit tests that pass, run in
the sandbox with a timeout. The tests are written into the sandbox only after the episode, so the policy never sees
them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache

from environments.code_tests.problems import PROBLEMS, Problem
from environments.python_tool import num_turns, used_tool
from environments.sdk import Environment, Rubric, ScoringContext, Task, ToolInvocation
from orchestrator.core.environment import GRADER_CWD, GRADER_ENV

SOLUTION = "solution.py"
HIDDEN_DIR = "/tmp/.envfleet-hidden"
TEST_TIMEOUT_S = 30.0
# The grader reads this file of the workspace and nothing else the policy wrote. It runs with `python -I` (no user
# site, no PYTHON* variables, no script or current directory on sys.path), an empty HOME and a fixed cwd
# (GRADER_ENV, GRADER_CWD): a usercustomize.py or a module named like one the runner imports cannot speak for it.
GRADER_READS = (SOLUTION,)

# Runs in the sandbox after the episode: imports the solution, checks each case in isolation, prints JSON counts.
# Runs in the sandbox after the episode: loads the cases and deletes them before the solution's code runs, checks
# each case, prints JSON counts, and leaves with os._exit so no exit hook of the solution can print over the result.
# (Solution code runs in the grader's process, so it is not hardened against code that inspects the grader.)
RUNNER = """
import importlib.util, json, os, sys
with open(sys.argv[1]) as f:
    cases = json.load(f)
os.unlink(sys.argv[1])
passed = 0
try:
    spec = importlib.util.spec_from_file_location("solution", sys.argv[2])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = getattr(mod, sys.argv[3])
except BaseException as e:
    print(json.dumps({"passed": 0, "total": len(cases), "error": f"{type(e).__name__}: {e}"}), flush=True)
    os._exit(0)
for args, expected in cases:
    try:
        if fn(*args) == expected:
            passed += 1
    except BaseException:
        pass
print(json.dumps({"passed": passed, "total": len(cases)}), flush=True)
os._exit(0)
"""


def _expected(problem: Problem) -> list[tuple[list[object], object]]:
    scope: dict[str, object] = {}
    exec(problem.reference, scope)  # our own reference implementations, defined in problems.py
    fn = scope[problem.name]
    assert callable(fn)
    return [(list(args), fn(*args)) for args in problem.inputs]


@cache
def build_tasks() -> tuple[Task, ...]:
    """One task per problem, with its hidden cases computed from the reference."""
    return tuple(
        Task(
            id=f"code-{p.name}",
            prompt=(
                f"Write a Python function `{p.signature}` in the file {SOLUTION} (in the working directory).\n\n"
                f"{p.doc}\n\nWhen the file is ready, call submit."
            ),
            data={"function": p.name, "cases": _expected(p)},
            reference=(
                ToolInvocation("write_file", {"path": SOLUTION, "content": p.reference}),
                ToolInvocation("submit", {"answer": ""}),
            ),
        )
        for p in PROBLEMS
    )


async def hidden_tests_passed(ctx: ScoringContext) -> float:
    """The fraction of hidden cases the solution passes, run in the sandbox with a timeout."""
    task = ctx.task
    sb = ctx.sandbox
    await sb.write_file(f"{HIDDEN_DIR}/cases.json", json.dumps(task.data["cases"]).encode())
    await sb.write_file(f"{HIDDEN_DIR}/run.py", RUNNER.encode())
    solution = f"{sb.spec.workspace}/{SOLUTION}"
    r = await sb.exec(
        ["python3", "-I", f"{HIDDEN_DIR}/run.py", f"{HIDDEN_DIR}/cases.json", solution, task.data["function"]],
        cwd=GRADER_CWD,
        env=GRADER_ENV,
        timeout=TEST_TIMEOUT_S,
        max_output=64 << 10,
    )
    if r.timed_out:
        return 0.0
    try:
        result = json.loads(r.stdout.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        return 0.0  # the solution printed garbage over the runner's line or crashed the interpreter
    return float(result["passed"]) / float(result["total"])


def wrote_solution(ctx: ScoringContext) -> float:
    """A metric: whether the policy wrote a file at all."""
    return float(any(c.name in ("write_file", "str_replace", "bash") for t in ctx.episode.turns for c in t.tool_calls))


class CodeTestsEnv(Environment):
    """Write a function from a docstring; reward = fraction of hidden tests passed."""

    name = "code-tests"
    version = "1"
    description = "Write a function from its docstring; reward: fraction of hidden unit tests passed in the sandbox."
    tools = ("bash", "python", "read_file", "write_file", "str_replace", "submit")
    system_prompt = (
        "You write Python code in a sandbox. Write the requested function in the named file, test it if you like, "
        "then call submit."
    )
    max_turns = 12
    tool_timeout_s = 30.0
    reusable = True
    rubric = Rubric(
        [
            ("hidden_tests", hidden_tests_passed, 1.0),
            ("wrote_file", wrote_solution, 0.0),
            ("turns", num_turns, 0.0),
            ("used_python", used_tool("python"), 0.0),
        ]
    )

    def tasks(self) -> Sequence[Task]:
        return build_tasks()
