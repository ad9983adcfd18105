"""The SWE grader's test runner is the image's: a patch (or whatever an RL policy leaves in the workspace, which the
grader diffs as its patch) cannot stand in for pytest or plug itself into it with files in the repository, and a test
the code under test xfails or skips is no success (SWE-bench counts both).

Code under test still runs in the process that reports the results, so it can forge them (see
environments/swe/script.py, "accepted risk"); what is closed here is the runner itself being replaced by a file the
patch adds: such a file used to be imported in pytest's place (`python -m` puts the cwd first on sys.path) or loaded
as a pytest plugin (an entry point of a .dist-info folder in the cwd)."""

from __future__ import annotations

import os
import py_compile
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import docker
import pytest

from environments.swe import script as swe_script
from environments.swe.env import checked
from environments.swe.evaluate import run_evaluation
from environments.swe.grading import Grade, TestStatus, find_nonce, grade_log, parse_pytest, parse_unittest
from environments.swe.patches import check_patch, file_diff
from environments.swe.script import EVAL_ENV, HARNESS_FILES, PYTEST_RUNNER, UNITTEST_RUNNER
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import RolloutStatus
from orchestrator.testing.scripted_policy import Script, ScriptedToolCall, Step
from orchestrator.testing.scripts import reference_script
from tests.environments.swe.conftest import UNITTESTS, Tiny, tiny  # noqa: F401  (the fixture)
from tests.environments.swe.test_evaluate import HOOK, _forger, _new_file, pred, report
from tests.orchestrator.servers import serve
from tests.security.test_forced_env_errors import _run, swe_registry

# prints a passing line for every test id in the command line, and exits 0: what `python -m pytest` ran before as
# pytest.py (or, as pluggy.py, when pytest imported it)
FAKE_PYTEST = """import sys

for arg in sys.argv[1:]:
    if "::" in arg:
        print("PASSED " + arg)
sys.exit(0)
"""
# the same for unittest's verbose lines, as shutil.py: argparse imports it when unittest.main builds its parser,
# which the old runner did after it had put the cwd first on sys.path
FAKE_SHUTIL = """import sys

for arg in sys.argv[1:]:
    if not arg.startswith("-"):
        print(arg.rsplit(".", 1)[1] + " (" + arg + ") ... ok", file=sys.stderr)
sys.exit(0)
"""
# an installed-package record in the repository's root whose pytest11 entry point is a plugin that passes every test
PLUGIN = {
    "forge-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: forge\nVersion: 1.0\n",
    "forge-1.0.dist-info/entry_points.txt": "[pytest11]\nforge = forge_plugin\n",
    "forge_plugin.py": HOOK,
}


XFAIL = '    import pytest\n\n    pytest.xfail("not today")\n'
SKIP = '    import unittest\n\n    raise unittest.SkipTest("not today")\n'
OK_THEN_SKIP = (
    '    import sys, unittest\n\n    sys.__stderr__.write("ok\\n")\n    sys.__stderr__.flush()\n'
    '    raise unittest.SkipTest("not today")\n'
)


def _giving_up(source: str, function: str, body: str) -> str:
    """`source` with `body` run first in `function`."""
    head = next(line for line in source.splitlines(keepends=True) if line.startswith(f"def {function}("))
    return source.replace(head, head + body, 1)


