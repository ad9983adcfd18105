"""Grading as pure functions: an evaluation log's text -> per-test status -> FAIL_TO_PASS / PASS_TO_PASS -> report.

The log markers and the statuses are SWE-bench's (harness/constants, harness/grading.py, log_parsers), so a log
written here can be graded by SWE-bench's own code, and with `gold=None` the rules are its too: the two agree
(tests/environments/swe/test_crosscheck.py). The test output is fenced by sentinel lines that carry a per-run nonce.
The nonce keeps stray output from ending the fence; it is no secret from the code under test, which can read the
script that prints it and write fences of its own, as it can rewrite pytest's report (the accepted risk in script.py).

The harness grades by stricter rules (`gold`: the instance's `gold_statuses`, usually empty). SWE-bench counts XFAIL
as passed and a skipped PASS_TO_PASS test as kept, and the code under test decides both: one `pytest.xfail()` in the
function a FAIL_TO_PASS test calls resolved the task without fixing it, and a `unittest.SkipTest` raised in a
function a patch broke hid its PASS_TO_PASS tests. Under RL the policy learns that. So a listed test succeeds only
PASSED, or, for a PASS_TO_PASS test, with the status it has under the gold patch where the instance records one (a
test that xfails or skips for the gold patch too). The runners (script.py) name every skipped test, so a skip is a
status of its own that a passing line printed by the code cannot stand for.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal


class TestStatus(StrEnum):
    """A test's outcome, as SWE-bench names it."""

    __test__ = False

    PASSED = "PASSED"
    FAILED = "FAILED"
    SKIPPED = "SKIPPED"
    ERROR = "ERROR"
    XFAIL = "XFAIL"


class ResolvedStatus(StrEnum):
    """FULL: every FAIL_TO_PASS and PASS_TO_PASS test passes; PARTIAL: some FAIL_TO_PASS, all PASS_TO_PASS; NO."""

    FULL = "RESOLVED_FULL"
    PARTIAL = "RESOLVED_PARTIAL"
    NO = "RESOLVED_NO"


FAIL_TO_PASS = "FAIL_TO_PASS"
PASS_TO_PASS = "PASS_TO_PASS"
FAIL_TO_FAIL = "FAIL_TO_FAIL"
PASS_TO_FAIL = "PASS_TO_FAIL"

APPLY_PATCH_FAIL = ">>>>> Patch Apply Failed"
APPLY_PATCH_PASS = ">>>>> Applied Patch"
RESET_FAILED = ">>>>> Reset Failed"
PATCHED_SETUP_FAILED = ">>>>> Patched Tree Setup Failed"  # a step after the patch (test files back, harness files)
SETUP_FAILED = "the repository could not be set up"  # a Grade's error when the grader's own reset failed
TESTS_ERROR = ">>>>> Tests Errored"
TESTS_TIMEOUT = ">>>>> Tests Timed Out"
TESTS_STARTED = ">>>>> Tests Started"  # with the run's nonce: from here on, what happens is the code under test's
START_TEST_OUTPUT = ">>>>> Start Test Output"
END_TEST_OUTPUT = ">>>>> End Test Output"
TEST_EXIT_CODE = ">>>>> Test Exit Code"
TEST_OUTPUT_CUT = ">>>>> Test Output Cut"  # the tests printed past the cap: what is left is no whole report
TEST_PATCH_FAIL = ">>>>> Test Patch Apply Failed"
EMPTY_PATCH = ">>>>> Empty Patch"

ApplyMethod = Literal["git apply", "git apply --reject", "patch --fuzz"]
APPLY_METHODS: tuple[ApplyMethod, ...] = ("git apply", "git apply --reject", "patch --fuzz")
_BAD_MARKERS = (APPLY_PATCH_FAIL, RESET_FAILED, TESTS_ERROR, TESTS_TIMEOUT, TEST_PATCH_FAIL)
_EXIT_CODE = re.compile(rf"^{re.escape(TEST_EXIT_CODE)}:\s*(-?\d+)\s*$", re.M)
_APPLIED = re.compile(rf"^{re.escape(APPLY_PATCH_PASS)} \(([^)]*)\)\s*$", re.M)

StatusMap = dict[str, TestStatus]
TestsStatus = dict[str, dict[str, list[str]]]
# a test reported twice keeps its worst status: the code under test runs in the test process and can print a
# passing line after the real failing one (an atexit hook), never take a failure back. XFAIL ranks below PASSED: the
# harness counts it only where the gold patch has it (grade_tests), so a PASSED line the code printed (in a test's
# captured output, before the summary's XFAIL) must not stand for it
_RANK = {TestStatus.PASSED: 0, TestStatus.XFAIL: 1, TestStatus.SKIPPED: 1, TestStatus.FAILED: 2, TestStatus.ERROR: 2}


