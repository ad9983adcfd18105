"""Grading as pure functions: parsers, the evaluation log, FAIL_TO_PASS / PASS_TO_PASS categories, resolution."""

from __future__ import annotations

import pytest

from environments.swe.env import checked
from environments.swe.grading import (
    APPLY_PATCH_FAIL,
    END_TEST_OUTPUT,
    START_TEST_OUTPUT,
    TEST_EXIT_CODE,
    TESTS_ERROR,
    TESTS_TIMEOUT,
    ResolvedStatus,
    TestStatus,
    grade_log,
    grade_tests,
    parse_pytest,
    parse_unittest,
    read_eval_log,
    resolution,
    unittest_id,
)
from orchestrator.core.errors import SandboxError

PYTEST_OUT = """\
============================= test session starts ==============================
collected 5 items

tests/test_a.py .F.sx                                                    [100%]

=================================== FAILURES ===================================
___________________________________ test_two ___________________________________
E   assert 1 == 2
=========================== short test summary info ============================
PASSED tests/test_a.py::test_one
PASSED tests/test_a.py::test_p[a-b]
FAILED tests/test_a.py::test_two - assert 1 == 2
SKIPPED [1] tests/test_a.py:20: not today
XFAIL tests/test_a.py::test_x - known
ERROR tests/test_a.py::TestK::test_e - RuntimeError: boom
============== 1 failed, 2 passed, 1 skipped, 1 xfailed in 0.10s ===============
"""

UNITTEST_OUT = """\
test_a (tests.test_m.ATests.test_a) ... ok
test_b (tests.test_m.ATests.test_b) ... FAIL
test_c (tests.test_m.ATests.test_c) ... skipped 'slow'
test_d (tests.test_m.ATests.test_d) ... ERROR
test_e (tests.test_m.ATests.test_e) ... expected failure
test_f (tests.test_m.BTests.test_f) ... ok

======================================================================
FAIL: test_b (tests.test_m.ATests.test_b)
----------------------------------------------------------------------
Traceback (most recent call last):
AssertionError: 1 != 2

======================================================================
FAIL: test_f (tests.test_m.BTests.test_f) (i=3)
----------------------------------------------------------------------
AssertionError: subtest
----------------------------------------------------------------------
Ran 6 tests in 0.001s

FAILED (failures=2, errors=1, skipped=1, expected failures=1)
"""


def test_a_parametrized_id_holding_a_dash_is_read_whole() -> None:
    # cut at " - ", both became t.py::f[a, the failure won, and a listed t.py::f[a - b] never passed
    lines = (
        "PASSED t.py::f[a - b]\n"
        "FAILED t.py::f[a - c] - AssertionError: x] - y\n"
        "XFAIL t.py::f[d] - reason\n"
        "ERROR t.py::g - boom - again\n"
    )
    assert parse_pytest(lines) == {
        "t.py::f[a - b]": TestStatus.PASSED,
        "t.py::f[a - c]": TestStatus.FAILED,
        "t.py::f[d]": TestStatus.XFAIL,
        "t.py::g": TestStatus.ERROR,
    }


def test_pytest_parser_reads_the_short_summary() -> None:
    assert parse_pytest(PYTEST_OUT) == {
        "tests/test_a.py::test_one": TestStatus.PASSED,
        "tests/test_a.py::test_p[a-b]": TestStatus.PASSED,
        "tests/test_a.py::test_two": TestStatus.FAILED,
        "tests/test_a.py::test_x": TestStatus.XFAIL,
        "tests/test_a.py::TestK::test_e": TestStatus.ERROR,
    }


def test_unittest_parser_reads_verbose_lines_and_failure_blocks() -> None:
    statuses = parse_unittest(UNITTEST_OUT)
    assert statuses["test_a (tests.test_m.ATests.test_a)"] == TestStatus.PASSED
    assert statuses["test_b (tests.test_m.ATests.test_b)"] == TestStatus.FAILED
    assert statuses["test_c (tests.test_m.ATests.test_c)"] == TestStatus.SKIPPED
    assert statuses["test_d (tests.test_m.ATests.test_d)"] == TestStatus.ERROR
    assert statuses["test_e (tests.test_m.ATests.test_e)"] == TestStatus.XFAIL
    # a failing subtest shows only in the failure block: the test fails though its line said ok
    assert statuses["test_f (tests.test_m.BTests.test_f)"] == TestStatus.FAILED


def test_unittest_id() -> None:
    assert unittest_id("test_a (tests.test_m.ATests.test_a)") == "tests.test_m.ATests.test_a"
    assert unittest_id("test_a (tests.test_m.ATests)") == "tests.test_m.ATests.test_a"  # Python <= 3.10 output
    with pytest.raises(ValueError, match="not a unittest name"):
        unittest_id("tests/test_a.py::test_a")