async def test_a_patch_that_xfails_or_skips_the_tests_it_is_graded_by_resolves_nothing(
    tiny: Tiny,  # noqa: F811
    backend: DockerBackend,
    docker_client: docker.DockerClient,
    tmp_path: Path,
) -> None:
    # the code under test gives up the way a test may. SWE-bench counts the FAIL_TO_PASS tests that call it as passed
    # (XFAIL), and a PASS_TO_PASS test it broke as kept (SKIPPED): each resolved the instance, a reward of 1
    py, ut = tiny.pytest.instance_id, tiny.unittest.instance_id
    forger = _forger(tiny.pytest.FAIL_TO_PASS).replace("FAILED zz.py::x\\n", "")
    preds = [
        pred(py, "xfail", file_diff("calc.py", tiny.bad, _giving_up(tiny.bad, "clamp", XFAIL))),
        pred(ut, "skip", file_diff("calc.py", tiny.bad, _giving_up(tiny.good.replace("a + b", "a - b"), "add", SKIP))),
        # a skip that leaves its test no status of its own, and a passing line the code prints for it: unittest's
        # runner wrote a test's name before it ran, so an "ok" written then completed its line; pytest's -rA names
        # no skipped test, so a PASSED line printed at exit stood alone
        pred(ut, "skip-ok", file_diff("calc.py", tiny.bad, _giving_up(tiny.bad, "clamp", OK_THEN_SKIP))),
        pred(py, "skip-forged", file_diff("calc.py", tiny.bad, _giving_up(tiny.bad, "clamp", SKIP) + forger)),
    ]
    summary = await run_evaluation(
        [tiny.pytest, tiny.unittest], preds, run_id="r", backend=backend, client=docker_client, log_dir=tmp_path
    )
    assert summary["error_instances"] == 0, summary["errors"]
    run = tmp_path / "r"
    xfail = report(run, "xfail", py)
    assert not xfail["resolved"] and xfail["tests_status"]["FAIL_TO_PASS"]["failure"] == tiny.pytest.FAIL_TO_PASS
    skip = report(run, "skip", ut)
    assert not skip["resolved"] and skip["tests_status"]["FAIL_TO_PASS"]["failure"] == []
    assert skip["tests_status"]["PASS_TO_PASS"]["failure"] == tiny.unittest.PASS_TO_PASS
    for model, iid in (("skip-ok", ut), ("skip-forged", py)):
        body = report(run, model, iid)
        assert not body["resolved"] and body["tests_status"]["FAIL_TO_PASS"]["success"] == [], (model, body)
    # what the logs say: the statuses SWE-bench counts as passed and as kept, each skip named
    logs = {
        p.model_name_or_path: (run / p.model_name_or_path / p.instance_id / "test_output.txt").read_text()
        for p in preds
    }
    assert "XFAIL tests/test_calc.py::test_clamp_low" in logs["xfail"]
    assert "test_add (tests.test_unit.CalcTests.test_add) ... skipped 'not today'" in logs["skip"]
    assert "test_clamp (tests.test_unit.CalcTests.test_clamp) ... skipped 'not today'" in logs["skip-ok"]
    assert "SKIPPED tests/test_calc.py::test_clamp_low" in logs["skip-forged"]


PASSING_UNITTESTS = UNITTESTS.replace("clamp(-5, 0, 10), 0)", "clamp(-5, 0, 10), clamp(-5, 0, 10))")


