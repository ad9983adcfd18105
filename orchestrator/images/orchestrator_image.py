"""The orchestrator's own image (the repository's top-level Dockerfile), built offline FROM the base image."""

from __future__ import annotations

from pathlib import Path

import docker

from orchestrator.core.errors import ImageBuildError
from orchestrator.images.base import _package_files, ensure_base_image
from orchestrator.images.build import build_image
from orchestrator.images.cache import default_cache_dir, log_dir_for
from orchestrator.images.wheels import envd_requirements, fetch_site

PACKAGES = ("protos", "envd", "orchestrator", "environments")


def ensure_orchestrator_image(client: docker.DockerClient, *, cache_dir: Path | None = None) -> str:
    """Build (or reuse) `envfleet/orchestrator:<hash>` from the top-level Dockerfile; returns its tag."""
    cache = cache_dir or default_cache_dir()
    dockerfile = Path(__file__).resolve().parents[2] / "Dockerfile"
    if not dockerfile.is_file():
        raise ImageBuildError(f"{dockerfile} not found: build the orchestrator image from a source checkout")
    base = ensure_base_image(client, cache_dir=cache)
    site = fetch_site(envd_requirements(roots=("envfleet",)), cache / "site" / "orchestrator", cache)
    context: dict[str, bytes | Path] = {"site": site}
    for package in PACKAGES:
        context.update(_package_files(package, ("*.py", "*.proto", "*.Dockerfile"), f"src/{package}"))
    return build_image(
        client,
        name="orchestrator",
        dockerfile=dockerfile.read_text(encoding="utf-8"),
        context_files=context,
        buildargs={"BASE": base},
        log_dir=log_dir_for(cache),
        cache_dir=cache,
    )
