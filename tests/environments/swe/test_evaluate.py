"""The harness on real sandboxes, on the tiny instances: gold resolves, empty does not, a patch that breaks a
PASS_TO_PASS test is NO, a patch that does not apply is reported, patch --fuzz is recorded, resume skips."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import docker
import pytest

from environments.swe.evaluate import run_evaluation
from environments.swe.instance import Prediction, dump_jsonl
from environments.swe.patches import file_diff
from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.cli.main import main
from tests.conftest import TEST_OWNER
from tests.environments.swe.conftest import Tiny


def pred(iid: str, model: str, patch: str | None) -> Prediction:
    return Prediction(instance_id=iid, model_name_or_path=model, model_patch=patch)


def report(run: Path, model: str, iid: str) -> dict[str, Any]:
    body: dict[str, Any] = json.loads((run / model / iid / "report.json").read_text())[iid]
    return body


async def test_outcomes(tiny: Tiny, backend: DockerBackend, docker_client: docker.DockerClient, tmp_path: Path) -> None:
    py, ut = tiny.pytest.instance_id, tiny.unittest.instance_id
    gold = tiny.pytest.patch
    moved = tiny.bad.replace('"""x, kept within [lo, hi]."""', '"""x, clamped."""')
    preds = [
        pred(py, "gold", gold),
        pred(ut, "gold", gold),
        pred(py, "empty", ""),
        pred(py, "none", None),
        pred(py, "breaks", file_diff("calc.py", tiny.bad, tiny.good.replace("a + b", "a - b"))),
        pred(py, "stale", file_diff("calc.py", "x = 1\n", "x = 2\n")),
        pred(py, "fuzzy", file_diff("calc.py", moved, moved.replace("if x > lo:", "if x < lo:"))),
        pred(py, "prose", "Change the comparison in clamp.\n"),
        pred(py, "cheat", file_diff("tests/test_calc.py", _t(), _t(True))),
        pred(py, "hook", _new_file("conftest.py", HOOK)),
        pred(py, "forged", file_diff("calc.py", tiny.bad, tiny.bad + _forger(tiny.pytest.FAIL_TO_PASS))),
    ]
    seen: list[tuple[str, str]] = []
    summary = await run_evaluation(
        [tiny.pytest, tiny.unittest],
        preds,
        run_id="r1",
        backend=backend,
        client=docker_client,
        workers=2,
        log_dir=tmp_path,
        progress=lambda iid, outcome: seen.append((iid, outcome)),
    )
    run = tmp_path / "r1"
    assert summary["error_instances"] == 0, summary["errors"]
    assert summary["submitted_instances"] == len(preds) == len(seen)

    for model, iid in (("gold", py), ("gold", ut)):
        body = report(run, model, iid)
        assert body["resolved"] and body["apply_method"] == "git apply", body
        assert body["tests_status"]["FAIL_TO_PASS"]["failure"] == []

    empty = report(run, "empty", py)
    assert not empty["resolved"] and not empty["patch_exists"]
    assert sorted(empty["tests_status"]["FAIL_TO_PASS"]["failure"]) == sorted(tiny.pytest.FAIL_TO_PASS)
    assert report(run, "none", py)["patch_is_None"]

    breaks = report(run, "breaks", py)
    assert breaks["resolution"] == "RESOLVED_NO" and not breaks["resolved"]
    assert breaks["tests_status"]["FAIL_TO_PASS"]["failure"] == []
    assert breaks["tests_status"]["PASS_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]

    stale = report(run, "stale", py)
    assert not stale["patch_successfully_applied"] and not stale["resolved"] and stale["apply_method"] is None
    assert "did not apply" in stale["error"]

    fuzzy = report(run, "fuzzy", py)
    assert fuzzy["apply_method"] == "patch --fuzz" and fuzzy["resolved"], fuzzy

    prose = report(run, "prose", py)
    assert "malformed patch" in prose["error"] and "not a unified diff" in prose["error"]
    assert not (run / "prose" / py / "test_output.txt").read_text().count("Start Test Output")

    # editing the tests it is graded by gets a patch nowhere: the test files are put back first
    assert not report(run, "cheat", py)["resolved"]
    # nor does a conftest.py of its own (the harness's files go back too), or code that prints a passing line for
    # each failing test at exit (a test keeps its worst status)
    assert not report(run, "hook", py)["resolved"]
    forged = report(run, "forged", py)
    assert not forged["resolved"] and forged["tests_status"]["FAIL_TO_PASS"]["failure"], forged

    for f in ("patch.diff", "eval.sh", "test_output.txt", "run_instance.log", "report.json"):
        assert (run / "gold" / py / f).is_file()
    assert summary["resolved_ids"] == sorted([py, ut, py])
    assert json.loads((run / "summary.json").read_text())["resolved_instances"] == 3


HOOK = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    outcome.get_result().outcome = "passed"
"""