def _binary_new_file(path: str, linked_from: str = "") -> str:
    """A git patch adding `path`: PASSING_UNITTESTS compiled to a .pyc that is never checked against its source;
    with `linked_from`, also a symbolic link there to it."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / Path(path).parent).mkdir(parents=True)
        _unchecked_pyc(PASSING_UNITTESTS, root / path)
        added = [path]
        if linked_from:
            link = root / linked_from
            link.parent.mkdir(parents=True)
            link.symlink_to(os.path.relpath(root / path, link.parent))
            added.append(linked_from)
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run([*git, "init", "-q"], cwd=root, check=True)
        subprocess.run([*git, "add", "-f", *added], cwd=root, check=True)
        return subprocess.run(
            [*git, "diff", "--cached", "--binary"], cwd=root, check=True, capture_output=True, text=True
        ).stdout


async def test_a_patch_cannot_replace_or_plug_into_the_test_runner(
    tiny: Tiny,  # noqa: F811
    backend: DockerBackend,
    docker_client: docker.DockerClient,
    tmp_path: Path,
) -> None:
    iid, ut = tiny.pytest.instance_id, tiny.unittest.instance_id
    preds = [
        pred(iid, "gold", tiny.pytest.patch),
        pred(ut, "gold", tiny.unittest.patch),
        pred(iid, "shadow", _new_file("pytest.py", FAKE_PYTEST)),
        pred(iid, "shadow-pluggy", _new_file("pluggy.py", FAKE_PYTEST)),
        pred(iid, "plugin", "".join(_new_file(path, text) for path, text in PLUGIN.items())),
        pred(ut, "shadow-shutil", _new_file("shutil.py", FAKE_SHUTIL)),
        # the unittest module the grader puts back, stood in for by a passing copy of it under the same name
        pred(ut, "shadow-package", _new_file("tests/test_unit/__init__.py", PASSING_UNITTESTS)),
        pred(ut, "shadow-pyc", _binary_new_file(f"tests/__pycache__/test_unit.{sys.implementation.cache_tag}.pyc")),
        # ... and the same bytes under another name, reached through a link that has the .pyc's
        pred(
            ut,
            "shadow-pyc-link",
            _binary_new_file(
                "data/payload.bin", linked_from=f"tests/__pycache__/test_unit.{sys.implementation.cache_tag}.pyc"
            ),
        ),
    ]
    summary = await run_evaluation(
        [tiny.pytest, tiny.unittest], preds, run_id="r", backend=backend, client=docker_client, log_dir=tmp_path
    )
    assert summary["error_instances"] == 0, summary["errors"]
    run = tmp_path / "r"
    # the real runners still find the repository's code (the tests import `calc` from the repository root)
    assert report(run, "gold", iid)["resolved"] and report(run, "gold", ut)["resolved"]
    for model, instance in (
        ("shadow", tiny.pytest),
        ("shadow-pluggy", tiny.pytest),
        ("plugin", tiny.pytest),
        ("shadow-shutil", tiny.unittest),
        ("shadow-package", tiny.unittest),
        ("shadow-pyc", tiny.unittest),
        ("shadow-pyc-link", tiny.unittest),
    ):
        body = report(run, model, instance.instance_id)
        assert body["patch_successfully_applied"] and not body["resolved"], (model, body)
        failing = body["tests_status"]["FAIL_TO_PASS"]["failure"]
        assert sorted(failing) == sorted(instance.FAIL_TO_PASS), (model, body)
    # the fake module is in the tree the tests ran in, yet pytest's own output is what was graded
    output = (run / "shadow" / iid / "test_output.txt").read_text()
    assert "short test summary info" in output and "FAILED tests/test_calc.py::test_clamp_low" in output


# a line git apply echoes whole when it warns of its trailing whitespace: the script's own marker, forged
FORGED_MARKER = ">>>>> Reset Failed: the agent says so "
# imported by the tests in calc.py's place: it writes the marker to the script's own output (bash, the parent of the
# tests' `timeout`), past the line that says the tests started
WRITER = """import os
ppid = os.getppid()
with open(f"/proc/{ppid}/stat") as f:
    script = int(f.read().rsplit(")", 1)[1].split()[1])
with open(f"/proc/{script}/fd/1", "w") as out:
    out.write("\\n>>>>> Reset Failed: written by the code under test\\n")
