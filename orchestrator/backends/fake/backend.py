"""The fake backend: sandboxes that live in this process, with configurable create, exec and destroy latencies.

A sandbox is three small objects (FakeSandbox, its FakeMachine, its MemoryFS) and owns no task or thread, so a fleet
simulation holds thousands in one process. Waiting is `asyncio.sleep`; nothing blocks the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Mapping

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.backends.fake.fs import MemoryFS
from orchestrator.backends.fake.machine import Behaviour, FakeMachine, _Rules
from orchestrator.core.environment import Environment
from orchestrator.core.errors import ImageBuildError, SandboxCreateError, SandboxDiedError
from orchestrator.core.sandbox import (
    Command,
    ExecEvent,
    ExecResult,
    FileEntry,
    ResetOutcome,
    Sandbox,
    SandboxBackend,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    Stdin,
)

log = logging.getLogger(__name__)

LABEL_OWNER = "envfleet.owner"  # the docker backend's label names, so listings read alike


def _image_id(tag: str) -> str:
    return "sha256:" + hashlib.sha256(tag.encode()).hexdigest()


class FakeImages:
    """The fake backend's ImageSource: it names images and builds nothing. An environment without an image spec
    runs on the base image; one with a spec gets a tag hashed from it, after a simulated build (once per process,
    like the docker ImageResolver). Every tag handed out can be created."""

    def __init__(self, base_image: str, extra: tuple[str, ...] = (), build_latency_s: float = 0.0) -> None:
        self.base_image = base_image
        self.build_latency_s = build_latency_s
        self._ids = {tag: _image_id(tag) for tag in (base_image, *extra)}
        self._resolved: dict[str, str] = {}  # env ref -> tag
        self._locks: dict[str, asyncio.Lock] = {}

    def add(self, tag: str) -> str:
        """Make `tag` an existing image; returns it."""
        self._ids.setdefault(tag, _image_id(tag))
        return tag

    def exists(self, tag: str) -> bool:
        """Whether a sandbox of `tag` can be created."""
        return tag in self._ids

    def tag_for(self, name: str, build_inputs: str) -> str:
        """The tag of an environment's image, from its name and what its build would read."""
        digest = hashlib.sha256(build_inputs.encode()).hexdigest()[:12]
        return self.add(f"envfleet/env-{name}:fake-{digest}")

    def ready(self, env: Environment) -> bool:
        """Whether resolve returns at once (it has resolved this environment before)."""
        return env.ref() in self._resolved

    async def resolve(self, env: Environment) -> tuple[str, str]:
        """The environment's tag and id; its own image takes the simulated build latency, the first time."""
        key = env.ref()
        async with self._locks.setdefault(key, asyncio.Lock()):
            if key not in self._resolved:
                self._resolved[key] = await self._name(env)
        tag = self._resolved[key]
        return tag, self._ids[tag]

    async def _name(self, env: Environment) -> str:
        try:
            spec = env.image_spec()
        except Exception as e:  # an environment whose image spec needs a real engine (swe builds its tier here)
            raise ImageBuildError(f"the fake backend cannot name the image of {env.ref()}: {e}") from e
        if spec is None:
            return self.base_image
        if self.build_latency_s:
            await asyncio.sleep(self.build_latency_s)
        return self.tag_for(env.name, spec.model_dump_json())

    def prebuild(self, env: Environment) -> asyncio.Task[None]:
        """A task that is done at once."""

        async def nothing() -> None:
            await self.resolve(env)

        return asyncio.create_task(nothing(), name=f"fake prebuild {env.ref()}")


