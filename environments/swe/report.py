"""The run folder: one folder per instance with its artifacts, so a run resumes where it stopped, and a summary.

<log_dir>/<run_id>/<model>/<instance_id>/
    patch.diff  eval.sh  test_output.txt  run_instance.log  report.json   (report.json last: it marks done)
<log_dir>/<run_id>/summary.json                                          (SWE-bench's run report shape)
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from environments.swe.instance import Prediction
from orchestrator.core.files import write_atomically

REPORT = "report.json"
SUMMARY = "summary.json"
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]+")


def safe_component(text: str) -> str:
    """`text` as one path component (a model name may hold '/')."""
    return _UNSAFE.sub("__", text).strip(".") or "_"


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write a file, and its folders, so a reader never sees half of it (write_atomically)."""
    raw = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, raw)


@dataclass(frozen=True)
class RunLayout:
    """Where a run's files go."""

    root: Path
    run_id: str

    @property
    def run_dir(self) -> Path:
        return self.root / safe_component(self.run_id)

    def instance_dir(self, model: str, instance_id: str) -> Path:
        """One instance's artifact folder."""
        return self.run_dir / safe_component(model) / safe_component(instance_id)

    def report_path(self, pred: Prediction) -> Path:
        """Its report.json: present means evaluated."""
        return self.instance_dir(pred.model_name_or_path, pred.instance_id) / REPORT

    def load_report(self, pred: Prediction) -> dict[str, Any] | None:
        """The finished report of a prediction, or None (missing or unreadable: evaluate again)."""
        path = self.report_path(pred)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        body = data.get(pred.instance_id) if isinstance(data, dict) else None
        return body if isinstance(body, dict) else None

    @property
    def summary_path(self) -> Path:
        return self.run_dir / SUMMARY


@dataclass
class RunSummary:
    """Counts and ids over a run, in SWE-bench's run-report shape (`summary()`)."""

    total_instances: int
    submitted: list[str] = field(default_factory=list)
    completed: list[str] = field(default_factory=list)
    resolved: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    empty_patch: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # had a report already (resume)
    apply_methods: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def resolved_percent(self) -> float:
        """Resolved over submitted predictions, in percent."""
        return 100.0 * len(self.resolved) / len(self.submitted) if self.submitted else 0.0

    def add(self, instance_id: str, report: Mapping[str, Any]) -> None:
        """Count one finished report."""
        self.completed.append(instance_id)
        if not report.get("patch_exists", True):
            self.empty_patch.append(instance_id)
        (self.resolved if report.get("resolved") else self.unresolved).append(instance_id)
        method = report.get("apply_method") or ("none" if report.get("patch_exists", True) else "empty")
        self.apply_methods[method] = self.apply_methods.get(method, 0) + 1

    def summary(self, run_id: str, models: Sequence[str]) -> dict[str, Any]:
        """SWE-bench's keys (schema_version 2), then envfleet's."""
        incomplete = sorted(set(self.submitted) - set(self.completed) - set(self.errors))
        return {
            "total_instances": self.total_instances,
            "submitted_instances": len(self.submitted),
            "completed_instances": len(self.completed),
            "resolved_instances": len(self.resolved),
            "unresolved_instances": len(self.unresolved),
            "empty_patch_instances": len(self.empty_patch),
            "error_instances": len(self.errors),
            "completed_ids": sorted(self.completed),
            "incomplete_ids": incomplete,
            "empty_patch_ids": sorted(self.empty_patch),
            "submitted_ids": sorted(self.submitted),
            "resolved_ids": sorted(self.resolved),
            "unresolved_ids": sorted(self.unresolved),
            "error_ids": sorted(self.errors),
            "schema_version": 2,
            "run_id": run_id,
            "models": list(models),
            "resolved_percent": round(self.resolved_percent, 2),
            "errors": dict(sorted(self.errors.items())),
            "skipped_ids": sorted(self.skipped),
            "apply_methods": dict(sorted(self.apply_methods.items())),
            "seconds": round(self.seconds, 2),
        }


def models_of(predictions: Iterable[Prediction]) -> list[str]:
    """The distinct model names, in first-seen order."""
    return list(dict.fromkeys(p.model_name_or_path for p in predictions))
