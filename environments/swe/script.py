"""The evaluation script that runs inside a sandbox, and the bundle (one tar) that carries it there.

One exec does everything: unpack the bundle (patches, script, runner) from stdin into a scratch folder, copy the
pristine repository into a fresh work folder, apply the model patch (git apply, then git apply --reject, then
patch --fuzz, resetting the tree between tries), put the test files back to base_commit, apply the test patch, run
the named tests under a timeout with their output fenced by nonce-carrying sentinel lines, and print the exit code.
"""

from __future__ import annotations

import io
import shlex
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass

from environments.swe.grading import (
    APPLY_PATCH_FAIL,
    APPLY_PATCH_PASS,
    EMPTY_PATCH,
    END_TEST_OUTPUT,
    PATCHED_SETUP_FAILED,
    RESET_FAILED,
    START_TEST_OUTPUT,
    TEST_EXIT_CODE,
    TEST_OUTPUT_CUT,
    TEST_PATCH_FAIL,
    TESTS_STARTED,
    TESTS_TIMEOUT,
    unittest_id,
)
from environments.swe.instance import SweInstance

SCRATCH = "/tmp/swe"
# files that are the test harness's, not the code's (an extended regular expression over repository paths). pytest's
# configuration at any depth: pytest takes its ini file from the tests' common folder first, so a tests/pytest.ini of
# the patch's stood in for the project's own options (its filterwarnings = error, its strictness), which came back
# at the root only
_HARNESS_NAMES = r"(^|/)(conftest|sitecustomize|usercustomize)\.py$|\.pth$"
_HARNESS_CONFIG = r"(^|/)(pytest\.ini|\.pytest\.ini|tox\.ini|setup\.cfg|pyproject\.toml)$"
HARNESS_FILES = f"{_HARNESS_NAMES}|{_HARNESS_CONFIG}"
MAX_TEST_OUTPUT = 8 << 20
MAX_TOOL_ECHO = 64 << 10  # of what git apply or patch prints of the patch (its file names), each run
PRE_TEST_OUTPUT = 8 << 20  # the host keeps this much of the script's output past the tests' own
# Deterministic and closed: fixed time zone, hash seed and locale; no user site, no git config from $HOME.
EVAL_ENV: dict[str, str] = {
    "TZ": "UTC",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONNOUSERSITE": "1",
    "LC_ALL": "C.UTF-8",
    "HOME": "/tmp",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}

