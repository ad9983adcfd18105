"""The shipped dataset: its shape, gold predictions resolve every instance, empty predictions resolve none."""

from __future__ import annotations

import json
from collections import Counter

from environments.swe.builder.pins import load_pins
from environments.swe.instance import SdistSource, SweInstance
from tests.environments.swe.conftest import ShippedRuns


def test_dataset_shape(shipped: list[SweInstance]) -> None:
    pins = {(p.package, p.version): p for p in load_pins()}
    per_project = Counter(i.repo for i in shipped)
    assert len(shipped) >= 30 and len(per_project) >= 3, per_project
    for inst in shipped:
        src = inst.source
        assert isinstance(src, SdistSource)
        pin = pins[(src.package, src.version)]
        assert (src.sha256, src.filename) == (pin.sha256, pin.filename)
        assert inst.test_runner.framework == pin.framework and inst.repo == pin.repo
        assert len(inst.FAIL_TO_PASS) >= 1 and not set(inst.FAIL_TO_PASS) & set(inst.PASS_TO_PASS)
        # the statement shows failures, never the fix
        added = [line[1:].strip() for line in inst.patch.splitlines() if line.startswith("+") and line[1:].strip()]
        added = [a for a in added if not a.startswith("++")]
        assert added and not any(a in inst.problem_statement for a in added if len(a) > 12), inst.instance_id
    assert {i.test_runner.framework for i in shipped} == {"pytest", "unittest"}


def test_gold_predictions_resolve_every_instance(shipped_runs: ShippedRuns) -> None:
    gold = shipped_runs.gold
    assert gold["error_ids"] == [] and gold["unresolved_ids"] == [], json.dumps(gold, indent=1)[:3000]
    assert gold["resolved_instances"] == len(shipped_runs.instances)
    assert gold["resolved_percent"] == 100.0


def test_empty_predictions_resolve_none(shipped_runs: ShippedRuns) -> None:
    empty = shipped_runs.empty
    assert empty["error_ids"] == [] and empty["resolved_ids"] == []
    assert empty["empty_patch_instances"] == len(shipped_runs.instances)
    for inst in shipped_runs.instances:
        path = shipped_runs.log_dir / "empty" / "empty" / inst.instance_id / "report.json"
        body = json.loads(path.read_text())[inst.instance_id]
        # not only unresolved by rule: every FAIL_TO_PASS test really fails without the fix
        assert body["resolution"] == "RESOLVED_NO"
        assert sorted(body["tests_status"]["FAIL_TO_PASS"]["failure"]) == sorted(inst.FAIL_TO_PASS)
        assert sorted(body["tests_status"]["PASS_TO_PASS"]["success"]) == sorted(inst.PASS_TO_PASS)