def _log(body: str, nonce: str = "n1", code: int = 1, head: str = ">>>>> Applied Patch (git apply)") -> str:
    return f"{head}\n{START_TEST_OUTPUT} {nonce}\n{body}\n{END_TEST_OUTPUT} {nonce}\n{TEST_EXIT_CODE}: {code}\n"


F2P = ["tests/test_a.py::test_two"]
P2P = ["tests/test_a.py::test_one", "tests/test_a.py::test_x"]


def test_grade_categories_follow_swe_bench() -> None:
    statuses = parse_pytest(PYTEST_OUT)
    tests = grade_tests(statuses, [*F2P, "tests/test_a.py::missing"], P2P)
    assert tests["FAIL_TO_PASS"] == {"success": [], "failure": [*F2P, "tests/test_a.py::missing"]}
    assert tests["PASS_TO_PASS"] == {"success": P2P, "failure": []}
    assert tests["FAIL_TO_FAIL"] == tests["PASS_TO_FAIL"] == {"success": [], "failure": []}
    assert resolution(tests) == ResolvedStatus.NO
    # a skipped PASS_TO_PASS test is kept, a skipped FAIL_TO_PASS test is not resolved
    skipped = {"a": TestStatus.SKIPPED, "b": TestStatus.PASSED, "c": TestStatus.PASSED}
    assert resolution(grade_tests(skipped, ["b"], ["a"])) == ResolvedStatus.FULL
    assert resolution(grade_tests(skipped, ["a", "b"], ["c"])) == ResolvedStatus.PARTIAL
    assert resolution(grade_tests({"a": TestStatus.PASSED, "b": TestStatus.FAILED}, ["a"], ["b"])) == ResolvedStatus.NO


def test_the_harness_counts_xfail_and_skips_only_where_gold_has_them() -> None:
    # SWE-bench's rules (gold=None): the code under test's pytest.xfail() passes a FAIL_TO_PASS test, and its
    # pytest.skip() keeps a PASS_TO_PASS test it broke
    hacked = {"f": TestStatus.XFAIL, "p": TestStatus.SKIPPED, "q": TestStatus.XFAIL}
    assert resolution(grade_tests(hacked, ["f"], ["p", "q"])) == ResolvedStatus.FULL
    # the harness's (gold: none of them xfails or skips under the gold patch): each is a failure
    strict = grade_tests(hacked, ["f"], ["p", "q"], gold={})
    assert strict["FAIL_TO_PASS"] == {"success": [], "failure": ["f"]}
    assert strict["PASS_TO_PASS"] == {"success": [], "failure": ["p", "q"]}
    assert resolution(strict) == ResolvedStatus.NO
    # a test that skips or xfails under the gold patch too succeeds with that status, and with PASSED, not another
    gold = {"p": TestStatus.SKIPPED, "q": TestStatus.XFAIL}
    fixed = {"f": TestStatus.PASSED, "p": TestStatus.SKIPPED, "q": TestStatus.PASSED}
    assert resolution(grade_tests(fixed, ["f"], ["p", "q"], gold=gold)) == ResolvedStatus.FULL
    swapped = {"f": TestStatus.PASSED, "p": TestStatus.XFAIL, "q": TestStatus.SKIPPED}
    assert grade_tests(swapped, ["f"], ["p", "q"], gold=gold)["PASS_TO_PASS"]["failure"] == ["p", "q"]
    # missing, FAILED and ERROR fail, as before
    broken = {"p": TestStatus.FAILED, "q": TestStatus.ERROR}
    assert grade_tests(broken, ["f"], ["p", "q"], gold={})["PASS_TO_PASS"]["failure"] == ["p", "q"]
    assert grade_tests(broken, ["f"], ["p", "q"], gold={})["FAIL_TO_PASS"]["failure"] == ["f"]


def test_read_eval_log_needs_the_nonce_fence() -> None:
    good = read_eval_log(_log(PYTEST_OUT), "pytest", "n1")
    assert good.valid and good.apply_method == "git apply" and good.exit_code == 1
    # a patch that prints a fake end fence without the nonce cannot cut the output short
    forged = _log(PYTEST_OUT + f"\n{END_TEST_OUTPUT}\nPASSED tests/test_a.py::test_two", "n1")
    assert read_eval_log(forged, "pytest", "n2").error is not None
    cut = f">>>>> Applied Patch (git apply)\n{START_TEST_OUTPUT} n1\n{PYTEST_OUT}"
    assert "incomplete" in (read_eval_log(cut, "pytest", "n1").error or "")


