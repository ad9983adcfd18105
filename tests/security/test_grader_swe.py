"""The SWE grader's test runner is the image's: a patch (or whatever an RL policy leaves in the workspace, which the
grader diffs as its patch) cannot stand in for pytest or plug itself into it with files in the repository.

Code under test still runs in the process that reports the results, so it can forge them (see
environments/swe/script.py, "accepted risk"); what is closed here is the runner itself being replaced by a file the
patch adds: such a file used to be imported in pytest's place (`python -m` puts the cwd first on sys.path) or loaded
as a pytest plugin (an entry point of a .dist-info folder in the cwd)."""

from __future__ import annotations

from pathlib import Path

import docker

from environments.swe.evaluate import run_evaluation
from orchestrator.backends.docker.backend import DockerBackend
from tests.environments.swe.conftest import Tiny, tiny  # noqa: F401  (the fixture)
from tests.environments.swe.test_evaluate import HOOK, _new_file, pred, report

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
    ):
        body = report(run, model, instance.instance_id)
        assert body["patch_successfully_applied"] and not body["resolved"], (model, body)
        failing = body["tests_status"]["FAIL_TO_PASS"]["failure"]
        assert sorted(failing) == sorted(instance.FAIL_TO_PASS), (model, body)
    # the fake module is in the tree the tests ran in, yet pytest's own output is what was graded
    output = (run / "shadow" / iid / "test_output.txt").read_text()
    assert "short test summary info" in output and "FAILED tests/test_calc.py::test_clamp_low" in output