# The test runner is the image's, never a file of the repository. The runners start with `python3 -P` (no cwd or
# script folder on sys.path) and without PYTHONPATH (its folders are in REPO_PATH_VAR), so a pytest.py, pluggy.py,
# _pytest/ or unittest.py that a patch adds is not what runs. The repository joins the front of sys.path, where
# `python -m` put the cwd, only when the tests are about to load: for unittest after its argument parser (argparse
# imports shutil then), for pytest after its plugins (a .dist-info folder in the repository declared an entry-point
# plugin) and before the conftest files, with pdb, which pytest imports later, imported first. Past that point the
# image's pytest 7.2 and unittest import nothing a file of the repository could stand in for.
# Accepted risk: the code under test runs in the process that reports the results. Imported by a test, it can
# rewrite the test functions, pytest's hooks or the report, or print passing lines and exit 0, and no channel of
# that process (an fd, a file, a nonce) is out of its reach; pytest's own exit path proves nothing either. Closing
# that needs the tests to run in a process the code under test cannot speak for, which pytest does not offer.
REPO_PATH_VAR = "ENVFLEET_SWE_PYTHONPATH"
_REPO_PATHS = f"""\
# the repository's folders: the cwd, then the instance's pythonpath (which the tests' subprocesses inherit)
extra = [p for p in os.environ.pop("{REPO_PATH_VAR}", "").split(":") if p]
if extra:
    os.environ["PYTHONPATH"] = ":".join(extra)
paths = [os.getcwd(), *extra]
"""
UNITTEST_RUNNER = f"""\
import os, sys, unittest
# one line per test: a docstring would otherwise push the result onto a second line
unittest.TestCase.shortDescription = lambda self: None
{_REPO_PATHS}if not sys.flags.safe_path:  # started without -P (the dataset builder): sys.path[0] is this folder
    del sys.path[0]


class Result(unittest.TextTestResult):
    # A test's line is written whole, in one write on a line of its own, once its outcome is known; not its name
    # before it runs: the code under test wrote "ok" after the name (to sys.__stderr__, past -b) and then skipped,
    # and the real "skipped" went on a line of its own that named no test (or it left a line open for ours to join).
    started = set()

    def startTest(self, test):
        unittest.TestResult.startTest(self, test)
        Result.started.add(test.id())

    def _write_status(self, test, status):
        indent = "  " if isinstance(test, unittest.case._SubTest) else ""
        self.stream.write("\\n" + indent + self.getDescription(test) + " ... " + status + "\\n")
        self.stream.flush()

    def addExpectedFailure(self, test, err):
        unittest.TestResult.addExpectedFailure(self, test, err)
        self._write_status(test, "expected failure")

    def addUnexpectedSuccess(self, test):
        unittest.TestResult.addUnexpectedSuccess(self, test)
        self._write_status(test, "unexpected success")


def tests_in(suite):
    for test in suite:
        if isinstance(test, unittest.TestSuite):
            yield from tests_in(test)
        else:
            yield test


def impostor(test_id):
    # where the test's module came from when that is not its source file: a package folder or an extension module of
    # its name comes before the .py in Python's import, so a copy of the test file the patch added as
    # tests/test_x/__init__.py ran in place of the tests/test_x.py the grader had put back
    module = test_id.rsplit(".", 2)[0]
    loaded = getattr(sys.modules.get(module), "__file__", None)
    if loaded is None:
        return None  # not imported: unittest reports the test as an error itself
    sources = {{os.path.realpath(os.path.join(p, *module.split("."))) + ".py" for p in paths}}
    return None if os.path.realpath(loaded) in sources else loaded


class Program(unittest.TestProgram):
    def createTests(self, *args, **kwargs):
        sys.path[:0] = paths
        super().createTests(*args, **kwargs)
        refused = {{t: impostor(t) for t in sys.argv[1:]}}
        refused = {{t: where for t, where in refused.items() if where}}
        if refused:
            for test_id, where in refused.items():
                Result.started.add(test_id)
                sys.stderr.write(
                    "\\n" + test_id.rpartition(".")[2] + " (" + test_id + ") ... ERROR\\n"
                    + "  its module was loaded from " + where + ", not from its source file\\n"
                )
            self.test = unittest.TestSuite(t for t in tests_in(self.test) if t.id() not in refused)


runner = unittest.TextTestRunner(resultclass=Result, verbosity=2, buffer=True)
program = Program(module=None, argv=["python -m unittest", "-v", "-b", *sys.argv[1:]], testRunner=runner, exit=False)
# a test asked for that never started (its class or module skipped in setUpClass, or not found) is named too: else a
# passing line the code printed for it stood alone
for test_id in sys.argv[1:]:
    if test_id not in Result.started:
        runner.stream.write("\\n" + test_id.rpartition(".")[2] + " (" + test_id + ") ... skipped 'not run'\\n")
runner.stream.flush()
sys.exit(not program.result.wasSuccessful())
"""
PYTEST_RUNNER = f"""\
import os, sys
import pytest
import getpass, pdb  # what pytest itself imports after the repository joins sys.path (tmp_path's user, debugging)
{_REPO_PATHS}

class Repository:
    skipped = []
    reported = set()
    config = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_load_initial_conftests(self):
        sys.path[:0] = paths

    def pytest_configure(self, config):
        self.config = config

    # `-rA` lists a skip as `SKIPPED [1] file:line: reason`, naming no test: a test that skipped had no status of
    # its own, and a passing line the code under test printed for it stood alone. Each skip is named here, and so
    # is each test asked for that never ran (its module skipped at collection, or not found); by the cwd-relative id
    # `-rA` and the command line use (a report's is relative to the rootdir, a tests/pytest.ini's folder)
    def pytest_runtest_logreport(self, report):
        nodeid, root, cwd = report.nodeid, str(self.config.rootpath), str(self.config.invocation_params.dir)
        if root != cwd:  # as pytest's own Config.cwd_relative_nodeid (7.2) makes it
            nodeid = os.path.relpath(os.path.join(root, nodeid), cwd)
        self.reported.add(nodeid)
        if report.skipped and not hasattr(report, "wasxfail"):
            self.skipped.append(nodeid)

    def pytest_terminal_summary(self, terminalreporter):
        asked = [arg for arg in sys.argv[1:] if "::" in arg]
        for nodeid in [*self.skipped, *(a for a in asked if a not in self.reported)]:
            terminalreporter.write_line(f"SKIPPED {{nodeid}}")


sys.exit(pytest.main(sys.argv[1:], plugins=[Repository()]))
"""