class FakeSandbox(Sandbox):
    """A fake sandbox: its machine answers commands and holds files; closing it forgets them."""

    def __init__(self, backend: FakeBackend, sid: str, name: str, spec: SandboxSpec, machine: FakeMachine) -> None:
        self.id = sid
        self.name = name
        self.spec = spec
        self.transport = machine  # the warm pool's liveness check asks transport.health
        self.created_at = time.time()
        self._backend = backend
        self._closed = False

    def _guard(self) -> FakeMachine:
        if self._closed:
            raise SandboxDiedError(f"sandbox {self.name} was closed")
        return self.transport

    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: Stdin = b"",
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> ExecResult:
        return await self._guard().exec(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output)

    async def exec_stream(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: Stdin = b"",
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> AsyncIterator[ExecEvent]:
        machine = self._guard()
        async for ev in machine.exec_stream(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output):
            yield ev

    async def read_file(self, path: str, max_bytes: int = 0) -> bytes:
        return await self._guard().read_file(path, max_bytes)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True) -> None:
        await self._guard().write_file(path, data, mode, make_parents)

    async def list_dir(self, path: str) -> list[FileEntry]:
        return await self._guard().list_dir(path)

    async def upload(self, tar: bytes, dest_dir: str) -> int:
        return await self._guard().upload(tar, dest_dir)

    async def download(self, path: str) -> bytes:
        return await self._guard().download(path)

    async def state(self) -> SandboxState:
        if self.transport.alive and not self._closed:
            return SandboxState(running=True, exit_code=None, oom_killed=False)
        return SandboxState(running=False, exit_code=137, oom_killed=False, error="killed" if not self._closed else "")

    async def reset(self, workspace_seed: str = "") -> ResetOutcome:
        if self._closed:
            return ResetOutcome(False, "closed")
        if self._backend.config.reset_latency_s:
            await asyncio.sleep(self._backend.config.reset_latency_s)
        return await self.transport.reset(workspace_seed)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._backend.destroy(self)

    async def release(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._backend.destroy_later(self)


class FakeBackend(SandboxBackend):
    """In-process sandboxes. `close()` destroys every one it still owns."""

    def __init__(self, config: FakeBackendConfig | None = None) -> None:
        self.config = config or FakeBackendConfig()
        self.images = FakeImages(self.config.base_image, self.config.images, self.config.image_build_latency_s)
        self._behaviour = Behaviour(self.config.exec_latency_s, _Rules.of(self.config.rules), self.config.exec_handler)
        self._owned: dict[str, FakeSandbox] = {}
        self._removals: set[asyncio.Task[None]] = set()
        self._closed = False
        self.created = 0  # sandboxes created so far, for tests and simulations

    async def create(self, spec: SandboxSpec) -> FakeSandbox:
        if self._closed:
            raise SandboxCreateError("the fake backend is closed")
        if not self.images.exists(spec.image):
            raise SandboxCreateError(f"image {spec.image!r} not found; build it first")
        if self.config.create_latency_s:
            await asyncio.sleep(self.config.create_latency_s)
        sid = secrets.token_hex(16)
        name = f"envfleet-fake-{sid[:12]}"
        lim = spec.limits
        fs = MemoryFS(spec.workspace, lim.workspace_mb << 20, lim.tmp_mb << 20)
        sandbox = FakeSandbox(self, sid, name, spec, FakeMachine(name, fs, self._behaviour))
        self._owned[sid] = sandbox
        self.created += 1
        return sandbox

    def get(self, sandbox_id: str) -> FakeSandbox:
        """An owned sandbox by id (KeyError if none)."""
        return self._owned[sandbox_id]

    def kill(self, sandbox_id: str) -> None:
        """Simulate a sandbox killed from outside: every later call into it fails with SandboxDiedError."""
        self._owned[sandbox_id].transport.alive = False

    async def destroy(self, sandbox: FakeSandbox) -> None:
        """Forget a sandbox, after the configured destroy latency."""
        self._owned.pop(sandbox.id, None)
        sandbox.transport.alive = False
        if self.config.destroy_latency_s:
            await asyncio.sleep(self.config.destroy_latency_s)

    def destroy_later(self, sandbox: FakeSandbox) -> None:
        """Destroy in the background; close() waits for every such removal."""
        self._owned.pop(sandbox.id, None)  # unusable from now on: no sweep or listing sees it again
        task = asyncio.create_task(self.destroy(sandbox), name=f"destroy {sandbox.name}")
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def list_owned(self) -> list[SandboxInfo]:
        return [
            SandboxInfo(s.id, s.name, s.spec.image, "running", {**s.spec.labels, LABEL_OWNER: self.config.owner})
            for s in self._owned.values()
        ]

    async def sweep(self, older_than: float | None = None) -> int:
        """Remove owned sandboxes whose lease expired (or older than `older_than`); no other owner exists here."""
        now = time.time()
        doomed = [
            s
            for s in self._owned.values()
            if now > s.created_at + s.spec.ttl_s or (older_than is not None and now - s.created_at > older_than)
        ]
        for s in doomed:
            log.info("sweeping %s (lease expired)", s.name)
            await s.close()
        return len(doomed)

    async def close(self) -> None:
        self._closed = True
        await asyncio.gather(*(s.close() for s in list(self._owned.values())), return_exceptions=True)
        await asyncio.gather(*list(self._removals), return_exceptions=True)
