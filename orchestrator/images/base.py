"""envfleet/base: the image every sandbox runs, with envd at /opt/envfleet, built offline and cached by its inputs.

Tiers: rootfs (debootstrap) -> base (envd, its wheels, the protobuf code) -> environment and instance images, each
tagged by a hash of what went into it.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import logging
from pathlib import Path

import docker

from orchestrator.core.errors import ImageBuildError
from orchestrator.images.build import REPO_PREFIX, build_image
from orchestrator.images.cache import default_cache_dir, log_dir_for
from orchestrator.images.envd_go import build_envd_binary, inputs_key
from orchestrator.images.rootfs import ensure_rootfs_image
from orchestrator.images.wheels import envd_requirements, fetch_site

log = logging.getLogger(__name__)

BASE_NAME = "base"
BASE_LATEST = f"{REPO_PREFIX}/{BASE_NAME}:latest"


def base_dockerfile() -> str:
    """The base image's Dockerfile text (shipped next to this module)."""
    return importlib.resources.files("orchestrator.images").joinpath("base.Dockerfile").read_text(encoding="utf-8")


def ensure_base_image(client: docker.DockerClient, *, cache_dir: Path | None = None) -> str:
    """Return the tag `envfleet/base:<hash>` of the base image, building it (and the rootfs) if missing.

    Also points `envfleet/base:latest` at it. A cache hit costs a few image lookups and hashing the context.
    """
    cache = cache_dir or default_cache_dir()
    logs = log_dir_for(cache)
    rootfs = ensure_rootfs_image(client, log_dir=logs, cache_dir=cache)
    site = fetch_site(envd_requirements(), cache / "site" / "envd", cache)
    context: dict[str, bytes | Path] = {"site": site}
    context.update(_package_files("envd", ("*.py",), "envd"))
    context.update(_package_files("protos", ("*.py", "*.proto"), "protos"))
    tag = build_image(
        client,
        name=BASE_NAME,
        dockerfile=base_dockerfile(),
        context_files=context,
        buildargs={"ROOTFS": rootfs},
        # the compiled envd is made only when the image is built; its sources' hash is in the key as a label
        labels={"envfleet.rootfs": rootfs, "envfleet.envd-go": inputs_key()},
        made_files=lambda: {"envd-bin": build_envd_binary(cache)},
        log_dir=logs,
        cache_dir=cache,
    )
    client.images.get(tag).tag(f"{REPO_PREFIX}/{BASE_NAME}", "latest")
    return tag


def _package_files(package: str, patterns: tuple[str, ...], prefix: str) -> dict[str, bytes | Path]:
    """The source files of an importable package, found without importing it (no __pycache__, no stubs)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImageBuildError(f"package {package!r} is not importable; is envfleet installed?", step="context")
    root = Path(next(iter(spec.submodule_search_locations)))
    files: dict[str, bytes | Path] = {}
    for pattern in patterns:
        for f in sorted(root.rglob(pattern)):
            rel = f.relative_to(root)
            if "__pycache__" not in rel.parts and f.is_file():
                files[f"{prefix}/{rel.as_posix()}"] = f
    if not files:
        raise ImageBuildError(f"package {package!r} at {root} has no {patterns} files", step="context")
    return files
