"""Create until ready: create and start a hardened container, then wait until envd inside answers its health check.

A create that fails at any step removes whatever it had made; a limit the engine could not apply fails the create.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import docker.errors

from orchestrator.backends.docker.host_config import ENVD_MOUNT, host_config, limit_warnings
from orchestrator.backends.docker.ptys import cap_ptys
from orchestrator.backends.docker.socket_dirs import SOCKET_NAME
from orchestrator.backends.docker.sweeper import labels_for
from orchestrator.backends.envd_transport import EnvdTransport
from orchestrator.core.errors import (
    LimitNotAppliedError,
    SandboxCreateError,
    SandboxStartTimeoutError,
)
from orchestrator.core.sandbox import AUTO_USER, SANDBOX_UIDS, SandboxSpec, Transport
from orchestrator.images import gc

if TYPE_CHECKING:
    from orchestrator.backends.docker.backend import DockerBackend

# the compiled envd (envd/go), or the Python one (-OO: no docstrings or asserts in envd and its libraries, about
# 0.9 MB less per sandbox; the base image holds the matching .opt-2.pyc files, since the root filesystem is
# read-only)
ENVD_COMMANDS = {
    "go": ["/opt/envfleet/bin/envd", "--socket", f"{ENVD_MOUNT}/{SOCKET_NAME}"],
    "python": ["python3", "-S", "-OO", "/opt/envfleet/envd/launch.py", "--socket", f"{ENVD_MOUNT}/{SOCKET_NAME}"],
}


class NameTakenError(SandboxCreateError):
    """Another sandbox has the name (and so the uid) a create picked: it picks again."""


def sandbox_identity(spec: SandboxSpec) -> tuple[str, str]:
    """A new sandbox's container name and its user ("uid:gid").

    With the "auto" user, the name is made of the uid: the engine keeps container names unique, and the socket root
    keeps their directories unique, so two live sandboxes of one host never share a uid (a create that finds its name
    taken picks again, NameTakenError). A spec's own user is shared by each of its sandboxes, whose names are random.
    """
    if spec.hardening.user != AUTO_USER:
        return f"envfleet-{uuid.uuid4().hex[:12]}", spec.hardening.user
    uid = pick_uid()
    return f"envfleet-{uid:012x}", f"{uid}:{uid}"


def pick_uid() -> int:
    """A uid for an "auto" sandbox, at random."""
    return SANDBOX_UIDS[secrets.randbelow(len(SANDBOX_UIDS))]


def _name_taken(e: BaseException) -> bool:
    return isinstance(e, docker.errors.APIError) and e.status_code == 409 and "already in use" in str(e)


async def create_until_ready(
    backend: DockerBackend, spec: SandboxSpec, name: str, user: str
) -> tuple[str, Transport, Path]:
    """Create and start container `name` for `spec`, run as `user` (sandbox_identity); returns its id, a ready
    transport and its socket directory. NameTakenError: another sandbox has the name, and nothing was made."""
    engine = backend.engine
    uid, gid = (int(x) for x in user.split(":"))
    spec = spec.model_copy(update={"hardening": spec.hardening.model_copy(update={"user": user})})
    use_envd = spec.transport == "envd"
    runtime = await backend.runtime_for(spec)  # before anything is made: a missing runtime fails closed
    gc.mark_used(spec.image)  # a tenant's image a sandbox is made from is used: a collection leaves it a while
    token = secrets.token_urlsafe(24)
    try:
        socket_dir = backend.sockets.make(name, uid, gid)
    except FileExistsError:  # a live sandbox's directory, or its create's lock: left as they are
        raise NameTakenError(f"sandbox name {name} is taken") from None
    cid: str | None = None
    transport: Transport | None = None
    try:
        if use_envd:
            backend.sockets.put_token(name, token, uid, gid)
        created = await engine.call_to_completion(
            engine.api.create_container,
            spec.image,
            command=ENVD_COMMANDS[backend.config.envd] if use_envd else ["sleep", "infinity"],
            # what a tenant's image may say runs first or on a timer is not run: an ENTRYPOINT would take envd's
            # command as its arguments, and a HEALTHCHECK is an engine exec on its interval (every sandbox's
            # engine, shared by every tenant); envd is the sandbox's health check
            entrypoint=[""],
            healthcheck={"Test": ["NONE"]},
            name=name,
            user=spec.hardening.user,
            working_dir=spec.workspace,
            # never the token: a container's environment is readable by every process in it (/proc/1/environ)
            environment=dict(spec.env),
            labels=labels_for(backend.owner, spec, backend.sockets.seal(name)),
            host_config=host_config(
                engine.api,
                spec,
                socket_dir if use_envd else None,
                swap_limit=bool(backend.swap_limit),
                nofile=backend.config.nofile,
                runtime=runtime,
            ),
            network_disabled=True,
        )
        cid = created["Id"]
        backend.sockets.created(name)  # the container exists: from here on the sweep sees it, no lock needed
        warnings = limit_warnings(created)
        if warnings:
            raise LimitNotAppliedError(f"the engine could not apply a limit: {'; '.join(warnings)}")
        await engine.call_to_completion(engine.api.start, cid)
        if use_envd:
            transport = EnvdTransport(str(socket_dir / SOCKET_NAME), token)
            await wait_ready(backend, cid, name, transport, spec.startup_timeout_s)
        else:
            from orchestrator.backends.docker.exec_fallback import DockerExecTransport

            fallback = DockerExecTransport(backend, cid, spec)
            await fallback.start()
            transport = fallback
        if backend.config.pty_max and runtime != "runsc":  # gVisor's ptys are its own
            # before the sandbox runs any command: envd has run nothing yet (a few blocking calls: in a thread)
            pid = await asyncio.to_thread(_envd_pid, socket_dir) if use_envd else await _init_pid(backend, cid)
            await asyncio.to_thread(cap_ptys, pid, backend.config.pty_max)
    except BaseException as e:
        # cancelled again while this runs, the cleanup runs to its end all the same, and only then is the cancel raised
        if cid is None:
            # not known to be made (refused, or cancelled in the engine's create, which may then have finished): the
            # container of that name is removed only if it is this backend's own; another's (the 409's, or one a
            # cancel hid) is left alone
            await backend.discard_unknown(name, transport)
            if _name_taken(e):
                raise NameTakenError(f"sandbox name {name} is taken") from None
        else:
            await backend.discard(cid, name, transport)
        if isinstance(e, docker.errors.ImageNotFound):
            gc.note_missing(spec.image)  # removed under disk pressure, say: the next resolve builds it again
            raise SandboxCreateError(f"image {spec.image!r} not found; build it first") from e
        if isinstance(e, docker.errors.APIError):
            raise SandboxCreateError(f"docker refused to create the sandbox: {e.explanation or e}") from e
        raise
    return cid, transport, socket_dir


def _envd_pid(socket_dir: Path) -> int:
    """envd's process on this host: the credentials of its listening socket (SO_PEERCRED), with no engine call."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5.0)
        s.connect(str(socket_dir / SOCKET_NAME))
        pid, _, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    if pid <= 0:
        raise SandboxCreateError(f"envd's socket in {socket_dir} names no process of this host")
    return int(pid)


