"""Shared fixtures: a host-side envd, the base image, a docker backend, and a leak check around the whole run.

A test that needs Docker carries the `docker` marker: every test that uses a fixture below that reaches the engine
(docker_client, base_image, backend, and the orchestrator fixtures built on them) gets it here; a test that reaches
the engine another way says so itself. `make test-fast` (pytest -m "not docker") never touches the engine: nothing
here talks to it at import or session start, and the leak check asks it only if a docker test ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest
import trustme

from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig
from orchestrator.backends.docker.sweeper import LABEL_INSTANCE, LABEL_MANAGED, LABEL_OWNER
from orchestrator.backends.envd_transport import EnvdTransport
from orchestrator.core.runtime import limit_malloc_arenas

REPO = Path(__file__).resolve().parent.parent
# Ray clusters of the tests stay on loopback: without this, Ray advertises the host's own network address
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# one owner label per test run, so concurrent runs never touch each other's sandboxes
TEST_OWNER = f"envfleet-test-{uuid.uuid4().hex[:8]}"
# the suite runs its servers in this process: its malloc is set as `envfleet serve` sets its own
limit_malloc_arenas()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEM files made at run time: a CA (`ca`), a server certificate for 127.0.0.1 and localhost signed by it
    (`server_cert`, `server_key`), a client certificate it signed (`client_cert`, `client_key`), and a CA that
    signed none of them (`other_ca`)."""
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1", "localhost"), ca.issue_cert("client@tests")
    files = {
        "ca": ca.cert_pem,
        "server_cert": server.cert_chain_pems[0],
        "server_key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0],
        "client_key": client.private_key_pem,
        "other_ca": trustme.CA().cert_pem,
    }
    paths = {name: d / f"{name}.pem" for name in files}
    for name, blob in files.items():
        blob.write_to_path(str(paths[name]))
    return paths


# pytest-timeout fails a hung test after `timeout` seconds but shows only the threads; an async test hangs in its
# event loop, so every asyncio task's stack is printed shortly before, to say which await never returned.
HANG_DUMP_BEFORE_S = 20.0


def _await_chain(coro: object) -> list[str]:
    """Where a suspended coroutine waits, outermost first (Task.print_stack shows only the outermost frame)."""
    where = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is not None:
            where.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        awaited = (
            getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
        )
        if awaited is not None and not hasattr(awaited, "cr_frame") and not hasattr(awaited, "gi_frame"):
            # an async generator's asend/athrow object (a fixture's teardown), a Task or a Future: name it, and
            # follow the async generator it drives, if any
            where.append(f"  awaiting {awaited!r}"[:300])
            awaited = next((r for r in gc.get_referents(awaited) if inspect.isasyncgen(r)), None)
        coro = awaited
    return where


def _dump_tasks() -> None:
    tasks = asyncio.all_tasks()
    print(f"\n+++ {len(tasks)} asyncio task(s) pending near the test timeout +++", file=sys.stderr)
    for task in tasks:
        print(task.get_name(), *_await_chain(task.get_coro()), sep="\n", file=sys.stderr)


@pytest.fixture
async def _hang_dump(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    timeout = float(request.config.getini("timeout") or 0)
    handle = asyncio.get_running_loop().call_later(max(1.0, timeout - HANG_DUMP_BEFORE_S), _dump_tasks)
    try:
        yield
    finally:
        handle.cancel()


# fixtures that reach the docker engine: a test that uses one (directly or through another fixture) needs Docker
DOCKER_FIXTURES = frozenset({"docker_client", "base_image", "backend"})
DOCKER_TESTS_RAN = pytest.StashKey[bool]()


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if DOCKER_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.docker)
        if inspect.iscoroutinefunction(getattr(item, "obj", None)) and hasattr(item, "fixturenames"):
            item.fixturenames.insert(0, "_hang_dump")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("docker") is not None:
        item.config.stash[DOCKER_TESTS_RAN] = True


