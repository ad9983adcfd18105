"""Engine calls: the synchronous docker SDK behind a bounded thread pool and a call limiter.

No engine call blocks the event loop; an engine that does not answer becomes a SandboxUnavailableError (an
infrastructure error). Pings go on their own thread and client, so they answer even when every pool thread waits on
a stuck engine. `answering` says whether the engine answered last: a call it did not answer clears it, an answered
call or ping sets it, so that rollouts can wait for an engine that restarts rather than fail on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import docker
import docker.errors
import requests

from orchestrator.backends.docker.call_limiter import CallLimiter, Permit
from orchestrator.backends.docker.config import DockerBackendConfig
from orchestrator.core.errors import SandboxUnavailableError
from orchestrator.core.runtime import to_the_end

T = TypeVar("T")

# how an engine that does not answer shows in the SDK
ENGINE_SILENT = (requests.exceptions.ConnectionError, requests.exceptions.Timeout)


class Engine:
    """The engine's low-level API, called through a limiter on a bounded pool."""

    def __init__(self, config: DockerBackendConfig) -> None:
        self.config = config
        self._pool = ThreadPoolExecutor(max_workers=config.api_workers, thread_name_prefix="docker-api")
        # engine calls in flight and their pace; its counters are what a status page would show
        self.limiter = CallLimiter(
            max_limit=config.api_workers,
            rate_per_s=config.api_rate_per_s,
            burst=config.api_burst,
            slow_factor=config.api_slow_factor,
            slow_min_s=config.api_slow_min_s,
            max_backoff_s=config.api_max_backoff_s,
        )
        kwargs: dict[str, Any] = {"timeout": config.api_timeout_s, "max_pool_size": config.api_workers}
        if config.base_url:
            kwargs["base_url"] = config.base_url
            self.client = docker.DockerClient(**kwargs)
        else:
            self.client = docker.from_env(**kwargs)
        self.api = self.client.api
        self.errors = 0
        # cleared while the engine is found not answering (a call it left unanswered, a ping): set again by the next
        # answer, whichever call or ping gets it (DockerBackend's health watch pings every health_interval_s)
        self.answering = asyncio.Event()
        self.answering.set()
        self._ping_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="docker-ping")
        ping_timeout = max(1, round(config.health_timeout_s))
        self._ping_client = (
            docker.DockerClient(base_url=config.base_url, timeout=ping_timeout)
            if config.base_url
            else docker.from_env(timeout=ping_timeout)
        ).api

    async def ping(self) -> bool:
        """Whether the engine answers a ping within the health timeout."""
        loop = asyncio.get_running_loop()
        # asyncio.timeout, not wait_for: on Python 3.11, wait_for returns the ping's result when the cancel of
        # close() arrives just as the ping ends, and the loop would then ping forever with close() waiting on it
        try:
            async with asyncio.timeout(self.config.health_timeout_s + 1):
                await loop.run_in_executor(self._ping_pool, self._ping_client.ping)
        except Exception:
            self.answering.clear()
            return False
        self.answering.set()
        return True

    async def wait_answering(self, limit_s: float) -> float:
        """Wait for the engine, found not answering, to answer again (a ping or any call), for `limit_s` at most;
        the seconds waited (0 at once while it answers). Its pings are the health watch's, not the waiters'."""
        if self.answering.is_set() or limit_s <= 0:
            return 0.0
        start = time.monotonic()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(limit_s):
                await self.answering.wait()
        return time.monotonic() - start

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking engine call on the pool, within the limiter; an engine that does not answer is an
        infrastructure error."""
        running = await self._submit(fn, *args, **kwargs)
        return await self._outcome(fn, asyncio.wrap_future(running))

    async def call_to_completion(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Like call, but a caller cancelled once the call has started still waits for it to finish, so that
        whatever it created is known and can be removed (a thread cannot be cancelled; its container would leak).
        Cancelled while still waiting for the limiter, nothing was started and the caller leaves at once."""
        running = asyncio.wrap_future(await self._submit(fn, *args, **kwargs))
        try:
            return await self._outcome(fn, asyncio.shield(running))
        except asyncio.CancelledError:
            # to its end through a second cancel too (a CancelJob, then the shutdown's): cut there, the caller's
            # cleanup looked for the container by name before the engine had made it, found none, and it stayed
            with contextlib.suppress(Exception):
                await to_the_end(running)
            raise

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run blocking work that is more than one engine call (the docker-exec fallback runs a whole command in
        one call) on the pool, outside the limiter: it lasts as long as that work does, which says nothing about the
        engine, and must not hold a permit that long."""
        running = self._pool.submit(functools.partial(fn, *args, **kwargs))
        return await self._outcome(fn, asyncio.wrap_future(running))

    async def _submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        """Start the engine call `fn` on the pool once the limiter lets it."""
        call = functools.partial(fn, *args, **kwargs)
        permit = await self.limiter.acquire(getattr(fn, "__name__", "call"))
        try:
            return self._run_permitted(permit, call)
        except BaseException:
            self.limiter.release(permit, None)
            raise

    def _run_permitted(self, permit: Permit, call: Callable[[], T]) -> Future[T]:
        """Run `call` on the pool; the permit goes back when the thread is done, not when its caller gives up,
        so the engine never has more of our calls in flight than the limit allows."""
        loop = asyncio.get_running_loop()
        started: list[float] = []

        def timed() -> T:
            started.append(time.monotonic())
            return call()

        def finished(done: Future[T]) -> None:
            latency = time.monotonic() - started[0] if started else None  # None: cancelled before it ran
            silent = not done.cancelled() and isinstance(done.exception(), ENGINE_SILENT)
            # a call stuck past close() finishes after the loop is gone; nobody waits for its permit then
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(functools.partial(self.limiter.release, permit, latency, overloaded=silent))

        running = self._pool.submit(timed)
        running.add_done_callback(finished)
        return running

    async def _outcome(self, fn: Callable[..., T], running: Awaitable[T]) -> T:
        try:
            result = await running
        except ENGINE_SILENT as e:
            self.errors += 1
            self.answering.clear()
            what = getattr(fn, "__name__", "a call")
            if isinstance(e, requests.exceptions.Timeout):
                raise SandboxUnavailableError(
                    f"the docker engine did not answer {what} within {self.config.api_timeout_s:g}s: {e}"
                ) from e
            # no socket, a refused connect, a hang-up: the daemon stopped or restarts (no time limit was reached)
            raise SandboxUnavailableError(f"the docker engine could not be reached for {what}: {e}") from e
        except docker.errors.APIError:
            self.answering.set()  # an answer, if a refusal
            raise
        self.answering.set()
        return result

    async def logs_tail(self, cid: str, lines: int = 20) -> str:
        """The last lines a container wrote, for an error message."""
        try:
            raw = await self.call(self.api.logs, cid, stdout=True, stderr=True, tail=lines)
        except docker.errors.APIError:
            return "(no logs)"
        text: str = raw.decode(errors="replace").strip() if isinstance(raw, bytes) else str(raw)
        return text or "(no output)"

    def close(self) -> None:
        """Stop the pools and close the HTTP clients (a call stuck in the engine is left to finish alone)."""
        self._pool.shutdown(wait=False)
        self._ping_pool.shutdown(wait=False)
        self._ping_client.close()
        self.client.close()
