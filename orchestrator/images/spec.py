"""ImageSpec: a small declarative image (base, files, commands, environment) and the Dockerfile it renders to."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import docker

from orchestrator.core.image_spec import ImageSpec, render_dockerfile
from orchestrator.images.build import BuildLimits, build_image


def build_from_spec(
    client: docker.DockerClient,
    *,
    name: str,
    spec: ImageSpec,
    labels: dict[str, str] | None = None,
    log_dir: Path | None = None,
    limits: BuildLimits | None = None,
    from_images: Collection[str] | None = None,
) -> str:
    """Render `spec` and build it with `build_image` (cached by its inputs); return the tag. `from_images`: as
    build_image's (an untrusted spec's base)."""
    dockerfile, context = render_dockerfile(spec)
    return build_image(
        client,
        name=name,
        dockerfile=dockerfile,
        context_files=dict(context),
        labels=labels,
        log_dir=log_dir,
        limits=limits,
        from_images=from_images,
        adds=False,  # its files are COPYed (render_dockerfile writes no ADD)
    )
