"""The orchestrator's own image (the repository's top-level Dockerfile), built offline FROM the base image.

The build context: `site/` (its dependencies, unpacked manylinux wheels), `app/` (the envfleet wheel, unpacked with
its `.dist-info`, so its entry points and version exist in the image) and `plugins/` (the wheels of an optional
extra-wheels folder: plug-in environments, installed the same way) and `cache/` (envd's wheels, so the server in
the image can hash, and if need be build, the sandboxes' base image offline, as `make image` did).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import docker

from orchestrator.core.errors import ImageBuildError
from orchestrator.images.base import ensure_base_image
from orchestrator.images.build import build_image
from orchestrator.images.cache import default_cache_dir, log_dir_for
from orchestrator.images.envfleet_wheel import REPO, build_envfleet_wheel, install_wheels, wheel_dependencies
from orchestrator.images.wheels import download_wheels, envd_requirements, fetch_site

LABEL_CONTENT = "envfleet.wheels.sha256"
_PLUGINS_README = b"Plug-in wheels given with --extra-wheels are unpacked here.\n"


def ensure_orchestrator_image(
    client: docker.DockerClient, *, cache_dir: Path | None = None, extra_wheels: Path | None = None
) -> str:
    """Build (or reuse) `envfleet/orchestrator:<hash>` from the top-level Dockerfile; returns its tag.

    The tag hashes every input, the installed wheels' contents included; `extra_wheels` is a folder of `*.whl`
    (plug-ins, with any dependencies the image lacks) installed next to envfleet."""
    cache = cache_dir or default_cache_dir()
    dockerfile = REPO / "Dockerfile"
    if not dockerfile.is_file():
        raise ImageBuildError(f"{dockerfile} not found: build the orchestrator image from a source checkout")
    extras = _extra_wheels(extra_wheels)
    base = ensure_base_image(client, cache_dir=cache)
    with tempfile.TemporaryDirectory(prefix="envfleet-image-") as tmp:
        work = Path(tmp)
        wheel = build_envfleet_wheel(work / "wheel", log_dir_for(cache))
        app, plugins = work / "app", work / "plugins"
        app.mkdir()
        plugins.mkdir()
        content = install_wheels([wheel], app)
        requirements = envd_requirements(roots=wheel_dependencies(app), skip_roots=())
        site = fetch_site(requirements, cache / "site" / "orchestrator", cache)
        # the server in the image resolves the sandboxes' base image through the same offline pipeline, with no
        # network: it gets the wheels of envd's site as its cache already holds them
        envd_wheels = download_wheels(envd_requirements(), cache)
        if extras:
            content += "+" + install_wheels(extras, plugins)
        (plugins / "README").write_bytes(_PLUGINS_README)  # COPY needs the folder even when it is empty
        return build_image(
            client,
            name="orchestrator",
            dockerfile=dockerfile.read_text(encoding="utf-8"),
            context_files={
                "site": site,
                "app": app,
                "plugins": plugins,
                f"cache/wheels/{envd_wheels.name}": envd_wheels,
            },
            buildargs={"BASE": base},
            labels={LABEL_CONTENT: content},
            log_dir=log_dir_for(cache),
            cache_dir=cache,
        )


def _extra_wheels(folder: Path | None) -> list[Path]:
    if folder is None:
        return []
    if not folder.is_dir():
        raise ImageBuildError(f"extra wheels: {folder} is not a folder")
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise ImageBuildError(f"extra wheels: {folder} holds no *.whl")
    return wheels
