"""The Docker backend: hardened containers on a local engine, reached through envd (or `docker exec`).

The docker SDK is synchronous, so every engine call runs in a bounded thread pool and the event loop never blocks.
Each container carries labels naming its owner process and lease, so a sweep (at start and periodically) removes
what a crashed owner left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import docker
import docker.errors
import requests
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.backends.docker.call_limiter import CallLimiter, Permit
from orchestrator.backends.envd_transport import EnvdTransport
from orchestrator.core.errors import (
    LimitNotAppliedError,
    SandboxCreateError,
    SandboxDiedError,
    SandboxError,
    SandboxStartTimeoutError,
    SandboxUnavailableError,
)
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
    Transport,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

LABEL_MANAGED = "envfleet.managed"
LABEL_OWNER = "envfleet.owner"
LABEL_INSTANCE = "envfleet.instance"
LABEL_PID = "envfleet.owner_pid"
LABEL_PID_START = "envfleet.owner_start"
LABEL_HOST = "envfleet.host"
LABEL_LEASE = "envfleet.lease_expiry"
LABEL_SOCKET_DIR = "envfleet.socket_dir"
ENVD_MOUNT = "/run/envd"
# -OO: no docstrings or asserts in envd and its libraries, about 0.9 MB less per sandbox (the base image holds the
# matching .opt-2.pyc files, since the root filesystem is read-only)
ENVD_COMMAND = ["python3", "-S", "-OO", "/opt/envfleet/envd/launch.py", "--socket", f"{ENVD_MOUNT}/envd.sock"]
LIMIT_WARNING_WORDS = ("limit", "memory", "swap", "cpu", "pids", "discarded", "not support")
# how an engine that does not answer shows in the SDK
ENGINE_SILENT = (requests.exceptions.ConnectionError, requests.exceptions.Timeout)


class DockerBackendConfig(BaseModel):
    """Settings of the docker backend."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["docker"] = "docker"
    base_url: str | None = Field(None, description="engine address; DOCKER_HOST or the local socket when unset")
    owner: str = Field("envfleet", min_length=1, max_length=64, description="who owns the sandboxes (a label)")
    socket_root: Path = Field(default_factory=lambda: Path(tempfile.gettempdir()) / "envfleet")
    api_workers: int = Field(
        16, ge=1, le=256, description="threads (and HTTP connections) for engine calls; the most in flight at once"
    )
    api_timeout_s: float = Field(120.0, gt=0)
    sweep_interval_s: float = Field(30.0, gt=0)
    health_interval_s: float = Field(1.0, gt=0, description="how often the engine is pinged")
    health_timeout_s: float = Field(2.0, gt=0, description="a ping slower than this marks the engine unhealthy")
    # Fifty sandboxes at once peak near 75 engine calls/s here (the engine manages 4-5 creates/s; each sandbox is a
    # create, a start, a state check per second while it starts, a remove): 200/s never holds a healthy engine back
    # and stops only a runaway loop. A burst of 50 lets fifty creates begin at once.
    api_rate_per_s: float = Field(200.0, gt=0, description="engine calls started per second, at most")
    api_burst: int = Field(50, ge=1, description="engine calls that may start at once after a quiet spell")
    api_slow_factor: float = Field(
        3.0, gt=1, description="a call this many times slower than the recent average of its kind cuts the limit"
    )
    api_slow_min_s: float = Field(
        0.5, ge=0, description="calls quicker than this never count as slow (jitter on a busy host is no stall)"
    )
    api_max_backoff_s: float = Field(5.0, ge=0, description="longest pause of new calls while the engine fails")


def process_host() -> str:
    """Where this process's pids mean something: the host name and the pid namespace. An orchestrator in a container
    (`--network host` gives it the host's name) and one on the host then never judge each other's owners gone."""
    try:
        namespace = os.readlink("/proc/self/ns/pid").removeprefix("pid:")
    except OSError:
        namespace = ""
    return f"{socket.gethostname()}{namespace}"


def _proc_start_time(pid: int) -> str:
    """The kernel's start time of a process (clock ticks since boot), which tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return ""
    return raw[raw.rfind(b")") + 2 :].split()[19].decode()


def owner_alive(pid: int, start: str) -> bool:
    """Whether the process that created a sandbox still runs (same pid and same start time)."""
    return bool(start) and _proc_start_time(pid) == start


@dataclass(frozen=True)
class Owner:
    """The identity this backend instance writes into every container's labels."""

    name: str
    instance: str
    pid: int
    start: str
    host: str

    @classmethod
    def current(cls, name: str) -> Owner:
        """This process."""
        pid = os.getpid()
        return cls(name, uuid.uuid4().hex, pid, _proc_start_time(pid), process_host())