def _report(statuses: StatusMap, name: str, status: TestStatus) -> None:
    old = statuses.get(name)
    if old is None or _RANK[status] > _RANK[old]:
        statuses[name] = status


# ---- parsers: test output -> {test name: status} ----


# a parametrized id, whose brackets may hold " - " themselves: up to the first "]" that ends the line or the message.
# The brackets open at the id's first "[" (possessive: `\S*\[` tried every "[" of the id against every "]" after it,
# and a printed line of "[]" repeated took a day, the event loop stopped)
_PARAMETRIZED = re.compile(r"([^\s\[]*+\[.*?\])(?: - |$)")


def _node_id(rest: str) -> str:
    """The node id of a summary line's rest: `id` or `id - message`, where a parametrized id (`t.py::f[a - b]`)
    may hold " - " itself (cut there, a test of that id never passed, and a failing sibling stood for it)."""
    m = _PARAMETRIZED.match(rest.strip())
    return (m.group(1) if m else rest.split(" - ", 1)[0]).strip()


def parse_pytest(output: str) -> StatusMap:
    """pytest with `-rA`: the short summary lists every test as `STATUS node-id[ - message]`."""
    statuses: StatusMap = {}
    names = tuple(s.value for s in TestStatus)
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        if word not in names or not rest:
            continue
        name = _node_id(rest)
        if not name or (word == "SKIPPED" and re.fullmatch(r"\[\d+\]", name.split()[0])):
            continue  # `SKIPPED [1] file:line: reason` names no test
        _report(statuses, name, TestStatus(word))
    return statuses


_UNITTEST_LINE = re.compile(
    r"^(?P<name>\S+ \([\w.]+\)) \.\.\. (?P<result>ok|FAIL|ERROR|skipped.*|expected failure|unexpected success)$"
)
_UNITTEST_SUMMARY = re.compile(r"^(?P<kind>FAIL|ERROR): (?P<name>\S+ \([\w.]+\))")
_UNITTEST_RESULT = {
    "ok": TestStatus.PASSED,
    "FAIL": TestStatus.FAILED,
    "ERROR": TestStatus.ERROR,
    "expected failure": TestStatus.XFAIL,
    "unexpected success": TestStatus.FAILED,
}


def parse_unittest(output: str) -> StatusMap:
    """`python -m unittest -v`: one `name (module.Class.name) ... result` line per test, then FAIL:/ERROR: blocks
    (a failing subtest shows only there)."""
    statuses: StatusMap = {}
    for raw in output.splitlines():
        line = raw.strip()
        m = _UNITTEST_LINE.match(line)
        if m:
            result = m["result"]
            status = TestStatus.SKIPPED if result.startswith("skipped") else _UNITTEST_RESULT[result]
            _report(statuses, m["name"], status)
            continue
        s = _UNITTEST_SUMMARY.match(line)
        if s:
            _report(statuses, s["name"], TestStatus.FAILED if s["kind"] == "FAIL" else TestStatus.ERROR)
    return statuses


PARSERS: dict[str, Callable[[str], StatusMap]] = {"pytest": parse_pytest, "unittest": parse_unittest}


def unittest_id(name: str) -> str:
    """The dotted id unittest runs, from a verbose-output name: `test_x (pkg.mod.C.test_x)` -> `pkg.mod.C.test_x`."""
    m = re.fullmatch(r"(\S+) \(([\w.]+)\)", name)
    if not m:
        raise ValueError(f"{name!r} is not a unittest name like 'test_x (package.module.Class.test_x)'")
    method, where = m.groups()
    return where if where.endswith("." + method) else f"{where}.{method}"  # Python < 3.11 prints only the class


# ---- the evaluation log ----


@dataclass(frozen=True)
class EvalLog:
    """What an evaluation log says: whether the patch applied (and how), the test statuses, and what went wrong."""

    patch_applied: bool
    apply_method: ApplyMethod | None
    empty_patch: bool
    statuses: StatusMap
    valid: bool  # the test run happened and its output describes it
    error: str | None
    exit_code: int | None
    timed_out: bool
    output: str = field(repr=False, default="")


def _fenced(log: str, nonce: str) -> str | None:
    start = f"{START_TEST_OUTPUT} {nonce}".rstrip()
    end = f"{END_TEST_OUTPUT} {nonce}".rstrip()
    lines = log.split("\n")
    try:
        i = lines.index(start)
        j = lines.index(end, i + 1)
    except ValueError:
        return None
    return "\n".join(lines[i + 1 : j])


def find_nonce(log: str) -> str:
    """The nonce of an evaluation log's fence ('' when the log has none)."""
    for line in log.split("\n"):
        if line.startswith(START_TEST_OUTPUT):
            return line[len(START_TEST_OUTPUT) :].strip()
    return ""


