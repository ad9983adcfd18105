"""This build's fingerprint, said in every worker's hello: what crosses the worker wire, and the code that runs and
grades a rollout.

A worker and a control plane of different builds disagree on the models both validate strictly (extra fields are
refused): the worker refused a newer job spec, or the control plane a newer rollout, after the whole episode had run,
and each such rollout was retried on other workers and ended an infrastructure error. And a worker of the same wire
but older code graded with the older grader: the version stays 0.1.0, so a node left behind an upgrade that fixed a
forgeable grader (SWE's, Harbor's) was let in, and its rewards trusted. So the control plane refuses a worker whose
build differs, at its hello, with both builds named.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

from orchestrator.core.models import JobSpec, Rollout
from orchestrator.service.declarative.spec import EnvironmentSpec
from protos import orchestrator_pb2, worker_pb2


def _shape(schema: Any, names: bool = False) -> Any:
    """A JSON schema without its prose (descriptions and titles: the models' docstrings, which `python -OO` drops,
    and their wording), so the digest changes with the shape alone. `names`: `schema` is a map of names to schemas
    (properties, $defs), whose keys are kept whatever they are."""
    if isinstance(schema, list):
        return [_shape(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    if names:
        return {key: _shape(value) for key, value in schema.items()}
    return {
        key: _shape(value, key in ("properties", "$defs", "patternProperties"))
        for key, value in schema.items()
        if key not in ("description", "title")
    }


# what a wheel of envfleet holds of these packages (pyproject's package-data): a checkout's stray files (an editor's,
# a local build's) are no part of the build
CODE_SUFFIXES = frozenset({".py", ".go", ".json", ".jsonl", ".jinja", ".txt", ".Dockerfile"})


def _code(digest: Any, locations: dict[str, list[Path]] | None = None) -> None:
    """Every file of the packages a worker runs (the orchestrator, the built-in environments and their data, envd),
    by path and content: the build's code, whatever its version says. `locations`: each package's folders (found,
    not imported, by default: the plug-ins are above this layer)."""
    for package, roots in (_locations() if locations is None else locations).items():
        for root in roots:
            for path in sorted(root.rglob("*")):
                if path.suffix not in CODE_SUFFIXES or "__pycache__" in path.parts or not path.is_file():
                    continue
                digest.update(f"{package}/{path.relative_to(root).as_posix()}\0".encode())
                digest.update(hashlib.sha256(path.read_bytes()).digest())


def _locations() -> dict[str, list[Path]]:
    found = {}
    for package in ("orchestrator", "envd", "environments"):
        spec = importlib.util.find_spec(package)
        found[package] = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
    return found


@functools.cache
def release() -> str:
    """`<envfleet version>+<digest>`: the digest of the JSON schemas of the job spec, the rollout and the declarative
    environment spec, of the orchestrator and worker protos, and of the code (_code)."""
    digest = hashlib.sha256()
    _code(digest)
    for model in (JobSpec, Rollout, EnvironmentSpec):
        digest.update(json.dumps(_shape(model.model_json_schema()), sort_keys=True).encode())
    for proto in (orchestrator_pb2, worker_pb2):
        digest.update(proto.DESCRIPTOR.serialized_pb)
    try:
        version = importlib.metadata.version("envfleet")
    except importlib.metadata.PackageNotFoundError:  # a checkout run without installing it
        version = "0"
    return f"{version}+{digest.hexdigest()[:16]}"