def _new_file(path: str, text: str) -> str:
    lines = text.splitlines()
    head = (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{len(lines)} @@\n"
    )
    return head + "".join(f"+{line}\n" for line in lines)


def _forger(tests: list[str]) -> str:
    lines = "".join(f"PASSED {t}\\n" for t in tests) + "FAILED zz.py::x\\n"
    return f"\n\nimport atexit, sys\natexit.register(lambda: (sys.stdout.write('{lines}'), sys.stdout.flush()))\n"


def _t(fixed: bool = False) -> str:
    from tests.environments.swe.conftest import TESTS

    return TESTS.replace("== 0", "== -5").replace("== 10", "== 0") if fixed else TESTS


async def test_resume_skips_finished_instances(
    tiny: Tiny, backend: DockerBackend, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    preds = [pred(tiny.pytest.instance_id, "gold", tiny.pytest.patch)]
    first = await run_evaluation(
        [tiny.pytest], preds, run_id="r", backend=backend, client=docker_client, log_dir=tmp_path
    )
    report_file = tmp_path / "r" / "gold" / tiny.pytest.instance_id / "report.json"
    stamp = report_file.stat().st_mtime_ns
    both = [*preds, pred(tiny.unittest.instance_id, "gold", tiny.pytest.patch)]
    outcomes: dict[str, str] = {}
    second = await run_evaluation(
        [tiny.pytest, tiny.unittest],
        both,
        run_id="r",
        backend=backend,
        client=docker_client,
        log_dir=tmp_path,
        progress=lambda iid, o: outcomes.__setitem__(iid, o),
    )
    assert first["resolved_instances"] == 1
    assert outcomes == {tiny.pytest.instance_id: "skipped", tiny.unittest.instance_id: "resolved"}
    assert second["skipped_ids"] == [tiny.pytest.instance_id] and second["resolved_instances"] == 2
    assert report_file.stat().st_mtime_ns == stamp


def test_cli(tiny: Tiny, base_image: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dataset = tmp_path / "instances.jsonl"
    dump_jsonl([tiny.pytest, tiny.unittest], dataset)
    preds = tmp_path / "preds.jsonl"
    dump_jsonl([pred(i.instance_id, "gold", i.patch) for i in (tiny.pytest, tiny.unittest)], preds)
    args = ["swe-eval", "--dataset", str(dataset), "--predictions", str(preds), "--run-id", "cli"]
    args += ["--workers", "2", "--log-dir", str(tmp_path / "logs"), "--owner", TEST_OWNER]
    with pytest.raises(SystemExit) as done:
        main(args)
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    assert "resolved 100%" in out
    assert (tmp_path / "logs" / "cli" / "summary.json").is_file()

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"instance_id": "nope", "model_name_or_path": "m", "model_patch": ""}) + "\n")
    with pytest.raises(SystemExit) as failed:
        main(["swe-eval", "--dataset", str(dataset), "--predictions", str(bad), "--run-id", "x", "--owner", TEST_OWNER])
    assert failed.value.code == 2
    assert "line 1: unknown instance 'nope'" in capsys.readouterr().out


async def test_reused_sandboxes_grade_alike(
    tiny: Tiny, backend: DockerBackend, docker_client: docker.DockerClient, tmp_path: Path
) -> None:
    """Warm sandboxes of the environment tier, reset in place between instances: the same outcomes."""
    py, ut = tiny.pytest.instance_id, tiny.unittest.instance_id
    preds = [
        pred(py, "gold", tiny.pytest.patch),
        pred(ut, "gold", tiny.pytest.patch),
        pred(py, "empty", ""),
        pred(py, "breaks", file_diff("calc.py", tiny.bad, tiny.good.replace("a + b", "a - b"))),
        pred(ut, "empty", ""),
    ]
    summary = await run_evaluation(
        [tiny.pytest, tiny.unittest],
        preds,
        run_id="pooled",
        backend=backend,
        client=docker_client,
        workers=1,
        log_dir=tmp_path,
        reuse_sandboxes=True,
    )
    assert summary["error_ids"] == [] and summary["resolved_ids"] == [py, ut]
    run = tmp_path / "pooled"
    assert report(run, "breaks", py)["tests_status"]["PASS_TO_PASS"]["failure"] == ["tests/test_calc.py::test_add"]
    empty = report(run, "empty", ut)
    assert empty["tests_status"]["FAIL_TO_PASS"]["failure"] == tiny.unittest.FAIL_TO_PASS