def read_eval_log(log: str, framework: str, nonce: str = "") -> EvalLog:
    """Parse an evaluation log (what the eval script printed). Markers outside the fenced test output count only
    when they are whole lines; test output can never forge the end fence without the nonce."""
    parse = PARSERS[framework]
    empty = f"\n{EMPTY_PATCH}\n" in f"\n{log}\n"
    m = _APPLIED.search(log)
    method: ApplyMethod | None = None
    if m and m.group(1) in APPLY_METHODS:
        method = m.group(1)  # type: ignore[assignment]
    head = log.split(f"{START_TEST_OUTPUT} {nonce}".rstrip(), 1)[0]
    # the script's own steps are what comes before the tests start: from there on the code under test runs, and it
    # can write to the script's output (its parent's /proc/PID/fd/1): a "Reset Failed" it printed made its 0 an
    # infrastructure failure, masked and retried
    setup = head.split("\n")
    started = f"{TESTS_STARTED} {nonce}".rstrip()
    if started in setup:
        setup = setup[: setup.index(started)]
    head = "\n".join(setup)
    head_lines = set(setup)

    def result(valid: bool, error: str | None, statuses: StatusMap | None = None, **kw: Any) -> EvalLog:
        return EvalLog(
            patch_applied=kw.pop("applied", method is not None),
            apply_method=method,
            empty_patch=empty,
            statuses=statuses or {},
            valid=valid,
            error=error,
            exit_code=kw.pop("exit_code", None),
            timed_out=kw.pop("timed_out", False),
            output=kw.pop("output", ""),
        )

    reset = next((line for line in head.split("\n") if line.startswith(RESET_FAILED)), None)
    if reset is not None:
        return result(False, f"{SETUP_FAILED}: {reset[len(RESET_FAILED) :].strip(': ')}")
    patched = next((line for line in head.split("\n") if line.startswith(PATCHED_SETUP_FAILED)), None)
    if patched is not None:
        return result(
            False, f"the patched tree could not be prepared: {patched[len(PATCHED_SETUP_FAILED) :].strip(': ')}"
        )
    if APPLY_PATCH_FAIL in head_lines:
        return result(False, "the patch did not apply (git apply, git apply --reject, patch --fuzz all failed)")
    if TEST_PATCH_FAIL in head_lines:
        return result(False, "the test patch did not apply")
    output = _fenced(log, nonce)
    if output is None:
        return result(False, "the test output is incomplete (no end fence): the run was killed or cut")
    tail = log.rsplit(f"{END_TEST_OUTPUT} {nonce}".rstrip(), 1)[-1]
    code_match = _EXIT_CODE.search(tail)
    exit_code = int(code_match.group(1)) if code_match else None
    timed_out = TESTS_TIMEOUT in tail.split("\n")
    statuses = parse(output)
    if timed_out:
        return result(False, "the tests timed out", statuses, exit_code=exit_code, timed_out=True, output=output)
    if TEST_OUTPUT_CUT in tail.split("\n"):
        # the worst-status rule reads pytest's own summary, which a flood the code under test printed pushed past the
        # cap: PASSED lines it printed earlier were all that was left
        return result(False, "the tests printed past the output cap: the report was cut", statuses, output=output)
    if any(line.startswith(TESTS_ERROR) for line in tail.split("\n")):
        # the evaluation says the sandbox ran out of memory (evaluate.py): what the run printed does not describe it
        # (a test's process killed, its report maybe written before), so it is no resolution; it was graded as is
        return result(False, "the sandbox ran out of memory while the tests ran", statuses, output=output)
    if not statuses:
        return result(False, "no test results in the output", statuses, exit_code=exit_code, output=output)
    if exit_code not in (None, 0) and not any(s in (TestStatus.FAILED, TestStatus.ERROR) for s in statuses.values()):
        # SWE-bench's check: a non-zero exit with no failure reported means the log does not describe the run
        return result(False, f"the test command exited {exit_code} but reported no failure", statuses, output=output)
    return result(True, None, statuses, exit_code=exit_code, output=output)


# ---- grading: statuses -> FAIL_TO_PASS / PASS_TO_PASS -> resolution ----


def test_passed(name: str, statuses: Mapping[str, TestStatus]) -> bool:
    """PASSED or XFAIL."""
    return statuses.get(name) in (TestStatus.PASSED, TestStatus.XFAIL)


def test_maintained(name: str, statuses: Mapping[str, TestStatus]) -> bool:
    """For PASS_TO_PASS: passing, or skipped (a skip is not a regression)."""
    return test_passed(name, statuses) or statuses.get(name) == TestStatus.SKIPPED


def test_failed(name: str, statuses: Mapping[str, TestStatus]) -> bool:
    """Missing, FAILED, ERROR or SKIPPED (a skipped FAIL_TO_PASS test is not a resolution)."""
    return statuses.get(name) in (None, TestStatus.FAILED, TestStatus.ERROR, TestStatus.SKIPPED)