from calc_impl import *
"""
# imported by the tests in calc.py's place (a package comes before a module): it stops the tests' parent, the
# `timeout` the script waits for, so the script never ends
STOPPER = "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nfrom calc_impl import *\n"


async def test_a_patch_cannot_turn_its_0_into_a_grader_failure(
    tiny: Tiny,  # noqa: F811
    backend: DockerBackend,
    docker_client: docker.DockerClient,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # under RL a grader's failure is masked (INFRA_ERROR, ENV_ERROR), never a 0: a policy whose answer fails learns
    # to fail the grader instead. A line of the patch echoed by git apply read as the script's "Reset Failed"
    # (INFRA_ERROR, retried, masked); tests that stopped the script's processes ran the exec past its time
    # (ENV_ERROR). Both are graded now: unresolved
    from environments.swe import evaluate

    monkeypatch.setattr(evaluate, "EXEC_MARGIN_S", 5.0)
    # what the host keeps of the script's output, smaller here: a patch of many long paths that git apply echoes
    # past it pushed the tests' start marker out, and the stopper's run past its time read as the script's failure
    monkeypatch.setattr(evaluate, "MAX_TEST_OUTPUT", 64 << 10)
    monkeypatch.setattr(evaluate, "PRE_TEST_OUTPUT", 256 << 10)
    deep = "/".join(["d" * 200] * 7)
    flood = "".join(_new_file(f"{deep}/f{i}.txt", "x") for i in range(200))  # ~600 KiB of git apply's lines
    iid = tiny.pytest.instance_id
    preds = [
        pred(iid, "forged-marker", _new_file("notes.txt", FORGED_MARKER)),
        pred(iid, "stopper", _new_file("calc/__init__.py", STOPPER)),
        pred(iid, "writer", _new_file("calc/__init__.py", WRITER)),
        pred(iid, "flooded-stopper", flood + _new_file("calc/__init__.py", STOPPER)),
    ]
    summary = await run_evaluation(
        [tiny.pytest], preds, run_id="r", backend=backend, client=docker_client, log_dir=tmp_path, timeout_s=5
    )
    assert summary["error_instances"] == 0, summary["errors"]
    run = tmp_path / "r"
    forged = report(run, "forged-marker", iid)
    assert forged["patch_successfully_applied"] and not forged["resolved"], forged

    # what the RL environment makes of the same log: a 0, not the grader's set-up failing (INFRA_ERROR)
    def rl_grade(model: str) -> tuple[str, Grade]:
        """A prediction's log, and what the RL environment grades it (checked: raises on the grader's failure)."""
        log = (run / model / iid / "test_output.txt").read_text()
        inst = tiny.pytest
        grade = grade_log(
            iid,
            log,
            framework=inst.test_runner.framework,
            fail_to_pass=inst.FAIL_TO_PASS,
            pass_to_pass=inst.PASS_TO_PASS,
            model_patch="x",
            nonce=find_nonce(log),
            gold={},  # the harness's rules, as evaluate_in_sandbox grades
        )
        return log, checked(grade)

    log, grade = rl_grade("forged-marker")
    assert "  | " + FORGED_MARKER in log.splitlines()  # git apply echoed it, indented
    assert not grade.resolved and grade.error is None, grade.error
    assert not report(run, "stopper", iid)["resolved"]
    flooded = report(run, "flooded-stopper", iid)
    assert flooded["patch_successfully_applied"] and not flooded["resolved"], flooded
    # a marker the code under test wrote to the script's output, after the tests started: graded, not a set-up
    # failure (it was read as one: INFRA_ERROR, masked)
    log, grade = rl_grade("writer")
    assert ">>>>> Reset Failed: written by the code under test" in log.splitlines()
    assert not grade.resolved, grade


def test_a_patch_of_the_repositorys_git_folder_is_refused_whole() -> None:
    # patch --fuzz, the grader's last way to apply a prediction, writes where the patch says: a .git/config filter
    # and a .git/info/attributes line made the grader's checkout of the test files run the prediction's command
    for path in (".git/config", ".git/info/attributes", "sub/.GIT/hooks/post-checkout"):
        problem = check_patch(file_diff(path, "", "[filter]\n") + file_diff("calc.py", "a\n", "b\n"))
        assert problem is not None and problem.fatal and ".git folder" in problem.message, path
    renamed = "diff --git a/x b/.git/x\nsimilarity index 100%\nrename from x\nrename to .git/x\n"
    assert check_patch(renamed) is not None
    assert check_patch(file_diff("src/gitlab.py", "a\n", "b\n")) is None  # a name with .git in it is no .git folder
    assert check_patch(file_diff(".github/workflows/ci.yml", "a\n", "b\n")) is None
    # names as git and patch read them: a quoted name's escapes (\056 is "."), a line that Python's splitlines ends
    # at U+0085 (git and patch end lines at "\n" only), and a context diff's headers each hid .git/config
    hunk = "@@ -1 +1 @@\n-a\n+b\n"
    quoted = 'diff --git "a/\\056git/config" "b/\\056git/config"\n--- "a/\\056git/config"\n+++ "b/\\056git/config"\n'
    next_line = file_diff("calc.py", "a\n", "b\n") + "--- \x85/.git/config\n+++ \x85/.git/config\n" + hunk
    context = "*** a/.git/config\n--- b/.git/config\n***************\n*** 1 ****\n! a\n--- 1 ----\n! b\n"
    for hidden in (quoted + hunk, next_line, context):
        problem = check_patch(hidden)
        assert problem is not None and problem.fatal and ".git folder" in problem.message, hidden


SCRATCH_TESTS = """import sys, unittest


