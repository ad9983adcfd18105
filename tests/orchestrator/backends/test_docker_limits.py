"""The docker backend's engine call limiter on a real engine."""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import docker
import pytest

from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig
from orchestrator.backends.docker.sweeper import LABEL_INSTANCE
from orchestrator.core.errors import SandboxUnavailableError
from orchestrator.core.sandbox import SandboxSpec
from tests.conftest import TEST_OWNER, owned_backend
from tests.orchestrator.backends.test_call_limiter import until


@pytest.fixture
async def narrow_backend(base_image: str) -> AsyncIterator[DockerBackend]:
    """A backend that may have at most two engine calls in flight."""
    async with owned_backend(api_workers=2) as b:
        yield b


def containers_of(client: docker.DockerClient, backend: DockerBackend) -> list[str]:
    found = client.api.containers(all=True, filters={"label": f"{LABEL_INSTANCE}={backend.owner.instance}"})
    return [c["Id"] for c in found]


async def test_concurrent_creates_respect_the_cap(
    narrow_backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    async def one(i: int) -> bytes:
        async with await narrow_backend.create(SandboxSpec(image=base_image)) as s:
            return (await s.exec(["echo", str(i)])).stdout

    outs = await asyncio.gather(*(one(i) for i in range(5)))
    assert sorted(outs) == sorted(f"{i}\n".encode() for i in range(5))
    lim = narrow_backend.limiter
    # five creates at once reached the cap of two and queued behind it, never beyond
    assert lim.peak_in_flight == 2 and lim.waited_for_limit > 0
    assert (lim.in_flight, lim.waiting) == (0, 0)
    assert containers_of(docker_client, narrow_backend) == []


async def test_a_create_cancelled_while_waiting_for_the_limiter_starts_nothing(
    narrow_backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    lim = narrow_backend.limiter
    held = [await lim.acquire("held by the test") for _ in range(lim.permits)]
    create = asyncio.create_task(narrow_backend.create(SandboxSpec(image=base_image)))
    await until(lambda: lim.waiting > 0)
    create.cancel()
    for permit in held:
        lim.release(permit, None)
    with pytest.raises(asyncio.CancelledError):
        await create
    assert "create_container" not in lim.typical_latency_s, "the engine was asked to create"
    assert containers_of(docker_client, narrow_backend) == []
    assert (lim.in_flight, lim.waiting) == (0, 0)
    # and the limiter still lets calls through
    async with await narrow_backend.create(SandboxSpec(image=base_image)) as s:
        assert (await s.exec("echo ok")).stdout == b"ok\n"


async def test_a_create_cancelled_once_started_still_leaves_no_container(
    narrow_backend: DockerBackend, base_image: str, docker_client: docker.DockerClient
) -> None:
    lim = narrow_backend.limiter
    create = asyncio.create_task(narrow_backend.create(SandboxSpec(image=base_image)))
    await until(lambda: lim.in_flight > 0, timeout_s=30)
    create.cancel()
    with pytest.raises(asyncio.CancelledError):
        await create
    assert containers_of(docker_client, narrow_backend) == []
    assert (lim.in_flight, lim.waiting) == (0, 0)


async def test_the_docker_exec_fallback_holds_no_permit(backend: DockerBackend, base_image: str) -> None:
    async with await backend.create(SandboxSpec(image=base_image, transport="docker-exec")) as s:
        # the whole command runs in one blocking call, which times the command, not the engine
        r = await s.exec("sleep 1; echo done")
        assert r.stdout == b"done\n"
    assert "_run_blocking" not in backend.limiter.typical_latency_s
    assert "create_container" in backend.limiter.typical_latency_s


class SlowLink:
    """A unix socket in front of the real engine that holds every answer back by `delay_s`: a slow engine. It runs
    its own event loop on a thread, since the docker SDK blocks the test's loop while it connects."""

    def __init__(self, path: Path, engine: str) -> None:
        self.path = path
        self.engine = engine
        self.delay_s = 0.0
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._main(),), daemon=True)

    def __enter__(self) -> SlowLink:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the slow link did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        self._loop.close()

    async def _main(self) -> None:
        pumps: set[asyncio.Task[None]] = set()

        async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
            engine_r, engine_w = await asyncio.open_unix_connection(self.engine)
            both = [
                asyncio.create_task(self._pump(client_r, engine_w, slow=False)),
                asyncio.create_task(self._pump(engine_r, client_w, slow=True)),
            ]
            pumps.update(both)
            await asyncio.wait(both)
            pumps.difference_update(both)

        server = await asyncio.start_unix_server(serve, str(self.path))
        self._ready.set()
        await self._stop.wait()
        server.close()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, *, slow: bool) -> None:
        try:
            while data := await r.read(1 << 16):
                if slow and self.delay_s:
                    await asyncio.sleep(self.delay_s)
                w.write(data)
                await w.drain()
        except OSError:
            pass  # the other side hung up (a client that timed out)
        finally:
            w.close()