# A Dockerfile line for test images whose envd is a stand-in script at /opt/envfleet/envd/launch.py: the compiled
# envd's path runs that script too, so the stand-in is what starts whichever envd the backend asks for
ENVD_IS_LAUNCH_PY = (
    r"""RUN printf '#!/bin/sh\nexec python3 -S /opt/envfleet/envd/launch.py "$@"\n' > /opt/envfleet/bin/envd"""
    " && chmod 755 /opt/envfleet/bin/envd\n"
)


def envd_command(impl: str) -> list[str]:
    """How to start envd on the host: the Python daemon, or the compiled one (built once, cached by its inputs)."""
    if impl == "python":
        return [sys.executable, "-m", "envd"]
    from orchestrator.images.envd_go import build_envd_binary

    return [str(build_envd_binary())]


@pytest.fixture(params=["python", "go"])
def host_envd(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str, Path]]:
    """envd as a real subprocess on the host, each implementation in turn: (socket path, token, workspace)."""
    ws = tmp_path / "ws"
    ws.mkdir()
    sock = tmp_path / "envd.sock"
    token = "test-token"
    (tmp_path / "token").write_text(token)  # envd reads and removes it (the token is never in an environment)
    proc = subprocess.Popen([*envd_command(request.param), "--socket", str(sock), "--workspace", str(ws)], cwd=REPO)
    deadline = time.monotonic() + 20
    while not sock.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("host envd did not start")
        time.sleep(0.02)
    try:
        yield str(sock), token, ws
    finally:
        stop_process(proc)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 5 s; returns once it is reaped."""
    proc.terminate()
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
async def envd_client(host_envd: tuple[str, str, Path]) -> AsyncIterator[EnvdTransport]:
    """A transport connected to the host envd."""
    sock, token, _ = host_envd
    t = EnvdTransport(sock, token)
    for _ in range(100):
        if await t.health(timeout=1):
            break
        await asyncio.sleep(0.02)
    yield t
    await t.close()


@pytest.fixture(scope="session")
def docker_client() -> docker.DockerClient:
    """The local engine; the suite needs one (make test starts it)."""
    client = docker.from_env()
    client.ping()
    return client


@pytest.fixture(scope="session")
def base_image(docker_client: docker.DockerClient) -> str:
    """The envd base image tag, built once (cached by the hash of its inputs)."""
    from orchestrator.images import ensure_base_image

    return ensure_base_image(docker_client)


@contextlib.asynccontextmanager
async def owned_backend(**config: Any) -> AsyncIterator[DockerBackend]:
    """A docker backend owned by the test suite; fails the test if it left a sandbox open, and removes them all."""
    b = await DockerBackend.start(DockerBackendConfig(owner=TEST_OWNER, **config), sweep=False)
    try:
        yield b
    finally:
        owned = await b.list_owned()
        await b.close()
    assert not owned, f"test left {len(owned)} sandbox(es) open: {[s.name for s in owned]}"


@pytest.fixture
async def backend(base_image: str) -> AsyncIterator[DockerBackend]:
    """A docker backend owned by the test suite; every sandbox it made is gone afterwards."""
    async with owned_backend() as b:
        yield b


async def until(check: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Wait until `check()` holds (a bound on a wait, not a speed assert)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not check():
        assert loop.time() < deadline, f"still not {what} after {limit_s:g}s"
        await asyncio.sleep(0.05)


def owned_containers(owner: str = TEST_OWNER, instance: str | None = None) -> list[Any]:
    """The sandbox containers `owner` (of one backend `instance`, when given) has on this host, stopped ones too (one
    removed while listed is skipped)."""
    labels = [f"{LABEL_MANAGED}=1", f"{LABEL_OWNER}={owner}"]
    if instance is not None:
        labels.append(f"{LABEL_INSTANCE}={instance}")
    return docker.from_env().containers.list(  # type: ignore[no-any-return]
        ignore_removed=True, all=True, filters={"label": labels}
    )


@pytest.fixture(scope="session", autouse=True)
def no_leaked_containers(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail the run if any container labelled by the test suite outlives it (asked only if a docker test ran)."""
    yield
    if not request.config.stash.get(DOCKER_TESTS_RAN, False):
        return
    try:
        left = owned_containers()
    except docker.errors.DockerException:
        return
    for c in left:
        c.remove(force=True)
    assert not left, f"leaked containers: {[c.name for c in left]}"
