"""Instances and predictions: the SWE-bench fields, the extension fields, and clear errors on bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from environments.swe.instance import SweInstance, load_instances, load_predictions
from environments.swe.patches import check_patch, file_diff, patch_files
from orchestrator.core.errors import InvalidRequestError


def record(**kw: Any) -> dict[str, Any]:
    """A valid instance record (SWE-bench fields plus an sdist source)."""
    rec: dict[str, Any] = {
        "instance_id": "pypi__demo-1.0-0001",
        "repo": "pypi/demo",
        "base_commit": "a" * 40,
        "problem_statement": "it breaks",
        "patch": "diff --git a/x.py b/x.py\n",
        "test_patch": "",
        "FAIL_TO_PASS": ["tests/test_x.py::test_a"],
        "PASS_TO_PASS": ["tests/test_x.py::test_b"],
        "version": "1.0",
        "environment_setup_commit": "b" * 40,
        "source": {
            "kind": "sdist",
            "package": "demo",
            "version": "1.0",
            "filename": "demo-1.0.tar.gz",
            "sha256": "c" * 64,
        },
    }
    rec.update(kw)
    return rec


def write(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_swe_bench_json_string_lists_are_accepted() -> None:
    inst = SweInstance.model_validate(record(FAIL_TO_PASS='["a", "b"]', PASS_TO_PASS="[]"))
    assert inst.FAIL_TO_PASS == ["a", "b"] and inst.PASS_TO_PASS == [] and inst.tests == ["a", "b"]
    assert inst.test_runner.framework == "pytest" and inst.environment.requirements == ()


def test_unknown_fields_and_missing_fields_name_the_line(tmp_path: Path) -> None:
    bad = write(tmp_path / "i.jsonl", [record(), {**record(instance_id="x-2"), "extra": 1}, record(patch=None)])
    with pytest.raises(InvalidRequestError, match=r"line 2 \(x-2\): field 'extra' Extra inputs"):
        load_instances(bad)
    missing = dict(record())
    del missing["base_commit"]
    with pytest.raises(InvalidRequestError, match=r"line 1 .*field 'base_commit' is missing"):
        load_instances(write(tmp_path / "m.jsonl", [missing]))
    with pytest.raises(InvalidRequestError, match="repeats"):
        load_instances(write(tmp_path / "d.jsonl", [record(), record()]))


def test_predictions_errors(tmp_path: Path) -> None:
    insts = load_instances(write(tmp_path / "i.jsonl", [record()]))
    iid = insts[0].instance_id
    good = {"instance_id": iid, "model_name_or_path": "m", "model_patch": "", "full_output": "ignored"}
    assert load_predictions(write(tmp_path / "p.jsonl", [good]), insts)[0].model_patch == ""
    with pytest.raises(InvalidRequestError, match=r"line 1: unknown instance 'nope'"):
        load_predictions(write(tmp_path / "u.jsonl", [{**good, "instance_id": "nope"}]), insts)
    with pytest.raises(InvalidRequestError, match=r"line 1: field 'model_patch' is missing"):
        load_predictions(write(tmp_path / "f.jsonl", [{"instance_id": iid, "model_name_or_path": "m"}]), insts)
    with pytest.raises(InvalidRequestError, match="a second prediction"):
        load_predictions(write(tmp_path / "r.jsonl", [good, good]), insts)
    # SWE-bench's JSON list form works too
    (tmp_path / "p.json").write_text(json.dumps([good]))
    assert len(load_predictions(tmp_path / "p.json", insts)) == 1


def test_file_diff_and_patch_checks() -> None:
    diff = file_diff("pkg/m.py", "a\nb\nc", "a\nB\nc")
    assert diff.startswith("diff --git a/pkg/m.py b/pkg/m.py\n--- a/pkg/m.py\n+++ b/pkg/m.py\n")
    assert "\\ No newline at end of file" in diff and check_patch(diff) is None
    assert patch_files(diff) == ["pkg/m.py"]
    assert file_diff("x", "same", "same") == ""
    assert check_patch("") is None
    problem = check_patch("please fix it\n")
    assert problem is not None and problem.fatal and "not a unified diff" in problem.message
    truncated = check_patch(diff.replace("+B\n", ""))
    assert truncated is not None and not truncated.fatal and "line counts" in truncated.message