class DockerSandbox(Sandbox):
    """A running container and the transport into it."""

    def __init__(
        self, backend: DockerBackend, cid: str, name: str, spec: SandboxSpec, transport: Transport, socket_dir: Path
    ) -> None:
        self.id = cid
        self.name = name
        self.spec = spec
        self.transport = transport
        self.socket_dir = socket_dir
        self.lease_expiry = time.time() + spec.ttl_s
        self._backend = backend
        self._closed = False

    async def _diagnose(self, e: SandboxUnavailableError) -> SandboxError:
        """Tell a dead container (killed from outside, OOM) from a merely unresponsive envd."""
        try:
            st = await self.state()
        except SandboxError:
            return e
        if st.running:
            return e
        cause = "killed by the OOM killer" if st.oom_killed else "stopped from outside"
        return SandboxDiedError(f"sandbox {self.name} is gone ({cause}; exit code {st.exit_code}) {st.error}".strip())

    async def _guard(self, coro: Any) -> Any:
        if self._closed:
            raise SandboxDiedError(f"sandbox {self.name} was closed")
        try:
            return await coro
        except SandboxUnavailableError as e:
            raise await self._diagnose(e) from e

    async def exec(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes = b"",
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> ExecResult:
        result: ExecResult = await self._guard(
            self.transport.exec(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output)
        )
        return result

    async def exec_stream(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: bytes = b"",
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> AsyncIterator[ExecEvent]:
        if self._closed:
            raise SandboxDiedError(f"sandbox {self.name} was closed")
        stream = self.transport.exec_stream(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output)
        try:
            async for ev in stream:
                yield ev
        except SandboxUnavailableError as e:
            raise await self._diagnose(e) from e
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def read_file(self, path: str, max_bytes: int = 0) -> bytes:
        data: bytes = await self._guard(self.transport.read_file(path, max_bytes))
        return data

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True) -> None:
        await self._guard(self.transport.write_file(path, data, mode, make_parents))

    async def list_dir(self, path: str) -> list[FileEntry]:
        entries: list[FileEntry] = await self._guard(self.transport.list_dir(path))
        return entries

    async def upload(self, tar: bytes, dest_dir: str) -> int:
        count: int = await self._guard(self.transport.upload(tar, dest_dir))
        return count

    async def download(self, path: str) -> bytes:
        data: bytes = await self._guard(self.transport.download(path))
        return data

    async def state(self) -> SandboxState:
        return await self._backend.state_of(self.id)

    async def reset(self, workspace_seed: str = "") -> ResetOutcome:
        if self._closed:
            return ResetOutcome(False, "closed")
        if time.time() > self.lease_expiry - 60:
            return ResetOutcome(False, "its lease is about to expire")
        return await self.transport.reset(workspace_seed)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.transport.close()
        await self._backend.destroy(self.id, self.socket_dir)

    async def release(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.transport.close()
        self._backend.destroy_later(self.id, self.socket_dir)


class DockerBackend(SandboxBackend):
    """Hardened sandboxes on a Docker engine. Use `await DockerBackend.start(config)`; `close()` destroys all."""

    def __init__(self, config: DockerBackendConfig | None = None) -> None:
        self.config = config or DockerBackendConfig()
        self.owner = Owner.current(self.config.owner)
        self._pool = ThreadPoolExecutor(max_workers=self.config.api_workers, thread_name_prefix="docker-api")
        # engine calls in flight and their pace; its counters are what a status page would show
        self.limiter = CallLimiter(
            max_limit=self.config.api_workers,
            rate_per_s=self.config.api_rate_per_s,
            burst=self.config.api_burst,
            slow_factor=self.config.api_slow_factor,
            slow_min_s=self.config.api_slow_min_s,
            max_backoff_s=self.config.api_max_backoff_s,
        )
        kwargs: dict[str, Any] = {"timeout": self.config.api_timeout_s, "max_pool_size": self.config.api_workers}
        if self.config.base_url:
            kwargs["base_url"] = self.config.base_url
            self.client = docker.DockerClient(**kwargs)
        else:
            self.client = docker.from_env(**kwargs)
        self.api = self.client.api
        self._owned: dict[str, DockerSandbox] = {}
        self._removals: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._swap_limit: bool | None = None
        self._creating: set[str] = set()
        self.engine_errors = 0
        self.engine_healthy = True
        self._health_listeners: list[Callable[[bool], None]] = []
        self._health_task: asyncio.Task[None] | None = None
        # pings go on their own thread and client, so they answer even when every pool thread waits on a stuck engine
        self._ping_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="docker-ping")
        ping_timeout = max(1, round(self.config.health_timeout_s))
        self._ping_client = (
            docker.DockerClient(base_url=self.config.base_url, timeout=ping_timeout)
            if self.config.base_url
            else docker.from_env(timeout=ping_timeout)
        ).api

    @classmethod
    async def start(cls, config: DockerBackendConfig | None = None, *, sweep: bool = True) -> DockerBackend:
        """A backend that has swept what dead owners left and keeps sweeping in the background."""
        backend = cls(config)
        info = await backend._call(backend.api.info)
        backend._swap_limit = bool(info.get("SwapLimit"))
        if sweep:
            await backend.sweep()
            backend._sweeper = asyncio.create_task(backend._sweep_forever())
        backend._health_task = asyncio.create_task(backend._watch_engine())
        return backend

    def on_engine_health(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(healthy)` whenever the engine starts or stops answering."""
        self._health_listeners.append(listener)

    async def _watch_engine(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11, wait_for returns the ping's result when the cancel of
            # close() arrives just as the ping ends, and the loop would then ping forever with close() waiting on it
            try:
                async with asyncio.timeout(self.config.health_timeout_s + 1):
                    await loop.run_in_executor(self._ping_pool, self._ping_client.ping)
                healthy = True
            except Exception:
                healthy = False
            if healthy != self.engine_healthy:
                self.engine_healthy = healthy
                log.warning("docker engine is %s", "answering again" if healthy else "NOT answering")
                for listener in self._health_listeners:
                    listener(healthy)
                if healthy:
                    await self._sweep_quietly()  # what the stall left half-created or half-removed
            await asyncio.sleep(self.config.health_interval_s)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a blocking engine call on the pool, within the limiter; an engine that does not answer is an
        infrastructure error."""
        running = await self._submit(fn, *args, **kwargs)
        return await self._outcome(fn, asyncio.wrap_future(running))

    async def _call_to_completion(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Like _call, but a caller cancelled once the call has started still waits for it to finish, so that
        whatever it created is known and can be removed (a thread cannot be cancelled; its container would leak).
        Cancelled while still waiting for the limiter, nothing was started and the caller leaves at once."""
        running = asyncio.wrap_future(await self._submit(fn, *args, **kwargs))
        try:
            return await self._outcome(fn, asyncio.shield(running))
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await running
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
            return await running
        except ENGINE_SILENT as e:
            self.engine_errors += 1
            raise SandboxUnavailableError(
                f"the docker engine did not answer {getattr(fn, '__name__', 'a call')} "
                f"within {self.config.api_timeout_s:g}s: {e}"
            ) from e

    async def _logs_tail(self, cid: str, lines: int = 20) -> str:
        try:
            raw = await self._call(self.api.logs, cid, stdout=True, stderr=True, tail=lines)
        except docker.errors.APIError:
            return "(no logs)"
        text: str = raw.decode(errors="replace").strip() if isinstance(raw, bytes) else str(raw)
        return text or "(no output)"

    def _labels(self, spec: SandboxSpec, socket_dir: Path) -> dict[str, str]:
        o = self.owner
        return {
            **spec.labels,
            LABEL_MANAGED: "1",
            LABEL_OWNER: o.name,
            LABEL_INSTANCE: o.instance,
            LABEL_PID: str(o.pid),
            LABEL_PID_START: o.start,
            LABEL_HOST: o.host,
            LABEL_LEASE: f"{time.time() + spec.ttl_s:.0f}",
            LABEL_SOCKET_DIR: str(socket_dir),
        }

    def _host_config(self, spec: SandboxSpec, socket_dir: Path | None) -> Any:
        lim, hard = spec.limits, spec.hardening
        uid, gid = hard.user.split(":")
        kwargs: dict[str, Any] = {
            "network_mode": "none",
            "read_only": hard.read_only_root,
            "cap_drop": ["ALL"] if hard.cap_drop_all else None,
            "security_opt": ["no-new-privileges"] if hard.no_new_privileges else None,
            "init": hard.init,
            "pids_limit": lim.pids,
            "mem_limit": f"{lim.memory_mb}m",
            "nano_cpus": int(lim.cpus * 1e9),
            "tmpfs": {
                "/tmp": f"rw,exec,nosuid,nodev,size={lim.tmp_mb}m,mode=1777",
                spec.workspace: f"rw,exec,nosuid,nodev,size={lim.workspace_mb}m,uid={uid},gid={gid},mode=0755",
            },
        }
        if self._swap_limit:
            kwargs["memswap_limit"] = f"{lim.memory_mb}m"  # no swap beyond the memory limit
        if socket_dir is not None:
            kwargs["binds"] = {str(socket_dir): {"bind": ENVD_MOUNT, "mode": "rw"}}
        return self.api.create_host_config(**kwargs)

    async def create(self, spec: SandboxSpec) -> DockerSandbox:
        name = f"envfleet-{uuid.uuid4().hex[:12]}"
        self._creating.add(name)
        try:
            return await self._create(spec, name)
        finally:
            self._creating.discard(name)

    async def _create(self, spec: SandboxSpec, name: str) -> DockerSandbox:
        uid, gid = (int(x) for x in spec.hardening.user.split(":"))
        socket_dir = self.config.socket_root / name
        use_envd = spec.transport == "envd"
        token = secrets.token_urlsafe(24)
        socket_dir.mkdir(parents=True, mode=0o700)
        os.chown(socket_dir, uid, gid)
        cid: str | None = None
        try:
            created = await self._call_to_completion(
                self.api.create_container,
                spec.image,
                command=ENVD_COMMAND if use_envd else ["sleep", "infinity"],
                name=name,
                user=spec.hardening.user,
                working_dir=spec.workspace,
                environment={"ENVD_TOKEN": token, **spec.env} if use_envd else dict(spec.env),
                labels=self._labels(spec, socket_dir),
                host_config=self._host_config(spec, socket_dir if use_envd else None),
                network_disabled=True,
            )
            cid = created["Id"]
            warnings = [w for w in created.get("Warnings") or [] if any(k in w.lower() for k in LIMIT_WARNING_WORDS)]
            if warnings:
                raise LimitNotAppliedError(f"the engine could not apply a limit: {'; '.join(warnings)}")
            await self._call_to_completion(self.api.start, cid)
            transport: Transport
            if use_envd:
                transport = EnvdTransport(str(socket_dir / "envd.sock"), token)
                await self._wait_ready(cid, name, transport, socket_dir / "envd.sock", spec.startup_timeout_s)
            else:
                from orchestrator.backends.docker.exec_fallback import DockerExecTransport

                transport = DockerExecTransport(self, cid, spec)
        except BaseException as e:
            await self._discard(cid or name, socket_dir)
            if isinstance(e, docker.errors.ImageNotFound):
                raise SandboxCreateError(f"image {spec.image!r} not found; build it first") from e
            if isinstance(e, docker.errors.APIError):
                raise SandboxCreateError(f"docker refused to create the sandbox: {e.explanation or e}") from e
            raise
        sandbox = DockerSandbox(self, cid, name, spec, transport, socket_dir)
        self._owned[cid] = sandbox
        return sandbox

    async def _wait_ready(self, cid: str, name: str, transport: Transport, sock: Path, deadline_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + deadline_s
        # the engine is asked about the container only now and then: under load, extra inspects slow every create
        next_state_check = loop.time() + 1.0
        delay = 0.002
        while True:
            if sock.exists() and await transport.health(timeout=max(0.05, min(2.0, deadline - loop.time()))):
                return
            now = loop.time()
            if now >= deadline:
                await transport.close()
                tail = await self._logs_tail(cid)
                raise SandboxStartTimeoutError(
                    f"sandbox {name}: envd did not become healthy within {deadline_s:g}s; last log lines:\n{tail}"
                )
            if now >= next_state_check:
                next_state_check = now + 1.0
                st = await self.state_of(cid)
                if not st.running:
                    await transport.close()
                    tail = await self._logs_tail(cid)
                    raise SandboxCreateError(
                        f"sandbox {name} exited during startup (exit code {st.exit_code}); last log lines:\n{tail}"
                    )
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.05)

    async def state_of(self, cid: str) -> SandboxState:
        """The engine's view of a container."""
        try:
            info = await self._call(self.api.inspect_container, cid)
        except docker.errors.NotFound:
            return SandboxState(running=False, exit_code=None, oom_killed=False, error="container no longer exists")
        except docker.errors.APIError as e:
            raise SandboxUnavailableError(f"docker engine: {e.explanation or e}") from e
        st = info["State"]
        return SandboxState(
            running=bool(st.get("Running")),
            exit_code=st.get("ExitCode"),
            oom_killed=bool(st.get("OOMKilled")),
            error=st.get("Error") or "",
        )

    def destroy_later(self, cid: str, socket_dir: Path) -> None:
        """Destroy in the background; close() waits for every such removal."""
        task = asyncio.create_task(self.destroy(cid, socket_dir), name=f"destroy {cid[:12]}")
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def destroy(self, cid: str, socket_dir: Path) -> None:
        """Remove a container (force) and its socket directory."""
        self._owned.pop(cid, None)
        await self._discard(cid, socket_dir)

    async def _discard(self, cid: str | None, socket_dir: Path) -> None:
        if cid is not None:
            try:
                removal = asyncio.ensure_future(self._call(self.api.remove_container, cid, force=True, v=True))
                # if our caller is cancelled the removal still finishes; its outcome is then read here, not lost
                removal.add_done_callback(lambda t: t.cancelled() or t.exception())
                await asyncio.shield(removal)
            except docker.errors.NotFound:
                pass
            except docker.errors.APIError as e:
                if "already in progress" not in str(e):
                    log.warning("could not remove container %s: %s", cid[:12], e)
        shutil.rmtree(socket_dir, ignore_errors=True)

    async def list_owned(self) -> list[SandboxInfo]:
        return [
            SandboxInfo(s.id, s.name, s.spec.image, "running", {LABEL_INSTANCE: self.owner.instance})
            for s in self._owned.values()
        ]

    def _doomed(self, labels: Mapping[str, str], created: float, now: float, older_than: float | None) -> str:
        """Why a managed container should be swept, or '' to keep it."""
        try:
            lease = float(labels.get(LABEL_LEASE, "0"))
        except ValueError:
            lease = 0.0
        if lease and lease < now:
            return "lease expired"
        if older_than is not None and now - created > older_than:
            return f"older than {older_than:g}s"
        if labels.get(LABEL_INSTANCE) == self.owner.instance:
            # ours, but neither alive in our hands nor being created: a removal or a create that the engine
            # finished after we had given up on it (it stalled)
            name = labels.get(LABEL_SOCKET_DIR, "").rsplit("/", 1)[-1]
            known = {s.name for s in self._owned.values()} | self._creating
            return "" if name in known else "orphan of this instance"
        if labels.get(LABEL_HOST) != self.owner.host:
            return ""  # another host's owner: we cannot see its processes
        pid = labels.get(LABEL_PID, "")
        if not pid.isdigit() or not owner_alive(int(pid), labels.get(LABEL_PID_START, "")):
            return "owner process is gone"
        return ""

    async def sweep(self, older_than: float | None = None) -> int:
        containers = await self._call(self.api.containers, all=True, filters={"label": f"{LABEL_MANAGED}=1"})
        now = time.time()
        removed = 0
        live_names = set()
        for c in containers:
            labels = c.get("Labels") or {}
            name = (c.get("Names") or ["/?"])[0].lstrip("/")
            reason = self._doomed(labels, float(c.get("Created", now)), now, older_than)
            if not reason:
                live_names.add(name)
                continue
            log.info("sweeping %s (%s)", name, reason)
            own = self._owned.get(c["Id"])
            if own is not None:
                await own.close()
            else:
                await self._discard(c["Id"], Path(labels.get(LABEL_SOCKET_DIR) or self.config.socket_root / name))
            removed += 1
        # socket directories whose container is gone (a crash between mkdir and create)
        with contextlib.suppress(FileNotFoundError):
            for d in self.config.socket_root.iterdir():
                if d.name not in live_names and now - d.stat().st_mtime > 60:
                    shutil.rmtree(d, ignore_errors=True)
        return removed

    async def _sweep_quietly(self) -> None:
        try:
            n = await self.sweep()
            if n:
                log.info("sweep removed %d sandbox(es)", n)
        except SandboxError as e:
            log.warning("sweep failed: %s", e)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            try:
                n = await self.sweep()
                if n:
                    log.info("periodic sweep removed %d sandbox(es)", n)
            except Exception:
                log.exception("periodic sweep failed")

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await asyncio.gather(*(s.close() for s in list(self._owned.values())), return_exceptions=True)
        await asyncio.gather(*list(self._removals), return_exceptions=True)
        await self._sweep_quietly()  # removals the engine dropped while it stalled
        self._pool.shutdown(wait=False)
        self._ping_pool.shutdown(wait=False)
        self._ping_client.close()
        self.client.close()