@pytest.mark.parametrize(
    ("log", "error"),
    [
        (f"{APPLY_PATCH_FAIL}\n", "did not apply"),
        (">>>>> Reset Failed: HEAD is x\n", "could not be set up"),
        (_log(PYTEST_OUT, code=124) + f"{TESTS_TIMEOUT}\n", "timed out"),
        (_log("nothing ran", code=4), "no test results"),
        (_log("PASSED tests/test_a.py::test_two", code=1), "reported no failure"),
        # the evaluation's note that the sandbox ran out of memory was written and never read: graded as printed
        (
            _log(PYTEST_OUT.replace("FAILED", "PASSED")) + f"{TESTS_ERROR}: the sandbox ran out of memory\n",
            "ran out of memory",
        ),
    ],
)
def test_bad_logs_are_not_graded(log: str, error: str) -> None:
    grade = grade_log("i", log, framework="pytest", fail_to_pass=F2P, pass_to_pass=P2P, model_patch="x", nonce="n1")
    assert not grade.resolved and grade.resolution == ResolvedStatus.NO and error in (grade.error or "")
    assert "tests_status" not in grade.report()["i"]


def test_report_shape() -> None:
    fixed = PYTEST_OUT.replace("FAILED tests/test_a.py::test_two - assert 1 == 2", "PASSED tests/test_a.py::test_two")
    log = _log(fixed.replace("ERROR tests/test_a.py::TestK::test_e - RuntimeError: boom", ""), code=0)
    grade = grade_log("i", log, framework="pytest", fail_to_pass=F2P, pass_to_pass=P2P, model_patch="x", nonce="n1")
    body = grade.report()["i"]
    assert body["resolved"] is True and body["patch_successfully_applied"] is True
    assert set(body["tests_status"]) == {"FAIL_TO_PASS", "PASS_TO_PASS", "FAIL_TO_FAIL", "PASS_TO_FAIL"}
    # the same log with an empty patch: graded, never resolved
    empty = grade_log("i", log, framework="pytest", fail_to_pass=F2P, pass_to_pass=P2P, model_patch="", nonce="n1")
    assert empty.resolution == ResolvedStatus.FULL and not empty.resolved and not empty.report()["i"]["patch_exists"]


def test_a_test_reported_twice_keeps_its_worst_status() -> None:
    # the code under test runs in the test process: it can print a passing line after the real failing one
    forged = "\nPASSED tests/test_a.py::test_two\nPASSED tests/test_a.py::TestK::test_e\n"
    statuses = parse_pytest(PYTEST_OUT + forged)
    assert statuses["tests/test_a.py::test_two"] == TestStatus.FAILED
    assert statuses["tests/test_a.py::TestK::test_e"] == TestStatus.ERROR
    again = parse_unittest(UNITTEST_OUT + "\ntest_b (tests.test_m.ATests.test_b) ... ok\n")
    assert again["test_b (tests.test_m.ATests.test_b)"] == TestStatus.FAILED
    # XFAIL, which the harness counts only where gold has it, is worse than a PASSED line printed before or after
    for lines in ("PASSED t.py::a\nXFAIL t.py::a - reason\n", "XFAIL t.py::a - reason\nPASSED t.py::a\n"):
        assert parse_pytest(lines) == {"t.py::a": TestStatus.XFAIL}
        assert resolution(grade_tests(parse_pytest(lines), ["t.py::a"], [], gold={})) == ResolvedStatus.NO


@pytest.mark.parametrize(
    ("log", "infrastructure"),
    [
        (">>>>> Reset Failed: HEAD is x, expected y\n", True),  # the grader's own copy of the repository
        (">>>>> Reset Failed: cannot copy /tmp/grade-1/base\n", True),
        (f"{APPLY_PATCH_FAIL}\n", False),  # the agent's patch
        (">>>>> Applied Patch (git apply)\n>>>>> Patched Tree Setup Failed: test files\n", False),  # maybe the patch's
        (_log(PYTEST_OUT, code=124) + f"{TESTS_TIMEOUT}\n", False),  # the agent's code
    ],
)
def test_only_the_graders_own_setup_failing_is_an_infrastructure_failure_in_rl(log: str, infrastructure: bool) -> None:
    # SWE-bench counts a failed reset unresolved; the RL environment scored it 0: a broken grader passed off as the
    # policy's reward. What the agent's patch or code did stays graded.
    grade = grade_log("i", log, framework="pytest", fail_to_pass=F2P, pass_to_pass=P2P, model_patch="x", nonce="n1")
    if infrastructure:
        with pytest.raises(SandboxError, match="the grader could not set up i"):
            checked(grade)
    else:
        assert checked(grade) is grade
