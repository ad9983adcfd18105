"""A sandbox's cleanup runs to its end on a real engine: cancelled again while it runs, or overtaken by the backend's
close(), it still leaves no container and no socket directory behind.

The engine calls that open each window are slowed down in the backend's own instance; threading events say when a
call has reached the engine, so the cancels land where they are meant to.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path
from typing import Any

import docker
import pytest

from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig
from orchestrator.core.errors import SandboxUnavailableError
from orchestrator.core.sandbox import SandboxSpec
from tests.conftest import TEST_OWNER, owned_backend, owned_containers

pytestmark = pytest.mark.docker

ENGINE_WAIT_S = 60.0  # how long a slowed engine call may take to be reached at all (a loaded engine)


def slowed(fn: Any, reached: threading.Event, done: threading.Event | None = None, delay_s: float = 1.0) -> Any:
    """`fn`, made to take `delay_s` longer in the engine; `reached` is set when a call begins, `done` when it ends."""

    def slow(*args: Any, **kwargs: Any) -> Any:
        reached.set()
        time.sleep(delay_s)
        try:
            return fn(*args, **kwargs)
        finally:
            if done is not None:
                done.set()

    return slow


async def reached(event: threading.Event) -> None:
    assert await asyncio.to_thread(event.wait, ENGINE_WAIT_S), "the slowed engine call was never made"


async def test_a_failed_creates_cleanup_cancelled_again_still_removes_its_directory_and_lock(
    base_image: str, socket_root: Path, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a first cancel lands in create_container (the create waits for it, then cleans up); a second one lands while
    # the cleanup removes the container. The socket directory, its tmpfs and the create's lock (with its fd) stayed
    # until the process exited: our own lock made every sweep take the directory for a live create
    async with owned_backend(socket_root=socket_root) as backend:
        at_create, at_remove = threading.Event(), threading.Event()
        monkeypatch.setattr(backend.api, "create_container", slowed(backend.api.create_container, at_create))
        monkeypatch.setattr(backend.api, "remove_container", slowed(backend.api.remove_container, at_remove))
        creating = asyncio.create_task(backend.create(SandboxSpec(image=base_image)))
        await reached(at_create)
        [name] = backend.sockets.names()
        creating.cancel()
        await reached(at_remove)
        creating.cancel()
        with pytest.raises(asyncio.CancelledError):
            await creating
        # the cancel comes back once the cleanup is over, not before
        assert sorted(os.listdir(socket_root)) == [".seal-key"], "the cleanup left the directory or its lock"
        assert not docker_client.api.containers(all=True, filters={"name": name})
        assert not backend.sockets._creating, "the create's lock fd is still open"


async def test_a_create_cancelled_twice_while_the_engine_creates_leaves_no_container(
    base_image: str, socket_root: Path, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the create survived one cancel (it waited for the engine's answer), not a second (a CancelJob, then the
    # shutdown's): the cleanup looked the container up by name before the engine had made it, found none, and the
    # container the engine then made stayed until a sweep
    async with owned_backend(socket_root=socket_root) as backend:
        at_create, created = threading.Event(), threading.Event()
        create = slowed(backend.api.create_container, at_create, created, delay_s=2.0)
        monkeypatch.setattr(backend.api, "create_container", create)
        creating = asyncio.create_task(backend.create(SandboxSpec(image=base_image)))
        await reached(at_create)
        [name] = backend.sockets.names()
        creating.cancel()
        await asyncio.sleep(0.3)
        creating.cancel()
        with pytest.raises(asyncio.CancelledError):
            await creating
        await reached(created)
        await asyncio.sleep(0.5)  # a removal queued by the cleanup, if any, has its turn
        assert not docker_client.api.containers(all=True, filters={"name": name}), "the container stayed"


async def test_close_during_a_release_in_flight_waits_for_its_removal(
    base_image: str, socket_root: Path, docker_client: docker.DockerClient
) -> None:
    # release() marks the sandbox closed, then closes its transport before its removal is queued: a backend close()
    # meanwhile skipped it (closed already), found no removal to wait for, and shut the engine's pool down; the
    # removal queued after failed on that pool, and the container and its directory stayed until the lease ended
    backend = await DockerBackend.start(DockerBackendConfig(owner=TEST_OWNER, socket_root=socket_root), sweep=False)
    closing: asyncio.Task[None] | None = None
    try:
        sb = await backend.create(SandboxSpec(image=base_image))
        closing_transport, go_on = asyncio.Event(), asyncio.Event()
        close_transport = sb.transport.close

        async def slow_close() -> None:
            closing_transport.set()
            await go_on.wait()
            await close_transport()

        sb.transport.close = slow_close  # type: ignore[method-assign]
        releasing = asyncio.create_task(sb.release())
        await closing_transport.wait()
        closing = asyncio.create_task(backend.close())
        # close() returns at once when it skips the release (the bug), or waits for it: the transport then finishes
        await asyncio.wait([closing], timeout=2)
        go_on.set()
        await asyncio.wait_for(asyncio.gather(closing, releasing), timeout=60)
        assert not docker_client.api.containers(all=True, filters={"id": sb.id}), "close() left the container"
        assert sorted(os.listdir(socket_root)) == [".seal-key"], "close() left the socket directory"
    finally:
        if closing is None:
            await backend.close()
        for c in owned_containers():  # what a failed test left
            c.remove(force=True)


async def test_a_cancelled_close_lets_the_removals_it_waited_for_finish(
    base_image: str, socket_root: Path, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a stop stage that runs out of time cancels close() while it waits for a released sandbox's removal: that
    # cancel reached the removal itself, which stopped after the engine call and before the socket directory (a
    # later close's sweep finds no container by then, and a young directory is no orphan)
    backend = await DockerBackend.start(DockerBackendConfig(owner=TEST_OWNER, socket_root=socket_root), sweep=False)
    try:
        sb = await backend.create(SandboxSpec(image=base_image))
        at_remove, removed = threading.Event(), threading.Event()
        remove = slowed(backend.api.remove_container, at_remove, removed)
        monkeypatch.setattr(backend.api, "remove_container", remove)
        await sb.release()
        await reached(at_remove)
        closing = asyncio.create_task(backend.close())
        await asyncio.wait([closing], timeout=0.3)  # it waits for the removal, which takes a second
        closing.cancel()
        await asyncio.gather(closing, return_exceptions=True)
        await reached(removed)
    finally:
        await backend.close()  # waits for what is still being removed
        for c in owned_containers():  # what a failed test left
            c.remove(force=True)
    assert not docker_client.api.containers(all=True, filters={"id": sb.id}), "the container is left"
    assert sorted(os.listdir(socket_root)) == [".seal-key"], "the socket directory is left"


async def test_a_docker_exec_command_cancelled_while_the_engine_starts_it_is_killed(
    backend: DockerBackend, base_image: str, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the engine starts the command, and its answer is slow to come back: the cancelled call dropped it, and the
    # command ran on, free of its timeout, until another command's end killed it
    async with await backend.create(SandboxSpec(image=base_image, transport="docker-exec")) as sb:
        at_start, answered = threading.Event(), threading.Event()
        started: list[str] = []
        start = backend.api.exec_start

        def slow_start(exec_id: str, **kwargs: Any) -> Any:
            if not kwargs.get("socket"):  # the kill's own exec
                return start(exec_id, **kwargs)
            started.append(exec_id)
            at_start.set()
            try:
                sock = start(exec_id, **kwargs)
                time.sleep(1)
                return sock
            finally:
                answered.set()

        monkeypatch.setattr(backend.api, "exec_start", slow_start)
        running = asyncio.create_task(sb.exec("sleep 1000"))
        await reached(at_start)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        await reached(answered)
        # the engine answers a start before its process runs: wait until it did, or was killed
        for _ in range(200):
            info = docker_client.api.exec_inspect(started[0])
            if info["Running"] or info["ExitCode"] is not None:
                break
            await asyncio.sleep(0.05)
        top = docker_client.api.top(sb.id, ps_args="-eo pid,args")
        assert not [p for p in top["Processes"] if "sleep 1000" in p[-1]], "the cancelled command still runs"


async def test_close_during_a_create_in_flight_stops_it_and_leaves_nothing(
    base_image: str, socket_root: Path, docker_client: docker.DockerClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a create past the engine's create when close() ran was waited for by nobody: close() shut the engine's pool,
    # the create's next call and its cleanup's failed on it, and the container stayed until the lease ended
    backend = await DockerBackend.start(DockerBackendConfig(owner=TEST_OWNER, socket_root=socket_root), sweep=False)
    at_start = threading.Event()
    monkeypatch.setattr(backend.api, "start", slowed(backend.api.start, at_start))
    creating = asyncio.create_task(backend.create(SandboxSpec(image=base_image)))
    try:
        await reached(at_start)
        await backend.close()
        with pytest.raises(SandboxUnavailableError, match="closed while the sandbox was being created"):
            await creating
        with pytest.raises(SandboxUnavailableError, match="closed"):
            await backend.create(SandboxSpec(image=base_image))
    finally:
        creating.cancel()
        await asyncio.gather(creating, return_exceptions=True)
        for c in owned_containers():  # what a failing run left
            c.remove(force=True)
    assert not owned_containers(), "the create in flight left its container"
    assert sorted(os.listdir(socket_root)) == [".seal-key"], "the create in flight left its socket directory"
