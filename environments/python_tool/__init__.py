"""python-tool: computation puzzles with exact answers. The policy has a `python` tool; the reward is an exact match
of the submitted answer."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from functools import cache

from environments.sdk import Environment, Rubric, ScoringContext, Task, ToolInvocation

NUM_TASKS = 60
SEED = 20261129


def _primes_below(n: int) -> list[int]:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\0\0"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))
    return [i for i in range(n) if sieve[i]]


def _fib(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
]


def _make(kind: int, rng: random.Random) -> tuple[str, str, str]:
    """(prompt, answer, python code that prints the answer)."""
    if kind == 0:
        a, b, c = rng.randrange(10**5, 10**7), rng.randrange(10**4, 10**6), rng.randrange(10**8)
        return f"Compute {a} * {b} - {c}.", str(a * b - c), f"print({a} * {b} - {c})"
    if kind == 1:
        a, b, m = rng.randrange(2, 10**4), rng.randrange(10**3, 10**6), rng.randrange(10**3, 10**5)
        return f"Compute {a} to the power {b}, modulo {m}.", str(pow(a, b, m)), f"print(pow({a}, {b}, {m}))"
    if kind == 2:
        n = rng.randrange(1000, 50000)
        return (
            f"What is the sum of all primes below {n}?",
            str(sum(_primes_below(n))),
            f"n={n}\nprint(sum(p for p in range(2, n) if all(p % d for d in range(2, int(p**0.5) + 1))))",
        )
    if kind == 3:
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 9)))
        return (
            f"Reverse the order of the words in: '{text}'. Answer with the reversed text only.",
            " ".join(reversed(text.split())),
            f"print(' '.join(reversed({text!r}.split())))",
        )
    if kind == 4:
        n = rng.randrange(50, 300)
        return (
            f"What is the sum of the decimal digits of {n}! (the factorial of {n})?",
            str(sum(map(int, str(math.factorial(n))))),
            f"import math\nprint(sum(map(int, str(math.factorial({n})))))",
        )
    if kind == 5:
        n, m = rng.randrange(100, 1000), rng.randrange(10**5, 10**7)
        return (
            f"Compute the {n}-th Fibonacci number (F(0)=0, F(1)=1) modulo {m}.",
            str(_fib(n) % m),
            f"a, b = 0, 1\nfor _ in range({n}): a, b = b, a + b\nprint(a % {m})",
        )
    xs = [rng.randrange(-100, 100) for _ in range(rng.randrange(8, 15))]
    return (
        f"Sort the list {xs} ascending, drop duplicates, and answer with the comma-separated numbers (no spaces).",
        ",".join(map(str, sorted(set(xs)))),
        f"print(','.join(map(str, sorted(set({xs})))))",
    )


@cache
def generate_tasks(count: int = NUM_TASKS, seed: int = SEED) -> tuple[Task, ...]:
    """`count` deterministic tasks, cycling through the puzzle kinds."""
    rng = random.Random(seed)
    tasks = []
    for i in range(count):
        prompt, answer, code = _make(i % 7, rng)
        tasks.append(
            Task(
                id=f"py-{i:03d}",
                prompt=prompt + " Use the python tool to compute it, then call submit with the exact answer.",
                data={"answer": answer},
                reference=(ToolInvocation("python", {"code": code}), ToolInvocation("submit", {"answer": answer})),
            )
        )
    return tuple(tasks)


def exact_match(ctx: ScoringContext) -> float:
    """1 when the submitted answer equals the expected one (surrounding whitespace ignored)."""
    answer = ctx.episode.answer
    return float(answer is not None and answer.strip() == str(ctx.task.data["answer"]))


def used_tool(name: str) -> Callable[[ScoringContext], float]:
    """A metric: whether the policy called `name`."""

    def fn(ctx: ScoringContext) -> float:
        return float(any(c.name == name for t in ctx.episode.turns for c in t.tool_calls))

    return fn


def num_turns(ctx: ScoringContext) -> float:
    """A metric: assistant turns taken."""
    return float(sum(t.role == "assistant" for t in ctx.episode.turns))


class PythonToolEnv(Environment):
    """Arithmetic, string and list puzzles solved with a python tool; exact-match reward."""

    name = "python-tool"
    version = "1"
    description = "Computation puzzles with exact answers; tools: python, submit; reward: exact match."
    tools = ("python", "submit")
    system_prompt = "You solve computation puzzles. Use the python tool to compute, then call submit with the answer."
    max_turns = 8
    tool_timeout_s = 20.0
    reusable = True
    rubric = Rubric(
        [("exact_match", exact_match, 1.0), ("used_python", used_tool("python"), 0.0), ("turns", num_turns, 0.0)]
    )

    def tasks(self) -> Sequence[Task]:
        return generate_tasks()


# Shaped rewards. A reward that depends on the episode's length or on the answer's format is one more rubric
# component with a weight: the reward is the weighted sum, and each component is reported on its own. The built-in
# environment keeps the plain exact match; ShapedPythonToolEnv shows the pattern
# (tests/environments/test_shaped_reward.py). Shaping pays only on a right answer: paid on its own, it paid a policy
# to guess at once (a wrong answer submitted in the first turn earned 0.2, more than a try with the tool that failed),
# and RL learns what it pays for.


def brevity(max_turns: int) -> Callable[[ScoringContext], float]:
    """1 for a right answer in the first assistant turn, falling linearly to 0 at `max_turns` turns; 0 for a wrong
    one."""

    def fn(ctx: ScoringContext) -> float:
        turns = num_turns(ctx)
        return exact_match(ctx) * max(0.0, 1.0 - (turns - 1) / max(1, max_turns - 1))

    return fn


def submitted_plainly(ctx: ScoringContext) -> float:
    """The format: 1 when the right answer came through submit as one line with nothing around it."""
    answer = ctx.episode.answer
    ok = ctx.episode.finish == "submit" and answer is not None and answer == answer.strip() and "\n" not in answer
    return float(ok and exact_match(ctx) == 1.0)


class ShapedPythonToolEnv(PythonToolEnv):
    """python-tool with length and format shaping: exact match (1.0) + 0.1 brevity + 0.1 plain submit. An example,
    not registered: register it under your own name (an entry point, or Registry.register)."""

    name = "python-tool-shaped"
    description = "python-tool; reward: exact match + 0.1 * brevity + 0.1 * plain submitted answer."
    rubric = Rubric(
        [
            ("exact_match", exact_match, 1.0),
            ("brevity", brevity(PythonToolEnv.max_turns), 0.1),
            ("format", submitted_plainly, 0.1),
            ("turns", num_turns, 0.0),
        ]
    )
