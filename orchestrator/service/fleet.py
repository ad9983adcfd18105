"""The fleet a server runs on, chosen by configuration: the sandbox backend and what depends on it (where images
come from, how a registered environment's own image is made, which raw images exist, engine health and metrics).

Each backend's modules are imported in its branch only, so `serve --backend fake` never loads the docker backend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.backends.config import DockerBackendConfig, FakeBackendConfig
from orchestrator.core.environment import Environment, ImageSource
from orchestrator.core.metrics import Metrics
from orchestrator.core.sandbox import SandboxBackend
from orchestrator.images.resolver import BuildsOwnImage
from orchestrator.service.declarative import DeclarativeEnvironment

log = logging.getLogger(__name__)
HealthListener = Callable[[bool], None]


@dataclass
class Fleet:
    """A started backend and its backend-specific parts, behind backend-neutral callables."""

    backend: SandboxBackend
    images: ImageSource
    # a declarative spec's or an uploaded archive's image; blocking: run it in a thread
    build_spec_image: Callable[[BuildsOwnImage], str]
    image_present: Callable[[str], bool]  # blocking: run it in a thread
    watch_health: Callable[[HealthListener], None]  # the listener hears when the backend stops or starts answering
    export_metrics: Callable[[Metrics], None]  # gauges read when scraped


async def start_fleet(config: DockerBackendConfig | FakeBackendConfig) -> Fleet:
    """Start the configured backend (the docker one sweeps what dead owners left first)."""
    if isinstance(config, FakeBackendConfig):
        return _fake_fleet(config)
    return await _docker_fleet(config)


def _fake_fleet(config: FakeBackendConfig) -> Fleet:
    from orchestrator.backends.fake import FakeBackend

    backend = FakeBackend(config)
    images = backend.images
    log.warning("fake backend: no command runs and sandboxes live in memory; rewards mean nothing about a policy")

    def build_spec_image(env: BuildsOwnImage) -> str:
        # a tag per build input, as a real build's: a spec's image, or an archive environment's name@version
        if isinstance(env, DeclarativeEnvironment):
            return images.tag_for(env.name, env.spec.image.model_dump_json())
        if not isinstance(env, Environment):
            raise TypeError(f"{env!r} is not an environment")
        return images.tag_for(env.name, env.ref())

    return Fleet(
        backend,
        images,
        build_spec_image,
        images.exists,
        watch_health=lambda listener: None,  # it never stops answering
        export_metrics=lambda metrics: None,
    )


async def _docker_fleet(config: DockerBackendConfig) -> Fleet:
    import docker.errors

    from orchestrator.backends.docker.backend import DockerBackend
    from orchestrator.images.cache import image_exists
    from orchestrator.images.resolver import ImageResolver

    backend = await DockerBackend.start(config)
    client = backend.client

    def image_present(tag: str) -> bool:
        try:
            return image_exists(client, tag)
        except docker.errors.APIError:  # an invalid reference
            return False

    def export_metrics(metrics: Metrics) -> None:
        metrics.docker_api_limit.set_function(lambda: backend.limiter.permits)
        metrics.docker_api_in_flight.set_function(lambda: backend.limiter.in_flight)
        metrics.docker_api_waiting.set_function(lambda: backend.limiter.waiting)
        metrics.docker_engine_answering.set_function(lambda: backend.engine_answering())

    resolver = ImageResolver(client)
    return Fleet(
        backend,
        resolver,
        resolver.build_own_image,
        image_present,
        watch_health=backend.on_engine_health,
        export_metrics=export_metrics,
    )
