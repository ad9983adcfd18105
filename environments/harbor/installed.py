"""Imported Harbor environments as `module:ClassName` references: `environments.harbor.installed:NAME` is the
environment `envfleet envs import-harbor --name NAME` saved under $ENVFLEET_HARBOR_HOME (default
~/.envfleet/harbor). Put the reference in the server config's `environments` list to serve it."""

from __future__ import annotations

import os
from pathlib import Path

from environments.harbor.env import HarborEnvironment, from_manifest

MANIFEST = "harbor.json"


def harbor_home() -> Path:
    """Where import-harbor saves environments."""
    return Path(os.environ.get("ENVFLEET_HARBOR_HOME") or Path.home() / ".envfleet" / "harbor")


def manifest_path(name: str) -> Path:
    """The manifest of the environment saved as `name`."""
    return harbor_home() / name / MANIFEST


def __getattr__(name: str) -> type[HarborEnvironment]:
    path = manifest_path(name)
    if name.startswith("__") or not path.is_file():
        raise AttributeError(f"no imported Harbor environment {name!r} (looked for {path})")
    return type(from_manifest(path))
