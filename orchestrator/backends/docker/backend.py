"""The Docker backend: hardened containers on a local engine, reached through envd (or `docker exec`).

This module holds the Sandbox and SandboxBackend classes; the work is in its neighbours: engine.py (engine calls
through a limiter on a bounded pool), host_config.py (hardening flags and limits), startup.py (create until envd
is ready) and sweeper.py (labels, owner liveness, leases, removal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import docker.errors

from orchestrator.backends.admission import ExecAdmission
from orchestrator.backends.docker.config import DockerBackendConfig
from orchestrator.backends.docker.engine import Engine
from orchestrator.backends.docker.freezer import Freezer
from orchestrator.backends.docker.ptys import PTY_RESERVE
from orchestrator.backends.docker.reaper import Reaper, start_reaper
from orchestrator.backends.docker.socket_dirs import SocketDirs
from orchestrator.backends.docker.startup import NameTakenError, create_until_ready, sandbox_identity
from orchestrator.backends.docker.sweeper import LABEL_INSTANCE, LABEL_SEAL, Owner, sweep
from orchestrator.backends.pool import TENANT_LABEL
from orchestrator.core.errors import (
    ConfigError,
    LimitNotAppliedError,
    SandboxCreateError,
    SandboxDiedError,
    SandboxError,
    SandboxUnavailableError,
)
from orchestrator.core.runtime import to_the_end
from orchestrator.core.sandbox import (
    Command,
    ExecEvent,
    ExecResult,
    FileEntry,
    Limits,
    ResetOutcome,
    Sandbox,
    SandboxBackend,
    SandboxInfo,
    SandboxSpec,
    SandboxState,
    Stdin,
    Transport,
)

__all__ = ["DockerBackend", "DockerBackendConfig", "DockerSandbox"]

log = logging.getLogger(__name__)
T = TypeVar("T")
# creates that found their picked name (and uid) taken, before one gives up: with 1,000 sandboxes live among the
# 2 million uids, one pick in 2,000 is taken
NAME_TRIES = 8
# how long a failed call waits for the engine to say whether its sandbox died, before it is told "unavailable"
DIAGNOSE_S = 5.0


def engine_security_problem(info: Mapping[str, Any], *, allow_swap: bool = False) -> str:
    """What in the engine's own settings (`docker info`) leaves sandboxes weaker than their hardening says, or "":
    a daemon run with `seccomp-profile: unconfined` (or built without seccomp) started every sandbox with no system
    call filter, and one with no swap accounting let each sandbox swap past its memory limit, and nothing noticed."""
    if not info.get("SwapLimit") and not allow_swap:
        return (
            "the docker engine cannot limit swap (docker info: SwapLimit false; cgroup v1 without swapaccount=1): a "
            "sandbox's memory limit would hold RAM only; enable swap accounting, or set allow_unlimited_swap"
        )
    options = [str(o) for o in info.get("SecurityOptions") or ()]
    seccomp = [o for o in options if o.startswith("name=seccomp")]
    if not seccomp:
        return "the docker engine applies no seccomp profile (docker info: SecurityOptions); sandboxes need its filter"
    if any("profile=unconfined" in o for o in seccomp):
        return (
            "the docker engine's seccomp profile is unconfined (daemon.json seccomp-profile); sandboxes need a "
            "system call filter: remove that setting"
        )
    return ""


# a host of the scheduler's default size (Capacity.max_sandboxes) at the default limits, and room for the host's own
HOST_SANDBOXES = 1024
HOST_OWN_PIDS = 32768


def host_limit_warnings(pty_max: int, read: Callable[[str], int | None] | None = None) -> list[str]:
    """What in the kernel's host-wide counts is short of what HOST_SANDBOXES sandboxes may take: they are one pool
    for every container, so one tenant's sandboxes that take what their limits allow leave none to the host and the
    other tenants (scripts/ensure-docker.sh raises both)."""
    read = read or _sysctl
    warnings = []
    pids = Limits().pids
    need = HOST_SANDBOXES * pids + HOST_OWN_PIDS
    if (have := read("kernel/pid_max")) is not None and have < need:
        warnings.append(
            f"kernel.pid_max is {have}: {have // pids} sandboxes at their default limit of {pids} processes take "
            f"every process id of the host, and then nothing on it can start a process (dockerd, the workers, every "
            f"other tenant's commands); {HOST_SANDBOXES} sandboxes need {need}: sysctl -w kernel.pid_max=4194304"
        )
    need = PTY_RESERVE + HOST_SANDBOXES * pty_max
    if pty_max and (have := read("kernel/pty/max")) is not None and have < need:
        warnings.append(
            f"kernel.pty.max is {have}: {max(0, have - PTY_RESERVE) // pty_max} sandboxes at their pty_max of "
            f"{pty_max} take every pty of the host's containers; {HOST_SANDBOXES} sandboxes need {need}: "
            f"sysctl -w kernel.pty.max=65536"
        )
    return warnings


def _sysctl(name: str) -> int | None:
    try:
        with open(f"/proc/sys/{name}") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _no_runtime(runtime: str, have: frozenset[str]) -> str:
    return (
        f"the docker engine has no OCI runtime {runtime!r} (it has: {', '.join(sorted(have)) or 'none'}); register it "
        f'in /etc/docker/daemon.json under "runtimes" and reload dockerd (SIGHUP), or choose another runtime'
    )


class DockerSandbox(Sandbox):
    """A running container and the transport into it."""

    def __init__(
        self,
        backend: DockerBackend,
        cid: str,
        name: str,
        spec: SandboxSpec,
        transport: Transport,
        socket_dir: Path,
        lease_expiry: float,
    ) -> None:
        self.id = cid
        self.name = name
        self.spec = spec
        self.transport = transport
        self.socket_dir = socket_dir
        self.lease_expiry = lease_expiry  # time.monotonic(): no later than its label's, which the sweep goes by
        self._backend = backend
        self._closed = False
        self._removal: asyncio.Task[None] | None = None
        self._freezer = Freezer.of(cid)

    @property
    def _tenant(self) -> str:
        """Whose turn its execs take (admission)."""
        return self.spec.labels.get(TENANT_LABEL, "")

    def freeze(self) -> bool:
        return not self._closed and self._freezer is not None and self._freezer.freeze()

    def thaw(self) -> None:
        if self._freezer is not None and self._freezer.frozen and not self._freezer.thaw():
            log.warning("sandbox %s could not be thawed", self.name)

    async def _diagnose(self, e: SandboxUnavailableError) -> SandboxError:
        """Tell a dead container (killed from outside, OOM) from a merely unresponsive envd, within DIAGNOSE_S: the
        engine's answer waited out the limiter's queue and its 120 s timeout (a dockerd restarting, hung), and a
        rollout whose deadline fell meanwhile was TIMEOUT, the policy's outcome, where its sandbox had failed."""
        try:
            async with asyncio.timeout(DIAGNOSE_S):
                st = await self.state()
        except (SandboxError, TimeoutError):
            return e
        if st.running:
            return e
        cause = "killed by the OOM killer" if st.oom_killed else "stopped from outside"
        return SandboxDiedError(f"sandbox {self.name} is gone ({cause}; exit code {st.exit_code}) {st.error}".strip())

    async def _guard(self, coro: Any) -> Any:
        if self._closed:
            coro.close()
            raise SandboxDiedError(f"sandbox {self.name} was closed")
        self.thaw()  # a call into a frozen envd would wait out its deadline
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
        stdin: Stdin = b"",
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> ExecResult:
        def call() -> Awaitable[ExecResult]:
            return self._guard(
                self.transport.exec(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output)
            )

        admission = self._backend.admission
        return await (call() if admission is None else admission.run(call, self._tenant))

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
        if self._closed:
            raise SandboxDiedError(f"sandbox {self.name} was closed")
        admission = self._backend.admission
        async with contextlib.nullcontext() if admission is None else admission.place(self._tenant):
            self.thaw()
            stream = self.transport.exec_stream(
                cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output
            )
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
        if time.monotonic() > self.lease_expiry - 60:
            return ResetOutcome(False, "its lease is about to expire")
        self.thaw()
        return await self.transport.reset(workspace_seed)

    def lease_left_s(self) -> float:
        return self.lease_expiry - time.monotonic()

    def _begin_removal(self) -> asyncio.Task[None]:
        """This sandbox's removal, begun on the first call: unusable at once, then its transport closed and its
        container and socket directory removed, in a task of the backend's (its close() waits for it)."""
        if self._removal is None:
            self._closed = True
            self.thaw()  # the kill would thaw it too (runc, cgroup v2); this way no removal depends on that
            self._removal = self._backend.remove_later(self.id, self.name, self.transport)
        return self._removal

    async def close(self) -> None:
        # cancelled meanwhile, once or more, it is removed all the same; the cancel is raised once it is gone
        await to_the_end(self._begin_removal())

    async def release(self) -> None:
        self._begin_removal()


