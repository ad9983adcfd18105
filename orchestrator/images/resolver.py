"""The image each environment runs on, built once per process through the offline pipeline."""

from __future__ import annotations

import abc
import asyncio
import concurrent.futures
import functools
import logging
import os
import time

import docker
import requests

from orchestrator.core.environment import Environment
from orchestrator.core.errors import EngineError, ImageBuildError
from orchestrator.images import gc
from orchestrator.images.base import ensure_base_image
from orchestrator.images.spec import build_from_spec

log = logging.getLogger(__name__)
# images built (or looked up) at once by one process's resolver: as many as asyncio's shared pool has, 8 at least
BUILD_THREADS = max(8, min(32, (os.cpu_count() or 1) + 4))


class BuildsOwnImage(abc.ABC):
    """An environment that builds its image itself (a declarative spec's, a Harbor task's Dockerfile) instead of
    through an ImageSpec: mix it into the Environment class; the resolver calls `build_image` in a thread."""

    @abc.abstractmethod
    def build_image(self, client: docker.DockerClient) -> str:
        """Build (or reuse, by the hash of its inputs) the image; return its tag."""


class ImageResolver:
    """The image tag (and id) each environment runs on, built once per process through the offline pipeline;
    `prebuild` starts a build in the background for a job that is still queued."""

    def __init__(self, client: docker.DockerClient) -> None:
        self._client = client
        # builds (up to their 15 minutes each, one per environment at once) on threads of their own: on asyncio's
        # shared pool (min(32, cores + 4) threads, 6 on 2 cores) a tenant's jobs on a few environments whose images
        # were being built held every thread, and each sandbox's create (its pty cap), the sweep and SubmitJob's
        # conversion waited behind them for minutes
        self._pool = concurrent.futures.ThreadPoolExecutor(BUILD_THREADS, thread_name_prefix="image-build")
        self._cache: dict[str, tuple[str, str]] = {}
        self._used: dict[str, float] = {}  # ref -> when resolve last handed its image out (monotonic)
        self._builds: dict[str, asyncio.Future[tuple[str, str]]] = {}
        self._prebuilds: dict[str, asyncio.Task[None]] = {}

    def ready(self, env: Environment) -> bool:
        """Whether the environment's image is already built (resolve returns at once)."""
        return env.ref() in self._cache

    async def resolve(self, env: Environment) -> tuple[str, str]:
        """The image's tag and id, built first if needed. The engine failing a call (a 5xx answer, no answer) is
        an EngineError, which rollouts retry as infrastructure; its refusing one (a 4xx: a base image that does not
        exist) is the environment's ImageBuildError, as a failed build step is."""
        key = env.ref()
        if key in self._cache and self._current(key):
            return self._cache[key]
        build = self._builds.get(key)
        if build is None:
            # one build of an image at a time, shared by all that wait for it: under a lock, a waiter cancelled (a
            # rollout's timeout, a CancelJob) let the next one start a second build beside the first, still running
            # in its thread, whose result was thrown away
            build = self._builds[key] = asyncio.ensure_future(self._resolve(key, env))
            build.add_done_callback(functools.partial(self._built, key))
        return await asyncio.shield(build)

    def _current(self, key: str) -> bool:
        """Whether the image found for `key` may be handed out as it is: tenants' images are removed under disk
        pressure (images/gc.py), never one used in the last minutes, so one this process resolved a while ago, or
        one a sandbox found gone, is looked up again (a cache hit of its build) or built again."""
        tag = self._cache[key][0]
        now = time.monotonic()
        if gc.take_missing(tag) or now - self._used.get(key, now) > gc.REVERIFY_S:
            del self._cache[key]
            return False
        self._used[key] = now
        gc.mark_used(tag)
        return True

    def _built(self, key: str, build: asyncio.Future[tuple[str, str]]) -> None:
        self._builds.pop(key, None)  # a failed build is tried again by the next resolve
        if not build.cancelled():
            build.exception()  # its waiters have it; it is not "never retrieved" when every one was cancelled

    async def _resolve(self, key: str, env: Environment) -> tuple[str, str]:
        try:
            self._cache[key] = await asyncio.get_running_loop().run_in_executor(self._pool, self._build, env)
            self._used[key] = time.monotonic()
        except docker.errors.ImageNotFound as e:  # removed between its build (or cache hit) and its lookup
            raise EngineError(
                f"the image of {key} was removed as it was resolved (a collection under disk pressure, an "
                f"operator): {e}"
            ) from e
        except docker.errors.APIError as e:
            if e.is_server_error():
                raise EngineError(f"the engine failed resolving the image of {key}: {e}") from e
            raise ImageBuildError(f"the engine refused building the image of {key}: {e}") from e
        except docker.errors.DockerException as e:
            raise ImageBuildError(f"the engine failed building the image of {key}: {e}") from e
        except requests.exceptions.RequestException as e:
            raise EngineError(f"the engine did not answer resolving the image of {key}: {e}") from e
        return self._cache[key]

    def prebuild(self, env: Environment) -> asyncio.Task[None]:
        """Build the image in the background; the task ends (never raising) when the image exists or the build
        failed. A failed build is retried, and reported, by the rollouts that need the image."""
        key = env.ref()
        task = self._prebuilds.get(key)
        if task is None:
            task = self._prebuilds[key] = asyncio.create_task(self._prebuild(env), name=f"prebuild {key}")
            task.add_done_callback(lambda _: self._prebuilds.pop(key, None))
        return task

    async def _prebuild(self, env: Environment) -> None:
        try:
            await self.resolve(env)
        except Exception as e:
            log.warning("prebuilding the image of %s failed (its rollouts will report it): %s", env.ref(), e)

    def build_own_image(self, env: BuildsOwnImage) -> str:
        """A declarative spec's or an archive's image (blocking). `envfleet/base:latest`, which their Dockerfiles
        build FROM, is made this install's base first (a cache hit: some image lookups, tens of ms): only a build of
        the base moved it, so after an upgrade their images kept being built (a cache hit on the same key) on the base
        of the install before, with its envd, without the protections the new orchestrator relies on. At each build,
        not once a process: another install on the engine (an old control plane still draining) may move it back."""
        ensure_base_image(self._client)
        return env.build_image(self._client)

    def _build(self, env: Environment) -> tuple[str, str]:
        if isinstance(env, BuildsOwnImage):
            tag = self.build_own_image(env)
            return tag, str(self._client.images.get(tag).id)
        spec = env.image_spec()
        if spec is None:
            tag = ensure_base_image(self._client)
        else:
            base = spec.base if spec.base else ensure_base_image(self._client)
            tag = build_from_spec(self._client, name=f"env-{env.name}", spec=spec.model_copy(update={"base": base}))
        return tag, str(self._client.images.get(tag).id)