async def _init_pid(backend: DockerBackend, cid: str) -> int:
    info = await backend.engine.call(backend.api.inspect_container, cid)
    pid = int(info["State"].get("Pid") or 0)
    if pid <= 0:
        raise SandboxCreateError(f"container {cid[:12]} has no process")
    return pid


async def wait_ready(backend: DockerBackend, cid: str, name: str, transport: Transport, deadline_s: float) -> None:
    """Wait until envd answers its health check; a container that exits or a deadline that passes fails the create.

    Nothing connects before envd's socket is there and the directory is locked (taken from the sandbox): a link
    planted where the socket should be is never followed.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    # the engine is asked about the container only now and then: under load, extra inspects slow every create
    next_state_check = loop.time() + 1.0
    delay = 0.002
    locked = False
    while True:
        if not locked and backend.sockets.has_socket(name):
            locked = True
            wrong = backend.sockets.lock(name)
            if wrong:
                raise SandboxCreateError(f"sandbox {name}: {wrong}")
        if locked and await transport.health(timeout=max(0.05, min(2.0, deadline - loop.time()))):
            return
        now = loop.time()
        if now >= deadline:
            await transport.close()
            tail = await backend.engine.logs_tail(cid)
            raise SandboxStartTimeoutError(
                f"sandbox {name}: envd did not become healthy within {deadline_s:g}s; last log lines:\n{tail}"
            )
        if now >= next_state_check:
            next_state_check = now + 1.0
            st = await backend.state_of(cid)
            if not st.running:
                await transport.close()
                tail = await backend.engine.logs_tail(cid)
                raise SandboxCreateError(
                    f"sandbox {name} exited during startup (exit code {st.exit_code}); last log lines:\n{tail}"
                )
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.05)