def engine_socket() -> str:
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        pytest.skip("the engine is not on a unix socket")
    return host.removeprefix("unix://")


async def test_a_slow_engine_shrinks_the_limit_and_a_fast_one_grows_it_back(base_image: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, SlowLink(Path(tmp) / "engine.sock", engine_socket()) as link:
        config = DockerBackendConfig(owner=TEST_OWNER, base_url=f"unix://{link.path}", api_workers=8)
        backend = await DockerBackend.start(config, sweep=False)
        lim = backend.limiter
        try:

            async def calls(n: int) -> None:
                await asyncio.gather(*(backend.state_of("envfleet-no-such-container") for _ in range(n)))

            await calls(8)
            assert (lim.permits, lim.decreases) == (8, 0)
            link.delay_s = 1.0  # hundreds of times what an inspect takes
            await calls(8)
            assert (lim.permits, lim.decreases) == (4, 1), "one cut for one round of slow calls"
            # more calls than permits: the rest wait, and each slow round started after a cut cuts again
            await calls(8)
            assert lim.permits == 1 and lim.decreases >= 3 and lim.waited_for_limit > 0
            link.delay_s = 0.0
            for _ in range(200):
                await calls(2)
                if lim.permits == 8:
                    break
            assert lim.permits == 8
        finally:
            await backend.close()


async def test_an_engine_that_does_not_answer_cuts_the_limit_and_backs_off(base_image: str) -> None:
    with tempfile.TemporaryDirectory() as tmp, SlowLink(Path(tmp) / "engine.sock", engine_socket()) as link:
        config = DockerBackendConfig(owner=TEST_OWNER, base_url=f"unix://{link.path}", api_workers=8, api_timeout_s=1)
        backend = await DockerBackend.start(config, sweep=False)
        lim = backend.limiter
        try:
            link.delay_s = 3.0
            with pytest.raises(SandboxUnavailableError, match="did not answer inspect_container within 1s"):
                await backend.state_of("envfleet-no-such-container")
            assert (lim.permits, lim.decreases, backend.engine_errors) == (4, 1, 1)
            link.delay_s = 0.0
            await backend.state_of("envfleet-no-such-container")
            assert lim.waited_for_backoff == 1
        finally:
            await backend.close()


async def test_start_ups_take_turns(
    base_image: str, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a burst of creates on a starved host: each start-up (engine create and start, envd until healthy) waits for a
    # turn, so none of them shares the CPU with all the others and misses its health deadline for it
    import orchestrator.backends.docker.backend as backend_module

    starting, peak = 0, 0
    real = backend_module.create_until_ready  # type: ignore[attr-defined]

    async def counted(*args: object, **kwargs: object) -> object:
        nonlocal starting, peak
        starting += 1
        peak = max(peak, starting)
        try:
            return await real(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            starting -= 1

    monkeypatch.setattr(backend_module, "create_until_ready", counted)
    spec = SandboxSpec(image=base_image)
    for turns, want in ((1, 1), (0, 3)):  # one at a time; then the default, several at once
        async with owned_backend(startup_concurrency=turns) as b:
            boxes = await asyncio.gather(*(b.create(spec) for _ in range(3)))
            assert [(await s.exec("echo up")).stdout for s in boxes] == [b"up\n"] * 3
            for s in boxes:
                await s.close()
            assert containers_of(docker_client, b) == []
        assert peak == want, (turns, peak)
        peak = 0
