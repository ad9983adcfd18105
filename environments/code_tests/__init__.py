"""code-tests: write a function from its docstring. The reward is the fraction of hidden unit tests that pass, run in
the sandbox with a timeout. The tests reach the sandbox only after the episode, on the grader's stdin, so the policy
never sees them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache

from environments.code_tests.problems import PROBLEMS, Problem
from environments.python_tool import num_turns, used_tool
from environments.sdk import Environment, Rubric, ScoringContext, Task, ToolInvocation
from orchestrator.core.environment import GRADER_CWD, GRADER_ENV
from orchestrator.core.errors import SandboxError
from orchestrator.core.sandbox import PROBE_TIMEOUT_S, keeps_time

SOLUTION = "solution.py"
TEST_TIMEOUT_S = 30.0
GRADER_SLACK_S = 30.0  # the start of its command and the end of its answer, on a busy host
# The grader reads this file of the workspace and nothing else the policy wrote. It runs with `python -I` (no user
# site, no PYTHON* variables, no script or current directory on sys.path), an empty HOME and a fixed cwd
# (GRADER_ENV, GRADER_CWD): a usercustomize.py or a module named like one the runner imports cannot speak for it.
GRADER_READS = (SOLUTION,)

# The solution runs in a child process that gets the cases' arguments and never their expected values: it answers
# each call's return value as JSON on a pipe, and the runner (made non-dumpable first, so the child, of the same
# uid, can read neither its memory nor its descriptors through /proc) compares them. The solution's code ran in the
# grader's own process before: it printed the counts itself, returned an object equal to anything, or read the
# expected values from the runner's variables.
CHILD = """
import importlib.util, json, os, sys
try:  # the first the kernel kills when the sandbox runs out of memory, before the runner that counts
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
except OSError:
    pass
out = os.fdopen(int(sys.argv[3]), "w")
calls = json.load(sys.stdin)
try:
    spec = importlib.util.spec_from_file_location("solution", sys.argv[1])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = getattr(mod, sys.argv[2])
except BaseException:
    fn = None
for args in calls:  # an answer a line as each call returns: a call that never does leaves those before it counted
    try:
        answer = json.dumps(fn(*args))
    except BaseException:
        answer = None
    out.write(json.dumps(answer) + "\\n")
    out.flush()
os._exit(0)
"""
# Runs in the sandbox after the episode (`python3 -I -c RUNNER solution function CHILD seconds`): reads the cases
# from its stdin, says STARTED, runs the solution's child (in a session of its own, killed whole after `seconds`),
# compares its answers, prints JSON counts. Nothing of the grader is written into the sandbox: a fixed path in /tmp
# (the cases were written to /tmp/.envfleet-hidden) is the policy's to take first, with a directory of mode 0, a file
# or a link there, or a /tmp it filled, and the failed write was ENV_ERROR, a rollout masked from training instead of
# scored 0. The policy's processes run as the grader's own uid, so no place in the sandbox is the grader's alone;
# stdin and stdout are. Before STARTED nothing of the policy's has run: a grader that fails there (no python3, a
# prctl refused) is the sandbox's failure, never a 0. After it, what goes wrong is the solution's doing: a solution
# that never ends, wrote junk on its pipe or ran the sandbox out of memory scores what it passed (the calls that
# answered, a line each), once a shell that does nothing shows the host keeps time (keeps_time): on a host too busy
# to run the cases in time, a right solution's 0 would be the fleet's failure passed off as a reward.
STARTED = "envfleet-grader: running the solution"
RUNNER = f"""
import ctypes, json, os, select, signal, subprocess, sys, time
if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
    sys.exit("cannot make the grader non-dumpable")
cases = json.load(sys.stdin)
print({STARTED!r}, flush=True)
deadline = time.monotonic() + float(sys.argv[4])
read, write = os.pipe()
child = subprocess.Popen(
    [sys.executable, "-I", "-c", sys.argv[3], sys.argv[1], sys.argv[2], str(write)],
    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, pass_fds=(write,),
    start_new_session=True,
)
os.close(write)
try:
    child.stdin.write(json.dumps([args for args, _ in cases]).encode())
    child.stdin.close()
except OSError:
    pass
chunks, size, timed_out = [], 0, False
while size < 16 << 20:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([read], [], [], left)[0]:
        timed_out = True
        break
    chunk = os.read(read, 1 << 20)
    if not chunk:
        break
    chunks.append(chunk)
    size += len(chunk)
try:
    os.killpg(child.pid, signal.SIGKILL)
except OSError:
    pass
child.wait()
passed = 0
# the whole lines only: one cut by the deadline (or the cap) is no answer
for (args, expected), line in zip(cases, b"".join(chunks).split(b"\\n")[:-1]):
    try:
        answer = json.loads(line)
        passed += isinstance(answer, str) and json.loads(answer) == expected
    except (ValueError, RecursionError, MemoryError):
        pass
print(json.dumps({{"passed": passed, "total": len(cases), "timed_out": timed_out}}), flush=True)
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
    solution = f"{sb.spec.workspace}/{SOLUTION}"
    r = await sb.exec(
        ["python3", "-I", "-c", RUNNER, solution, task.data["function"], CHILD, str(TEST_TIMEOUT_S)],
        cwd=GRADER_CWD,
        env=GRADER_ENV,
        stdin=json.dumps(task.data["cases"]).encode(),
        # the runner ends the solution itself; this is for the runner, and leaves the answer time before the
        # rollout's scoring deadline (scoring_timeout_s)
        timeout=TEST_TIMEOUT_S + GRADER_SLACK_S / 2,
        max_output=64 << 10,
    )
    lines = r.stdout.decode(errors="replace").splitlines()
    if STARTED not in lines:
        # no solution ran: the grader's failure (no python3, the sandbox gone, a refused prctl), never a 0
        how = "timed out" if r.timed_out else f"exited {r.exit_code}"
        tail = r.stderr.decode(errors="replace")[-300:]
        raise SandboxError(f"the hidden tests' grader {how} before it ran the solution: {tail!r}")
    try:
        result = json.loads(lines[-1])
        passed, total, timed_out = int(result["passed"]), int(result["total"]), result["timed_out"] is True
    except (ValueError, KeyError, TypeError):
        passed, total, timed_out = 0, 0, r.timed_out  # the solution stopped the grader (its memory, its CPU)
    if timed_out:  # the cases ran out of time: the solution's doing only where the host keeps time
        await keeps_time(sb, f"the hidden tests ran past their {TEST_TIMEOUT_S:g}s")
    if total != len(task.data["cases"]) or not 0 <= passed <= total:
        return 0.0
    return passed / total


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

    def scoring_timeout_s(self, task: Task) -> float:
        """The hidden tests' run, the slack of a command on a busy host, and the look at the host's pace after a
        run out of time."""
        return TEST_TIMEOUT_S + GRADER_SLACK_S + PROBE_TIMEOUT_S
