"""Dataset validation: the gold patch resolves k of k runs, the empty patch resolves none, flaky tests are found and
quarantined (removed from FAIL_TO_PASS / PASS_TO_PASS and listed in `quarantined_tests`).

A test is flaky when its outcome differs between the k gold runs. A FAIL_TO_PASS test that fails under gold every
time, or passes with the empty patch, is wrong rather than flaky: it is dropped too, and said so. An instance left
with no FAIL_TO_PASS test is invalid and left out of the validated dataset.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker

from environments.swe.evaluate import run_evaluation
from environments.swe.grading import FAIL_TO_PASS, PASS_TO_PASS
from environments.swe.instance import SweInstance, empty_predictions, gold_predictions
from environments.swe.report import RunLayout
from orchestrator.core.sandbox import SandboxBackend

log = logging.getLogger(__name__)


@dataclass
class InstanceValidation:
    """What validation found for one instance."""

    instance_id: str
    gold_resolved: int = 0
    runs: int = 0
    empty_resolved: bool = False
    flaky: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # consistently contradicts its category
    errors: list[str] = field(default_factory=list)
    valid: bool = False

    def as_dict(self) -> dict[str, Any]:
        """JSON form for the validation report."""
        return {
            "gold_resolved": f"{self.gold_resolved}/{self.runs}",
            "empty_resolved": self.empty_resolved,
            "flaky": self.flaky,
            "wrong": self.wrong,
            "errors": self.errors,
            "valid": self.valid,
        }


@dataclass
class ValidationResult:
    """Per-instance findings and the validated (quarantined) dataset."""

    instances: list[SweInstance]
    findings: dict[str, InstanceValidation]

    @property
    def ok(self) -> bool:
        """Every instance valid with nothing quarantined."""
        return all(f.valid and not f.flaky and not f.wrong for f in self.findings.values())

    def report(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "valid": sum(f.valid for f in self.findings.values()),
            "invalid": sorted(i for i, f in self.findings.items() if not f.valid),
            "quarantined": {i: f.flaky + f.wrong for i, f in self.findings.items() if f.flaky or f.wrong},
            "instances": {i: f.as_dict() for i, f in sorted(self.findings.items())},
        }


def _outcome(body: dict[str, Any] | None) -> dict[str, bool]:
    """test -> passed (True) / failed (False) from one report's tests_status."""
    out: dict[str, bool] = {}
    status = (body or {}).get("tests_status") or {}
    for cat in (FAIL_TO_PASS, PASS_TO_PASS):
        for t in status.get(cat, {}).get("success", []):
            out[t] = True
        for t in status.get(cat, {}).get("failure", []):
            out[t] = False
    return out


async def validate_dataset(
    instances: Sequence[SweInstance],
    *,
    backend: SandboxBackend,
    client: docker.DockerClient,
    runs: int = 3,
    workers: int = 2,
    log_dir: Path,
    run_id: str = "validate",
    cache_dir: Path | None = None,
    progress: Callable[[str, str], None] | None = None,
) -> ValidationResult:
    """Run the gold patch `runs` times and the empty patch once per instance; return the findings and the dataset
    with flaky or wrong tests quarantined (invalid instances left out)."""
    gold_reports: list[dict[str, dict[str, Any] | None]] = []
    for k in range(runs):
        rid = f"{run_id}-gold-{k + 1}"
        preds = gold_predictions(instances)
        await run_evaluation(
            instances,
            preds,
            run_id=rid,
            backend=backend,
            client=client,
            workers=workers,
            log_dir=log_dir,
            cache_dir=cache_dir,
            progress=progress,
        )
        layout = RunLayout(log_dir, rid)
        gold_reports.append({p.instance_id: layout.load_report(p) for p in preds})
    empty = empty_predictions(instances)
    rid = f"{run_id}-empty"
    await run_evaluation(
        instances,
        empty,
        run_id=rid,
        backend=backend,
        client=client,
        workers=workers,
        log_dir=log_dir,
        cache_dir=cache_dir,
        progress=progress,
    )
    layout = RunLayout(log_dir, rid)
    empty_reports = {p.instance_id: layout.load_report(p) for p in empty}

    findings: dict[str, InstanceValidation] = {}
    validated: list[SweInstance] = []
    for inst in instances:
        f = InstanceValidation(inst.instance_id, runs=runs)
        findings[inst.instance_id] = f
        outcomes = []
        for reports in gold_reports:
            body = reports.get(inst.instance_id)
            if body is None or "tests_status" not in body:
                f.errors.append((body or {}).get("error", "no report (evaluation error)"))
                continue
            f.gold_resolved += bool(body.get("resolved"))
            outcomes.append(_outcome(body))
        e_body = empty_reports.get(inst.instance_id)
        e_out = _outcome(e_body)
        if e_body is None or "tests_status" not in e_body:
            f.errors.append("empty patch: " + str((e_body or {}).get("error", "no report (evaluation error)")))
        f.empty_resolved = bool(e_out) and all(e_out.get(t, False) for t in inst.FAIL_TO_PASS)
        if not outcomes or e_body is None:
            continue
        drop: set[str] = set()
        for t in inst.tests:
            seen = {o.get(t, False) for o in outcomes}
            if len(seen) > 1:
                f.flaky.append(t)
            elif seen == {False}:
                f.wrong.append(t)  # fails under the gold patch every time
            elif t in inst.FAIL_TO_PASS and e_out.get(t, False):
                f.wrong.append(t)  # passes without any fix
            elif t in inst.PASS_TO_PASS and not e_out.get(t, True):
                f.wrong.append(t)  # a PASS_TO_PASS test the bug itself breaks
        drop = set(f.flaky) | set(f.wrong)
        f2p = [t for t in inst.FAIL_TO_PASS if t not in drop]
        p2p = [t for t in inst.PASS_TO_PASS if t not in drop]
        f.valid = bool(f2p)
        if f.valid:
            validated.append(
                inst.model_copy(
                    update={
                        "FAIL_TO_PASS": f2p,
                        "PASS_TO_PASS": p2p,
                        "quarantined_tests": sorted(set(inst.quarantined_tests) | drop),
                        "gold_statuses": {t: s for t, s in inst.gold_statuses.items() if t not in drop},
                    }
                )
            )
        if f.flaky or f.wrong:
            log.warning("%s: quarantined %s", inst.instance_id, sorted(drop))
    return ValidationResult(validated, findings)