def buggy():
    sys.__stderr__.write("test_a (pkg.test_u.T.test_a) ... ok\\n~ ")  # a line of its own, and one left open
    sys.__stderr__.flush()
    raise unittest.SkipTest("x")


class T(unittest.TestCase):
    def test_a(self):
        buggy()

    def test_b(self):
        self.assertEqual(1, 1)

    @unittest.expectedFailure
    def test_c(self):
        self.assertEqual(1, 2)

    def test_d(self):
        for i in range(2):
            with self.subTest(i=i):
                self.assertEqual(i, 0)


class C(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        sys.__stderr__.write("test_e (pkg.test_u.C.test_e) ... ok\\n")
        raise unittest.SkipTest("the class")

    def test_e(self):
        pass
"""


def test_the_unittest_runner_names_each_tests_outcome_on_a_line_of_its_own(tmp_path: Path) -> None:
    # the grader's runner itself, as the harness starts it (python3 -P, its arguments the tests' ids): a passing line
    # the code under test printed stood for a test that skipped, whether the skip was the test's or its class's
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "test_u.py").write_text(SCRATCH_TESTS)
    (tmp_path / "runner.py").write_text(UNITTEST_RUNNER)
    ids = [f"pkg.test_u.T.test_{c}" for c in "abcd"] + ["pkg.test_u.C.test_e"]
    out = subprocess.run(
        [sys.executable, "-P", "runner.py", *ids], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    statuses = parse_unittest(out.stdout + out.stderr)
    expected = {
        "test_a (pkg.test_u.T.test_a)": TestStatus.SKIPPED,
        "test_b (pkg.test_u.T.test_b)": TestStatus.PASSED,
        "test_c (pkg.test_u.T.test_c)": TestStatus.XFAIL,
        "test_d (pkg.test_u.T.test_d)": TestStatus.FAILED,
        "test_e (pkg.test_u.C.test_e)": TestStatus.SKIPPED,
    }
    assert {k: statuses.get(k) for k in expected} == expected, out.stderr


FAILING = "import unittest\n\n\nclass T(unittest.TestCase):\n    def test_a(self):\n        self.assertEqual(1, 2)\n"
PASSING = FAILING.replace("1, 2", "1, 1")


def _unchecked_pyc(source: str, where: Path) -> None:
    """`source` compiled to `where` as a .pyc that Python never checks against the .py beside it."""
    src = where.parent / "passing_source.py"
    src.write_text(source)
    py_compile.compile(str(src), cfile=str(where), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    src.unlink()


def test_the_unittest_runner_runs_the_test_file_the_grader_put_back_not_a_shadow_of_it(tmp_path: Path) -> None:
    # pkg/test_u.py is the grader's (failing here); beside it, a passing copy the patch added as a package of the same
    # name, which Python imports before the .py (an extension module too: the same check of the module's file
    # refuses it). It passed the test the grader had put back. (A .pyc compiled unchecked from a passing copy goes
    # with the tree's compiled files: test_a_patch_cannot_replace_or_plug_into_the_test_runner.)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "test_u.py").write_text(FAILING)
    (pkg / "test_u").mkdir()
    (pkg / "test_u" / "__init__.py").write_text(PASSING)
    (tmp_path / "runner.py").write_text(UNITTEST_RUNNER)
    env = {**os.environ, **EVAL_ENV}
    out = subprocess.run(
        [sys.executable, "-P", "runner.py", "pkg.test_u.T.test_a"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    statuses = parse_unittest(out.stdout + out.stderr)
    assert statuses.get("test_a (pkg.test_u.T.test_a)") == TestStatus.ERROR, out.stderr
    assert "its module was loaded from" in out.stderr and "test_u/__init__.py" in out.stderr


def test_a_unittest_modules_copies_in_every_import_folder_are_put_back(tiny: Tiny) -> None:  # noqa: F811
    # the runner imports from the cwd first, then the instance's pythonpath: a passing copy the patch added at the
    # root stood in for the test file put back under tests/ (only that one was restored or removed)
    runner = tiny.unittest.test_runner.model_copy(update={"pythonpath": ["tests"]})
    instance = tiny.unittest.model_copy(
        update={"test_runner": runner, "FAIL_TO_PASS": ["test_x (admin_views.tests.T.test_x)"], "PASS_TO_PASS": []}
    )
    assert {"admin_views/tests.py", "tests/admin_views/tests.py"} <= set(swe_script.test_files(instance))


def test_the_pytest_runner_names_each_skip_and_each_test_that_never_ran(tmp_path: Path) -> None:
    # `-rA` names no skipped test, and a test of a module skipped at collection has no report at all (pytest then
    # runs nothing: it finds no collector for the test asked for): a PASSED line the code under test printed (here,
    # when imported) stood for each
    forged = 'print("PASSED test_m.py::test_m")\nprint("PASSED test_s.py::test_s")\n'
    (tmp_path / "test_m.py").write_text(forged + "import pytest\npytest.skip('x', allow_module_level=True)\n")
    (tmp_path / "test_s.py").write_text(forged + "import pytest\n\n\ndef test_s():\n    pytest.skip('y')\n")
    (tmp_path / "test_p.py").write_text("def test_p():\n    pass\n")

    def statuses(*tests: str) -> dict[str, TestStatus | None]:
        argv = [sys.executable, "-P", "-c", PYTEST_RUNNER, "-rA", "-s", "-p", "no:cacheprovider", *tests]
        out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        parsed = parse_pytest(out.stdout)
        return {t: parsed.get(t) for t in tests}

    ran = statuses("test_s.py::test_s", "test_p.py::test_p")
    assert ran == {"test_s.py::test_s": TestStatus.SKIPPED, "test_p.py::test_p": TestStatus.PASSED}
    never = statuses("test_m.py::test_m", "test_p.py::test_p")
    assert never == {"test_m.py::test_m": TestStatus.SKIPPED, "test_p.py::test_p": TestStatus.SKIPPED}
    # a repository whose tests have a pytest.ini of their own: the rootdir is their folder, and the ids a report
    # gives are relative to it, not to the command line's; every test was named a skip, and gold resolved nothing
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "tests" / "test_n.py").write_text(
        "import pytest\n\n\ndef test_n():\n    pass\n\n\ndef test_k():\n    pytest.skip('z')\n"
    )
    nested = statuses("tests/test_n.py::test_n", "tests/test_n.py::test_k")
    assert nested == {"tests/test_n.py::test_n": TestStatus.PASSED, "tests/test_n.py::test_k": TestStatus.SKIPPED}


def test_pytests_configuration_is_the_harnesss_at_any_depth() -> None:
    # pytest takes its ini file from the tests' common folder first: a tests/pytest.ini that the patch added stood in
    # for the project's options (its filterwarnings = error, its strictness), which were put back at the root only
    paths = [
        "pytest.ini",
        "tests/pytest.ini",
        "tests/unit/.pytest.ini",
        "pkg/tox.ini",
        "tests/setup.cfg",
        "tests/pyproject.toml",
        "tests/conftest.py",
        "src/lib.pth",
        "src/pytest_ini.py",
        "docs/setup.cfg.txt",
        "tests/test_tox.ini.py",
    ]
    picked = subprocess.run(
        ["grep", "-E", HARNESS_FILES], input="\n".join(paths) + "\n", capture_output=True, text=True, check=False
    ).stdout.split()
    assert picked == paths[:8]


# the fix, made where the grader does not look: the test package's __init__.py, which every test module imports
# first, patches the module under test (a mixin of the test methods there, cachetools', could pass them all alike)
FIX_IN_TESTS = "import calc\n\n\ndef _clamp(x, lo, hi):\n    return min(max(x, lo), hi)\n\n\ncalc.clamp = _clamp\n"
# the forged report, then a flood past the grader's cap: pytest's own summary, after it, was cut off
FLOOD = """

_flooded = []


def _flood():
    if not _flooded:
        _flooded.append(1)
        import sys
        sys.stdout.write("{forged}" + "." * ({cap} + (1 << 20)) + "\\n")
"""


async def test_a_patch_cannot_pass_its_tests_from_their_folder_or_by_flooding_the_report(
    tiny: Tiny,  # noqa: F811
    backend: DockerBackend,
    docker_client: docker.DockerClient,
    tmp_path: Path,
) -> None:
    # only the listed test files went back to base_commit: a fix in tests/__init__.py resolved the instance with its
    # bug intact; and the log was graded as cut at 8 MiB, so forged PASSED lines above a flood outranked nothing
    py, ut = tiny.pytest.instance_id, tiny.unittest.instance_id
    listed = [*tiny.pytest.FAIL_TO_PASS, *tiny.pytest.PASS_TO_PASS]
    forged = "".join(f"PASSED {t}\\n" for t in listed) + "FAILED zz.py::x\\n"
    flooding = tiny.bad.replace("    if x > lo:", "    _flood()\n    if x > lo:") + FLOOD.format(
        forged=forged, cap=swe_script.MAX_TEST_OUTPUT
    )
    in_tests = file_diff("tests/__init__.py", "", FIX_IN_TESTS)
    preds = [
        pred(py, "fix-in-tests", in_tests),
        pred(ut, "fix-in-tests", in_tests),
        pred(
            py,
            "helper-in-tests",
            _new_file("tests/helper.py", FIX_IN_TESTS) + file_diff("tests/__init__.py", "", "from . import helper\n"),
        ),
        pred(py, "flood", file_diff("calc.py", tiny.bad, flooding)),
        pred(py, "gold", tiny.pytest.patch),
    ]
    summary = await run_evaluation(
        [tiny.pytest, tiny.unittest], preds, run_id="r", backend=backend, client=docker_client, log_dir=tmp_path
    )
    assert summary["error_instances"] == 0, summary["errors"]
    run = tmp_path / "r"
    for model, iid in (("fix-in-tests", py), ("fix-in-tests", ut), ("helper-in-tests", py)):
        body = report(run, model, iid)
        assert body["patch_successfully_applied"] and not body["resolved"], (model, iid, body)
        assert body["tests_status"]["FAIL_TO_PASS"]["success"] == [], (model, iid, body)
    flood = report(run, "flood", py)
    assert flood["patch_successfully_applied"] and not flood["resolved"], flood
    log = (run / "flood" / py / "test_output.txt").read_text()
    assert ">>>>> Test Output Cut" in log.splitlines() and "short test summary info" not in log
    assert report(run, "gold", py)["resolved"]  # the test folder put back takes nothing from a real fix


def test_the_test_folders_put_back_are_the_tests_own(tiny: Tiny) -> None:  # noqa: F811
    # the outermost folder named like tests was `numpy/testing`, numpy.testing's own source: a fix there was put back
    # before the tests; the innermost missed tests/__init__.py above tests/test_cache/ (cachetools' mixin, one deeper)
    listed = [
        "tests/test_cache/test_a.py::test_x",
        "toolz/tests/test_b.py::test_y",
        "numpy/testing/tests/test_utils.py::test_z",
        "pkg/testing/test_c.py::test_v",  # no tests folder: the innermost named like one
        "test_root.py::test_w",  # beside the code: put back alone
    ]
    instance = tiny.pytest.model_copy(update={"FAIL_TO_PASS": listed, "PASS_TO_PASS": [], "test_patch": ""})
    assert swe_script.test_trees(instance) == ["numpy/testing/tests", "pkg/testing", "tests", "toolz/tests"]


def test_a_file_the_patch_made_ignored_in_a_test_folder_is_removed(
    tiny: Tiny,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `git clean` leaves ignored files: a patch whose .gitignore ignores tests/helpers/ planted a package there that
    # the tests imported in place of the tracked tests/helpers.py (a package comes before a module). The eval script
    # runs here on the host (bash, git, this pytest), in folders of the test's own
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    files = {
        "calc.py": "def ok():\n    return False\n",
        "tests/__init__.py": "",
        "tests/helpers.py": "from calc import ok\n",
        "tests/test_calc.py": "from tests.helpers import ok\n\n\ndef test_ok():\n    assert ok()\n",
        # the pristine tree's own ignored file in a test folder (built in place) stays
        ".gitignore": "tests/built.txt\n",
    }
    for name, text in files.items():
        (repo / name).write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "base"], check=True)
    (repo / "tests" / "built.txt").write_text("built")
    base = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    planted = file_diff(".gitignore", files[".gitignore"], files[".gitignore"] + "tests/helpers/\n") + _new_file(
        "tests/helpers/__init__.py", "def ok():\n    return True"
    )
    instance = tiny.pytest.model_copy(
        update={
            "base_commit": base,
            "FAIL_TO_PASS": ["tests/test_calc.py::test_ok"],
            "PASS_TO_PASS": [],
            "test_patch": "",
        }
    )
    scratch = tmp_path / "scratch"
    monkeypatch.setattr(swe_script, "SCRATCH", str(scratch))
    bundle = swe_script.make_bundle(instance, planted, nonce="n0", repo_dir=str(repo), work_dir=str(tmp_path / "work"))
    scratch.mkdir()
    for name, data in bundle.files.items():
        (scratch / name).write_bytes(data)
    out = subprocess.run(["bash", str(scratch / "eval.sh")], capture_output=True, text=True, timeout=120)
    grade = grade_log(
        instance.instance_id,
        out.stdout,
        framework="pytest",
        fail_to_pass=instance.FAIL_TO_PASS,
        pass_to_pass=[],
        model_patch=planted,
        nonce="n0",
        gold={},
    )
    assert grade.patch_successfully_applied and not grade.resolved, out.stdout[-3000:]
    assert grade.statuses.get("tests/test_calc.py::test_ok") == TestStatus.FAILED, out.stdout[-3000:]
    work = tmp_path / "work" / "tests"
    assert (work / "built.txt").exists() and not (work / "helpers" / "__init__.py").exists()


async def test_a_fix_that_breaks_the_rest_of_its_file_resolves_nothing(tmp_path: Path, base_image: str) -> None:
    # PASS_TO_PASS was a sample of 10 of the tests the fix's files hold: a policy that fixed the failing inputs and
    # broke another function the sample left out was paid 1. It is every test of those files that passed (SWE-bench's)
    registry, env = swe_registry()
    task = next(t for t in env.tasks() if t.id == "pypi__toolz-1.2.0-11336fb2")  # peek, in toolz/itertoolz.py
    assert "toolz/tests/test_itertoolz.py::test_take" in env.instance(task).PASS_TO_PASS  # the old sample had not
    fixed = reference_script(env, [task]).tasks[task.id]
    broken_take = "\ndef take(n, seq):\n    return iter(())\n"  # appended: the module's take from then on
    cmd = f"printf %s {shlex.quote(broken_take)} >> /workspace/toolz/itertoolz.py"
    steps = [Step(tool_calls=[ScriptedToolCall(name="bash", arguments={"command": cmd})]), *fixed]
    async with serve(tmp_path, registry) as orch, EnvfleetClient(orch.address) as client:
        got = await _run(client, "swe", Script(tasks={task.id: steps}))
        clean = await _run(client, "swe", Script(tasks={task.id: fixed}))
    assert (got[task.id].status, got[task.id].reward) == (RolloutStatus.OK, 0.0), got[task.id].error
    assert (clean[task.id].status, clean[task.id].reward) == (RolloutStatus.OK, 1.0), clean[task.id].error
