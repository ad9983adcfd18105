"""The same test logs through SWE-bench's own grading code (the `swebench` package) and ours: the same per-test
statuses, the same FAIL_TO_PASS / PASS_TO_PASS categories, the same resolution.

`import swebench.harness` would import docker, datasets and modal (its __init__ pulls in the whole harness), so the
narrowest import is used: a bare `swebench.harness` package, and from it only grading, constants and log_parsers
(whose own imports are the standard library, `swebench.types` and `unidiff`).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from environments.swe.grading import (
    FAIL_TO_PASS,
    PASS_TO_PASS,
    TestStatus,
    find_nonce,
    grade_tests,
    read_eval_log,
    resolution,
)
from environments.swe.instance import SweInstance
from tests.environments.swe.conftest import ShippedRuns
from tests.environments.swe.test_grading import PYTEST_OUT, UNITTEST_OUT, _log


def swebench_grading() -> types.ModuleType:
    """swebench.harness.grading without running swebench/harness/__init__.py."""
    import swebench  # type: ignore[import-untyped]

    if "swebench.harness" not in sys.modules:
        harness = types.ModuleType("swebench.harness")
        harness.__path__ = [str(Path(swebench.__file__).parent / "harness")]
        sys.modules["swebench.harness"] = harness
    from swebench.harness import grading  # type: ignore[import-untyped]

    module: types.ModuleType = grading
    return module


PARSER = {"pytest": "parse_log_pytest", "unittest": "parse_log_django"}


def crosscheck(inst: SweInstance, log_path: Path) -> dict[str, Any]:
    """Grade one log both ways and assert they agree; return SWE-bench's view."""
    sb = swebench_grading()
    from swebench.types import TestSpec  # type: ignore[import-untyped]

    spec = TestSpec(
        instance_id=inst.instance_id,
        image="",
        eval_script_list=[],
        repo=inst.repo,
        version=inst.version,
        FAIL_TO_PASS=inst.FAIL_TO_PASS,
        PASS_TO_PASS=inst.PASS_TO_PASS,
        log_parser=PARSER[inst.test_runner.framework],
        eval_type="pass_and_fail",
    )
    text = log_path.read_text()
    ours = read_eval_log(text, inst.test_runner.framework, find_nonce(text))
    sb_map, found = sb.get_logs_eval(spec, str(log_path))
    assert found == ours.valid, (inst.instance_id, ours.error)
    for test in inst.tests:
        mine = ours.statuses.get(test)
        theirs = sb_map.get(test)
        if theirs is None and inst.test_runner.framework == "unittest":
            # a unittest test whose subtests fail: SWE-bench keys each failing subtest (`name (id) (params)`) and
            # never the test itself, which it then grades as missing, i.e. failed; ours records the test as failed
            assert mine in (TestStatus.FAILED, TestStatus.ERROR), (inst.instance_id, test)
            assert any(k.startswith(test + " (") for k in sb_map), (inst.instance_id, test)
            continue
        assert (mine.value if mine else None) == theirs, (inst.instance_id, test)
    gold = {FAIL_TO_PASS: inst.FAIL_TO_PASS, PASS_TO_PASS: inst.PASS_TO_PASS}
    sb_tests = sb.get_eval_tests_report(sb_map, gold)
    our_tests = grade_tests(ours.statuses, inst.FAIL_TO_PASS, inst.PASS_TO_PASS)
    for cat in (FAIL_TO_PASS, PASS_TO_PASS):
        assert sb_tests[cat] == our_tests[cat], (inst.instance_id, cat)
    assert sb.get_resolution_status(sb_tests) == resolution(our_tests).value
    return {"found": found, "resolution": sb.get_resolution_status(sb_tests)}


def test_synthetic_logs_agree(tmp_path: Path) -> None:
    pytest_inst = SweInstance.model_validate(
        {
            "instance_id": "x-1",
            "repo": "pypi/x",
            "base_commit": "a" * 40,
            "problem_statement": "p",
            "patch": "p",
            "FAIL_TO_PASS": ["tests/test_a.py::test_two", "tests/test_a.py::test_p[a-b]"],
            "PASS_TO_PASS": ["tests/test_a.py::test_one", "tests/test_a.py::test_x", "tests/test_a.py::TestK::test_e"],
            "version": "1",
            "environment_setup_commit": "b" * 40,
            "source": {"kind": "image", "image": "x"},
        }
    )
    unit_inst = pytest_inst.model_copy(
        update={
            "FAIL_TO_PASS": ["test_b (tests.test_m.ATests.test_b)", "test_a (tests.test_m.ATests.test_a)"],
            "PASS_TO_PASS": ["test_c (tests.test_m.ATests.test_c)", "test_d (tests.test_m.ATests.test_d)"],
            "test_runner": pytest_inst.test_runner.model_copy(update={"framework": "unittest"}),
        }
    )
    for inst, out in ((pytest_inst, PYTEST_OUT), (unit_inst, UNITTEST_OUT)):
        path = tmp_path / f"{inst.test_runner.framework}.txt"
        path.write_text(_log(out, nonce="abc"))
        assert crosscheck(inst, path) == {"found": True, "resolution": "RESOLVED_NO"}


@pytest.mark.parametrize("run", ["gold", "empty"])
def test_real_logs_agree(shipped_runs: ShippedRuns, run: str) -> None:
    """Every log of the gold and empty evaluations of the shipped dataset."""
    expected = "RESOLVED_FULL" if run == "gold" else "RESOLVED_NO"
    for inst in shipped_runs.instances:
        log = shipped_runs.log_dir / run / run / inst.instance_id / "test_output.txt"
        assert crosscheck(inst, log) == {"found": True, "resolution": expected}, inst.instance_id