BOOTSTRAP = f"rm -rf {SCRATCH} && mkdir -p {SCRATCH} && tar -x -C {SCRATCH} && exec bash {SCRATCH}/eval.sh"


def test_command(instance: SweInstance) -> list[str]:
    """The argv that runs the instance's named tests (the runners take the repository's folders from
    REPO_PATH_VAR)."""
    if instance.test_runner.framework == "pytest":
        return [
            "python3",
            "-P",
            "-c",
            PYTEST_RUNNER,
            "-rA",
            "--tb=short",
            "-p",
            "no:cacheprovider",
            "--confcutdir=.",
            *instance.tests,
        ]
    return ["python3", "-P", f"{SCRATCH}/unittest_runner.py", *(unittest_id(t) for t in instance.tests)]


def test_files(instance: SweInstance) -> list[str]:
    """Files that hold the instance's tests or that the test patch touches; they are put back to base_commit
    before the test patch applies, so a model patch cannot edit the tests it is graded by."""
    files: set[str] = set()
    for name in instance.tests:
        if instance.test_runner.framework == "pytest":
            files.add(name.split("::", 1)[0])
        else:
            module = unittest_id(name).rsplit(".", 2)[0].replace(".", "/") + ".py"
            # every folder the runner imports from, the cwd first: a copy the patch added at the root stood in for
            # the one the grader put back under a pythonpath folder
            roots = dict.fromkeys([".", *instance.test_runner.pythonpath])
            files.update(module if r == "." else f"{r}/{module}" for r in roots)
    for line in instance.test_patch.splitlines():
        if line.startswith(("--- a/", "+++ b/")):
            files.add(line[6:].split("\t")[0])
    return sorted(f for f in files if f and not f.startswith("/") and ".." not in f.split("/"))


def _test_ish(folder: str) -> bool:
    return folder in ("test", "tests", "testing") or folder.startswith(("test_", "tests_"))


def _test_tree(parts: list[str]) -> str:
    """A test file's folder to put back whole: the outermost one named `test` or `tests` on its path (a mixin in
    `tests/__init__.py` serves `tests/test_cache/test_lru.py` too), else the innermost named like tests (`testing`,
    `test_*`: never a `testing` package of the code's above a `tests` folder, numpy's); "" for none."""
    exact = [i for i, p in enumerate(parts) if p in ("test", "tests")]
    if exact:
        return "/".join(parts[: exact[0] + 1])
    like = [i for i, p in enumerate(parts) if _test_ish(p)]
    return "/".join(parts[: like[-1] + 1]) if like else ""


def test_trees(instance: SweInstance) -> list[str]:
    """The test folders the instance's tests live in (_test_tree: `tests`, `toolz/tests`, `numpy/testing/tests`):
    put back whole to base_commit, what the patch added there removed. The test files alone were not enough:
    cachetools' test methods are a mixin in tests/__init__.py, which every test module imports, and a patch that made
    them all pass there resolved the instance with its bug intact. A test file outside any such folder (at the root,
    beside the code) is put back alone."""
    trees = {_test_tree(f.split("/")[:-1]) for f in test_files(instance)} - {""}
    return sorted(t for t in trees if not any(t.startswith(f"{o}/") for o in trees))


