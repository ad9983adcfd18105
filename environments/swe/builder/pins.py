"""The projects a dataset is built from: PyPI source distributions pinned by version and sha256."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from environments.swe.instance import SdistSource
from orchestrator.core.errors import InvalidRequestError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
PINS = DATA_DIR / "projects.json"
INSTANCES = DATA_DIR / "instances.jsonl"


class ProjectPin(BaseModel):
    """One project: its sdist, how its tests run, what may be mutated, and how many instances to ship."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    package: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    version: str = Field(min_length=1)
    filename: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    framework: Literal["pytest", "unittest"] = "pytest"
    test_targets: list[str] = Field(min_length=1, description="pytest paths, or unittest modules (dotted)")
    source_dirs: list[str] = Field(min_length=1, description="folders or files whose functions may be mutated")
    pythonpath: list[str] = Field(default_factory=list)
    exclude_tests: list[str] = Field(default_factory=list, description="substrings of slow or flaky test names")
    instances: int = Field(10, ge=1, le=1000, description="instances to ship from this project")

    def source(self) -> SdistSource:
        """The sdist as an instance's source (no setup patch)."""
        return SdistSource(package=self.package, version=self.version, filename=self.filename, sha256=self.sha256)

    @property
    def repo(self) -> str:
        """SWE-bench's `repo` ("owner/name"); the owner `pypi` says the source is a PyPI sdist."""
        return f"pypi/{self.package}"


def load_pins(path: Path = PINS) -> list[ProjectPin]:
    """The pinned projects of a pins file (a JSON list)."""
    try:
        return TypeAdapter(list[ProjectPin]).validate_python(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, ValidationError) as e:
        raise InvalidRequestError(f"{path}: invalid pins: {e}") from e