class DockerBackend(SandboxBackend):
    """Hardened sandboxes on a Docker engine. Use `await DockerBackend.start(config)`; `close()` destroys all."""

    def __init__(self, config: DockerBackendConfig | None = None) -> None:
        self.config = config or DockerBackendConfig()
        self.owner = Owner.current(self.config.owner)
        self.sockets = SocketDirs(
            self.config.socket_root, tmpfs=self.config.socket_tmpfs, key_dir=self.config.seal_key_dir
        )
        self.engine = Engine(self.config)
        self.limiter = self.engine.limiter
        self.client = self.engine.client
        self.api = self.engine.api
        self._owned: dict[str, DockerSandbox] = {}
        self._removals: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self.swap_limit: bool | None = None
        self.runtimes: frozenset[str] = frozenset()  # the engine's OCI runtimes, from its info
        self._creating: set[str] = set()
        self._creates: set[asyncio.Task[DockerSandbox]] = set()  # creates under way (close() stops them)
        self._closing = False
        slots = self.config.exec_slots()
        self.admission = ExecAdmission(slots, self.config.exec_admission_hold_s) if slots else None
        self.startups = asyncio.Semaphore(self.config.startup_slots())
        self.engine_healthy = True
        self.outage_wait_s = self.config.engine_outage_wait_s
        self._health_listeners: list[Callable[[bool], None]] = []
        self._health_task: asyncio.Task[None] | None = None
        self._reaper: Reaper | None = None  # removes our sandboxes if this process dies without closing us

    @classmethod
    async def start(cls, config: DockerBackendConfig | None = None, *, sweep: bool = True) -> DockerBackend:
        """A backend that has swept what dead owners left and keeps sweeping in the background."""
        backend = cls(config)
        info = await backend.engine.call(backend.api.info)
        backend.swap_limit = bool(info.get("SwapLimit"))
        backend.runtimes = frozenset(info.get("Runtimes") or ())
        problem = engine_security_problem(info, allow_swap=backend.config.allow_unlimited_swap)
        if backend.config.runtime and backend.config.runtime not in backend.runtimes:
            problem = _no_runtime(backend.config.runtime, backend.runtimes)
        if problem:
            backend.engine.close()
            raise ConfigError(problem)
        for warning in host_limit_warnings(backend.config.pty_max):
            log.warning("%s", warning)
        if sweep:
            await backend.sweep()
            backend._sweeper = asyncio.create_task(backend._sweep_forever())
        backend._health_task = asyncio.create_task(backend._watch_engine())
        if backend.config.reaper:
            backend._reaper = await start_reaper(backend)
        return backend

    @property
    def engine_errors(self) -> int:
        """Engine calls that went unanswered."""
        return self.engine.errors

    def on_engine_health(self, listener: Callable[[bool], None]) -> None:
        """Call `listener(healthy)` whenever the engine starts or stops answering; at once with False when it is
        not answering now (it stopped before the listener came, while the server was still starting)."""
        self._health_listeners.append(listener)
        if not self.engine_healthy:
            listener(False)

    async def _watch_engine(self) -> None:
        while True:
            healthy = await self.engine.ping()
            if healthy != self.engine_healthy:
                self.engine_healthy = healthy
                log.warning("docker engine is %s", "answering again" if healthy else "NOT answering")
                for listener in self._health_listeners:
                    try:
                        listener(healthy)
                    except Exception:  # one listener's bug ends neither the others' news nor this watch
                        log.exception("an engine health listener failed")
                if healthy:
                    await self._sweep_quietly()  # what the stall left half-created or half-removed
            await asyncio.sleep(self.config.health_interval_s)

    async def wait_answering(self, limit_s: float) -> float:
        return await self.engine.wait_answering(limit_s)

    def engine_answering(self) -> bool:
        return self.engine.answering.is_set()

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Blocking work that is more than one engine call: on the pool, outside the limiter (Engine.run_blocking)."""
        return await self.engine.run_blocking(fn, *args, **kwargs)

    async def runtime_for(self, spec: SandboxSpec) -> str:
        """The OCI runtime a sandbox of `spec` runs under (empty: the engine's default); LimitNotAppliedError when the
        engine has no such runtime, so a sandbox never silently runs under a weaker one."""
        runtime = spec.runtime or self.config.runtime
        if runtime and runtime not in self.runtimes:
            # registered since start? runtimes reload with the engine's configuration, without a restart
            info = await self.engine.call(self.api.info)
            self.runtimes = frozenset(info.get("Runtimes") or ())
            if runtime not in self.runtimes:
                raise LimitNotAppliedError(_no_runtime(runtime, self.runtimes))
        return runtime

    async def create(self, spec: SandboxSpec) -> DockerSandbox:
        """A new sandbox; SandboxUnavailableError once the backend is closing. The create runs in a task close()
        stops and waits for: one it did not know of finished after it, on an engine client it had shut."""
        if self._closing:
            raise SandboxUnavailableError("the backend is closed: no new sandbox")
        task = asyncio.create_task(self._create(spec), name="create a sandbox")
        self._creates.add(task)
        task.add_done_callback(self._creates.discard)
        try:
            return await task  # a cancel of the caller cancels the create too
        except asyncio.CancelledError:
            if task.done() and not task.cancelled() and task.exception() is None:
                # made in the turn its caller was cancelled: no one holds it, and it ran until its lease label's
                # expiry (an hour, two days for a session); removed now, in the backend's own task
                task.result()._begin_removal()
            me = asyncio.current_task()
            if task.cancelled() and self._closing and (me is None or not me.cancelling()):
                raise SandboxUnavailableError("the backend closed while the sandbox was being created") from None
            raise

    async def _create(self, spec: SandboxSpec) -> DockerSandbox:
        # the lease as its label will say, before the label is written (whole seconds, rounded): counted from the end
        # of a slow create instead, it ran past the label's, and the sweep removed a sandbox the pool still handed out
        lease_expiry = time.monotonic() + spec.ttl_s - 1
        for tries_left in reversed(range(NAME_TRIES)):
            name, user = sandbox_identity(spec)
            if name in self._creating or any(s.name == name for s in self._owned.values()):
                continue
            self._creating.add(name)
            try:
                async with self.startups:  # the health deadline counts from here: waiting for a turn is not starting
                    cid, transport, socket_dir = await create_until_ready(self, spec, name, user)
                break
            except NameTakenError:
                if not tries_left:
                    raise
            finally:
                self._creating.discard(name)
        else:
            raise SandboxCreateError(f"no free sandbox name in {NAME_TRIES} tries")
        sandbox = DockerSandbox(self, cid, name, spec, transport, socket_dir, lease_expiry)
        self._owned[cid] = sandbox
        return sandbox

    async def state_of(self, cid: str) -> SandboxState:
        """The engine's view of a container."""
        try:
            info = await self.engine.call(self.api.inspect_container, cid)
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

    def remove_later(self, cid: str, name: str, transport: Transport | None = None) -> asyncio.Task[None]:
        """Remove a sandbox in a task of its own, which no cancel reaches and close() waits for: close `transport`,
        then remove container `cid` (force; an id or a name; gone already is fine) and socket directory `name`."""
        task = asyncio.create_task(self._remove(cid, name, transport), name=f"remove {name}")
        self._removals.add(task)
        task.add_done_callback(self._removed)
        return task

    def _removed(self, task: asyncio.Task[None]) -> None:
        self._removals.discard(task)
        if not task.cancelled() and task.exception() is not None:  # read here, so no removal's failure goes unseen
            log.warning("removal of %s failed: %s", task.get_name(), task.exception())

    async def _remove(self, cid: str, name: str, transport: Transport | None) -> None:
        try:
            if transport is not None:
                await transport.close()
        finally:
            self._owned.pop(cid, None)
            try:
                await self._remove_container(cid)
            finally:  # the engine refused or could not be asked: the directory and the create's lock are ours alone
                self.sockets.remove(name)

    async def _remove_container(self, cid: str) -> None:
        try:
            await self.engine.call(self.api.remove_container, cid, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                log.warning("could not remove container %s: %s", cid[:12], e)

    async def discard(self, cid: str, name: str, transport: Transport | None = None) -> None:
        """Remove a sandbox this backend does not hold (see remove_later) and wait until it is gone; cancelled
        meanwhile, the removal still runs to its end, and then the cancel is raised."""
        await to_the_end(self.remove_later(cid, name, transport))

    async def discard_unknown(self, name: str, transport: Transport | None = None) -> None:
        """Clean up a create that failed before its container's id was known: the container named `name` is removed
        only when it is this backend's (its seal and instance: names are made of uids, so another socket root's live
        sandbox may hold the name on this engine), and this create's socket directory is. Runs to its end as
        discard() does."""
        task = asyncio.create_task(self._discard_unknown(name, transport), name=f"remove {name}")
        self._removals.add(task)  # close() waits for it, as for every removal
        task.add_done_callback(self._removed)
        await to_the_end(task)

    async def _discard_unknown(self, name: str, transport: Transport | None) -> None:
        cid = None
        try:
            info = await self.engine.call(self.api.inspect_container, name)
        except docker.errors.NotFound:
            pass
        except Exception as e:  # left to the sweep, which verifies seals
            log.warning("could not look for a container named %s: %s", name, e)
        else:
            labels = (info.get("Config") or {}).get("Labels") or {}
            seal = str(labels.get(LABEL_SEAL, ""))
            if self.sockets.verify(name, seal) and labels.get(LABEL_INSTANCE) == self.owner.instance:
                cid = info["Id"]
        if cid is not None:
            await self._remove(cid, name, transport)
            return
        try:
            if transport is not None:
                await transport.close()
        finally:
            self.sockets.remove(name)

    async def list_owned(self) -> list[SandboxInfo]:
        return [
            SandboxInfo(s.id, s.name, s.spec.image, "running", {LABEL_INSTANCE: self.owner.instance})
            for s in self._owned.values()
        ]

    def owned(self, cid: str) -> DockerSandbox | None:
        """The live sandbox this backend holds under a container id, if any."""
        return self._owned.get(cid)

    def known_names(self) -> set[str]:
        """Names of the sandboxes this backend holds or is creating (the sweep keeps them)."""
        return {s.name for s in self._owned.values()} | self._creating

    async def sweep(self, older_than: float | None = None) -> int:
        return await sweep(self, older_than)

    async def _sweep_quietly(self) -> None:
        """A sweep whose failure is logged: it ended the engine's health watch (an engine's 500 while it listed,
        just after it answered again), and then close() raised it before it removed anything."""
        try:
            n = await self.sweep()
            if n:
                log.info("sweep removed %d sandbox(es)", n)
        except SandboxError as e:
            log.warning("sweep failed: %s", e)
        except Exception:
            log.exception("sweep failed")

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_interval_s)
            await self._sweep_quietly()

    async def close(self) -> None:
        self._closing = True
        for create in list(self._creates):  # each cleans up what it made (a removal, waited for below)
            create.cancel()
        while self._creates:
            await asyncio.wait(list(self._creates))
        for task in (self._health_task, self._sweeper):
            if task is not None:
                task.cancel()
                await asyncio.wait([task])  # whatever it ended with, the sandboxes are removed below
                if not task.cancelled() and task.exception() is not None:
                    log.error("%s had ended with an error", task.get_name(), exc_info=task.exception())
        await asyncio.gather(*(s.close() for s in list(self._owned.values())), return_exceptions=True)
        while self._removals:  # those begun before, and meanwhile; wait, not gather: a cancel of close() is not theirs
            await asyncio.wait(list(self._removals))
        await self._sweep_quietly()  # removals the engine dropped while it stalled
        self.engine.close()
        if self._reaper is not None:  # everything of ours is removed: the reaper has nothing left to do
            self._reaper.dismiss()