def eval_script(instance: SweInstance, *, nonce: str, repo_dir: str, work_dir: str, timeout_s: float) -> str:
    """The bash script. It always exits 0 once it has started: what happened is in its output (the markers)."""
    q = shlex.quote
    pythonpath = ":".join(
        f"{work_dir}/{p}".rstrip("/.") if p != "." else work_dir for p in instance.test_runner.pythonpath
    )
    env = " ".join(f"{k}={q(v)}" for k, v in EVAL_ENV.items())
    files = " ".join(q(f) for f in test_files(instance))
    trees = " ".join(q(t) for t in test_trees(instance))
    # ignored files the pristine tree has in them (a module built in place beside its tests) are kept: listed
    # before the patch, as the ignore rules were then
    ignored = f"git ls-files -z -o -i --exclude-standard -- {trees} | sort -z"
    trees_listed = f'{ignored} > "$S/ignored.before"' if trees else ""
    trees_reset = (
        f"""in_tree=$(git ls-tree -r --name-only "$BASE" -- {trees})
if [ -n "$in_tree" ]; then
  printf '%s\\n' "$in_tree" | git checkout -q "$BASE" --pathspec-from-file=- || fail_patched "test folders"
fi
git clean -fdq -- {trees} || fail_patched "test folders"
{ignored} | comm -z -13 "$S/ignored.before" - \\
  | xargs -0 -r rm -f -- || fail_patched "test folders"
"""
        if trees
        else ""
    )
    return f"""#!/bin/bash
set -uo pipefail
export {env}
unset PYTHONPATH PYTHONSTARTUP PYTEST_ADDOPTS PYTEST_PLUGINS
S={SCRATCH}
W={q(work_dir)}
BASE={instance.base_commit}
fail_reset() {{ echo "{RESET_FAILED}: $1"; exit 0; }}
# past the patch, a step that fails may be the patch's doing (a tree it filled the disk with): graded, not reset
fail_patched() {{ echo "{PATCHED_SETUP_FAILED}: $1"; exit 0; }}
reset_tree() {{ git reset -q --hard "$BASE" && git clean -fdq; }}
# what the tools print of the patch (its lines, the files it names) is indented: a line of the agent's, echoed by
# git apply or patch, is never a marker of this script's (">>>>> Reset Failed" made a 0 an infrastructure failure)
# and kept to its first {MAX_TOOL_ECHO} bytes (the rest read and dropped, so the tool never sees a broken pipe): a patch
# of thousands of long paths made git apply print megabytes before the tests' start marker, past what the host keeps
# of the output, and a run held past its time by the code under test then read as the script's own failure
quoted() {{ {{ head -c {MAX_TOOL_ECHO}; echo; }} | sed '/^$/d; s/^/  | /'; cat > /dev/null; }}  # a line cut: ended
if [ {q(repo_dir)} != "$W" ]; then  # else the caller has just put a fresh copy there
  mkdir -p "$W" || fail_reset "cannot create $W"
  find "$W" -mindepth 1 -delete 2>/dev/null || fail_reset "cannot empty $W"
  cp -a {q(repo_dir)}/. "$W"/ || fail_reset "cannot copy {repo_dir}"
fi
cd "$W" || fail_reset "cannot enter $W"
head=$(git rev-parse HEAD 2>&1) || fail_reset "not a git repository: $head"
[ "$head" = "$BASE" ] || fail_reset "HEAD is $head, expected $BASE"
{trees_listed}
if [ -s "$S/model.patch" ]; then
  method=""
  if git apply --verbose "$S/model.patch" 2>&1 | quoted; then method="git apply"
  else
    reset_tree
    if git apply --verbose --reject "$S/model.patch" 2>&1 | quoted; then method="git apply --reject"
    else
      reset_tree
      if patch --batch --fuzz=5 -p1 --no-backup-if-mismatch -i "$S/model.patch" 2>&1 | quoted; then
        method="patch --fuzz"
      fi
    fi
  fi
  [ -n "$method" ] || {{ reset_tree; echo "{APPLY_PATCH_FAIL}"; exit 0; }}
  echo "{APPLY_PATCH_PASS} ($method)"
else
  echo "{EMPTY_PATCH}"
fi
# the test files go back to base_commit (in one git call); test files the patch added are removed
tracked=$(git ls-tree -r --name-only "$BASE" -- {files})
if [ -n "$tracked" ]; then
  printf '%s\n' "$tracked" | git checkout -q "$BASE" --pathspec-from-file=- || fail_patched "test files"
fi
for f in {files}; do
  case $'\n'"$tracked"$'\n' in *$'\n'"$f"$'\n'*) ;; *) rm -f -- "$f" ;; esac
done
# and the test folders whole: their __init__.py (a mixin of the test methods), helpers and data files; the files the
# patch added there go, those it made ignored too (a .gitignore of its own let a tests/helpers/__init__.py stand in
# for helpers.py), but the ignored ones the tree had before
{trees_reset}# so do the harness's own files, and those the patch added go: a conftest.py, pytest's configuration, a
# sitecustomize.py or a .pth file is code or options that pytest and python take for the grader's (a conftest.py
# hook could report every test passed)
harness=$(git ls-tree -r --name-only "$BASE" | grep -E {q(HARNESS_FILES)})
if [ -n "$harness" ]; then
  printf '%s\n' "$harness" | git checkout -q "$BASE" --pathspec-from-file=- || fail_patched "harness files"
fi
git ls-files --others | grep -E {q(HARNESS_FILES)} | while IFS= read -r f; do rm -f -- "$f"; done
# and the tree's compiled files: a .pyc the patch added to a __pycache__ (a .gitignore of its own lets it into the
# diff), compiled unchecked from a passing copy of a test file, was what Python ran in place of the file put back
# (the image's own, outside the tree, stay: compiled anew each run, pytest's imports took four times as long)
# (links too: one named .pyc led to bytecode kept under another name)
find . -path ./.git -prune -o "(" -name '*.py[co]' -o -name __pycache__ ")" ! -type d -exec rm -f -- {{}} + \\
  || fail_patched "compiled files"
if [ -s "$S/test.patch" ]; then
  git apply --verbose "$S/test.patch" 2>&1 | quoted || {{ echo "{TEST_PATCH_FAIL}"; exit 0; }}
fi
# the runner puts these on sys.path (and in PYTHONPATH for the tests' subprocesses) once it is imported itself
export {REPO_PATH_VAR}={q(pythonpath)}
echo "{TESTS_STARTED} {nonce}"
timeout -k 5 {timeout_s:g} {shlex.join(test_command(instance))} > "$S/tests.log" 2>&1 < /dev/null
rc=$?
echo "{START_TEST_OUTPUT} {nonce}"
head -c {MAX_TEST_OUTPUT} "$S/tests.log"
echo
echo "{END_TEST_OUTPUT} {nonce}"
echo "{TEST_EXIT_CODE}: $rc"
# what the cut left out may be the real report (a run that printed forged PASSED lines and then past the cap)
[ "$(stat -c %s "$S/tests.log")" -le {MAX_TEST_OUTPUT} ] || echo "{TEST_OUTPUT_CUT}"
[ "$rc" -ne 124 ] && [ "$rc" -ne 137 ] || echo "{TESTS_TIMEOUT}"
exit 0
"""


@dataclass(frozen=True)
class Bundle:
    """The files an evaluation carries into the sandbox."""

    files: Mapping[str, bytes]

    def tar(self) -> bytes:
        """An uncompressed tar of the files (what BOOTSTRAP unpacks from stdin)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in sorted(self.files.items()):
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()


def make_bundle(
    instance: SweInstance,
    model_patch: str | bytes | None,
    *,
    nonce: str,
    repo_dir: str = "/opt/repo",
    work_dir: str = "/workspace",
    timeout_s: float | None = None,
) -> Bundle:
    """The evaluation bundle of one instance and one model patch."""
    script = eval_script(
        instance,
        nonce=nonce,
        repo_dir=repo_dir,
        work_dir=work_dir,
        timeout_s=timeout_s if timeout_s is not None else instance.test_runner.timeout_s,
    )
    return Bundle(
        {
            "eval.sh": script.encode(),
            # as git wrote it: a diff of a file that is not UTF-8 decoded and encoded again no longer applies
            "model.patch": model_patch if isinstance(model_patch, bytes) else (model_patch or "").encode(),
            "test.patch": instance.test_patch.encode(),
            "unittest_runner.py": UNITTEST_RUNNER.encode(),
        }
    )