def grade_tests(
    statuses: Mapping[str, TestStatus],
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    gold: Mapping[str, TestStatus] | None = None,
) -> TestsStatus:
    """SWE-bench's `tests_status`: success / failure lists of each category (FAIL_TO_FAIL and PASS_TO_FAIL empty).
    With `gold` (a listed test's status under the gold patch where it is not PASSED) a test succeeds only PASSED or
    with its gold status, and fails otherwise; without it, by SWE-bench's rules (the module doc)."""
    report: TestsStatus = {k: {"success": [], "failure": []} for k in (FAIL_TO_PASS, PASS_TO_PASS)}
    if gold is not None:
        for category, names in ((FAIL_TO_PASS, fail_to_pass), (PASS_TO_PASS, pass_to_pass)):
            for name in names:
                got = statuses.get(name)
                ok = got == TestStatus.PASSED or (got is not None and got == gold.get(name))
                report[category]["success" if ok else "failure"].append(name)
    else:
        for name in fail_to_pass:
            if test_passed(name, statuses):
                report[FAIL_TO_PASS]["success"].append(name)
            elif test_failed(name, statuses):
                report[FAIL_TO_PASS]["failure"].append(name)
        for name in pass_to_pass:
            if test_maintained(name, statuses):
                report[PASS_TO_PASS]["success"].append(name)
            elif test_failed(name, statuses):
                report[PASS_TO_PASS]["failure"].append(name)
    report[FAIL_TO_FAIL] = {"success": [], "failure": []}
    report[PASS_TO_FAIL] = {"success": [], "failure": []}
    return report


def _rate(part: Mapping[str, list[str]]) -> float:
    total = len(part["success"]) + len(part["failure"])
    return 1.0 if total == 0 else len(part["success"]) / total


def resolution(tests_status: TestsStatus) -> ResolvedStatus:
    """FULL when every FAIL_TO_PASS and PASS_TO_PASS test succeeds; PARTIAL when some FAIL_TO_PASS do and every
    PASS_TO_PASS does; NO otherwise."""
    f2p, p2p = _rate(tests_status[FAIL_TO_PASS]), _rate(tests_status[PASS_TO_PASS])
    if f2p == 1 and p2p == 1:
        return ResolvedStatus.FULL
    if 0 < f2p < 1 and p2p == 1:
        return ResolvedStatus.PARTIAL
    return ResolvedStatus.NO


@dataclass(frozen=True)
class Grade:
    """The outcome of one evaluation."""

    instance_id: str
    patch_is_none: bool
    patch_exists: bool
    patch_successfully_applied: bool
    apply_method: ApplyMethod | None
    resolution: ResolvedStatus
    tests_status: TestsStatus | None
    error: str | None
    statuses: StatusMap

    @property
    def resolved(self) -> bool:
        """SWE-bench's `resolved`: a non-empty patch that applied and made the tests FULL."""
        return self.resolution == ResolvedStatus.FULL and self.patch_exists and self.patch_successfully_applied

    def report(self) -> dict[str, Any]:
        """`report.json`'s content: `{instance_id: {...}}` in SWE-bench's shape, plus envfleet's extra keys."""
        body: dict[str, Any] = {
            "patch_is_None": self.patch_is_none,
            "patch_exists": self.patch_exists,
            "patch_successfully_applied": self.patch_successfully_applied,
            "resolved": self.resolved,
            "resolution": self.resolution.value,
            "apply_method": self.apply_method,
        }
        if self.tests_status is not None:
            body["tests_status"] = self.tests_status
        if self.error:
            body["error"] = self.error
        return {self.instance_id: body}


def grade_log(
    instance_id: str,
    log: str,
    *,
    framework: str,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    model_patch: str | bytes | None,
    nonce: str = "",
    gold: Mapping[str, TestStatus] | None = None,
) -> Grade:
    """Grade an evaluation log against the instance's tests (`gold`: grade_tests). An empty patch is run (its
    statuses are reported) but never counts as resolved, as in SWE-bench."""
    parsed = read_eval_log(log, framework, nonce)
    exists = bool(model_patch and model_patch.strip())
    applied = parsed.patch_applied and exists
    if not parsed.valid:
        return Grade(
            instance_id,
            model_patch is None,
            exists,
            applied,
            parsed.apply_method,
            ResolvedStatus.NO,
            None,
            parsed.error,
            parsed.statuses,
        )
    tests = grade_tests(parsed.statuses, fail_to_pass, pass_to_pass, gold)
    return Grade(
        instance_id,
        model_patch is None,
        exists,
        applied,
        parsed.apply_method,
        resolution(tests),
        tests,
        None,
        parsed.statuses,
    )
