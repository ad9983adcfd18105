"""The reaper: a detached watchdog per DockerBackend that removes the backend's sandboxes once its owner process is
gone without having closed it.

Sweeps run only inside a live envfleet process on the same engine. An owner that dies without its `finally` blocks
(SIGKILL, the OOM killer, a Ray actor dying with its raylet) left its sandboxes to the next backend started on that
engine and socket root, and where none ever starts again (a Ray node that left the cluster while its machine and
dockerd run on) they stayed forever: a lease counts only to a sweep.

`start_reaper` launches this file as a script, detached: a grandchild of the owner in a session of its own, so that
neither a signal to the owner's process group or session, nor Ray's kill of an exiting worker's children or process
group, nor the owner's death reaches it. It waits for the owner's exit on a pidfd (polling every 2 s where the kernel
has none) importing nothing heavy, then removes the containers of that backend instance whose seal the socket root's
key verifies, with their socket directories, and exits. A backend that closes dismisses its reaper through a pipe.
It never acts on another instance's containers, nor on a label it cannot verify.
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.core.processes import owner_alive

# What the reaper imports before its owner is gone is all it holds while it waits (about 12 MB resident, a bare
# interpreter's 11): asyncio (8 MB more), the docker SDK and pydantic (50 MB more) are imported where they are used.
if TYPE_CHECKING:
    from orchestrator.backends.docker.backend import DockerBackend
    from orchestrator.backends.docker.sweeper import Owner

log = logging.getLogger(__name__)

POLL_S = 2.0  # how often the owner is looked at where there is no pidfd
ENGINE_TRIES = 5  # an engine that does not answer is asked again after 1, 2, 4 and 8 s, then the reaper gives up
ENGINE_TIMEOUT_S = 30.0  # one engine call; the reaper has all the time it needs, but not forever
# a create the owner had begun may be finished by the engine after the owner died: looked for once more, after this
SETTLE_S = 3.0
REAPER_OWNER = "envfleet-reaper"  # the owner label of the reaper's own backend (it creates nothing)


class Reaper:
    """A backend's reaper as its owner sees it: its pid, and the pipe that dismisses it."""

    def __init__(self, pid: int, dismiss_fd: int) -> None:
        self.pid = pid
        self._dismiss_fd: int | None = dismiss_fd

    def dismiss(self) -> None:
        """The backend closed cleanly: the reaper exits at once and removes nothing. A second call does nothing."""
        fd, self._dismiss_fd = self._dismiss_fd, None
        if fd is None:
            return
        try:
            os.write(fd, b"closed")
        except BrokenPipeError:
            log.debug("reaper %d was gone already", self.pid)
        finally:
            os.close(fd)


async def start_reaper(backend: DockerBackend) -> Reaper | None:
    """Launch the reaper of `backend` (before it creates a sandbox); None where none could be launched: the backend
    works without it, and the next backend started on the same engine and socket root sweeps what it leaves."""
    import asyncio

    # launching waits for an interpreter to start (tens of ms): not on the event loop
    return await asyncio.to_thread(launch, backend.owner, backend.sockets.root, backend.config.base_url)


def launch(owner: Owner, socket_root: Path, engine: str | None) -> Reaper | None:
    """Start the reaper of backend instance `owner` and return once it is detached (blocking)."""
    if not owner.start:
        log.warning("no reaper for backend %s: the start time of process %d is unknown", owner.instance, owner.pid)
        return None
    # the script by its path, with -P: `-m` would import the docker package's __init__ (the docker SDK, pydantic),
    # 50 MB held for as long as the owner lives
    argv = [sys.executable, "-P", str(Path(__file__).resolve()), "--detach", "--owner", owner.name]
    argv += ["--owner-pid", str(owner.pid), "--owner-start", owner.start, "--instance", owner.instance]
    argv += ["--socket-root", os.path.abspath(socket_root)]
    if engine:  # else DOCKER_HOST and its TLS settings, inherited: the engine reached as the backend reaches it
        argv += ["--engine", engine]
    # the reaper runs in /: the owner's import path made absolute, and where this orchestrator is imported from last
    # (a Ray worker may have it from its working_dir alone)
    env = dict(os.environ)
    path = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*path, str(_import_root())])
    dismiss_r, dismiss_w = os.pipe()
    argv += ["--dismiss-fd", str(dismiss_r)]
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # the detached reaper's pid, then nothing (it moves to /dev/null)
            pass_fds=(dismiss_r,),
            start_new_session=True,
            cwd="/",
            env=env,
        )
    except OSError as e:
        os.close(dismiss_w)
        log.warning("no reaper for backend %s: %s", owner.instance, e)
        return None
    finally:
        os.close(dismiss_r)
    assert proc.stdout is not None
    with proc.stdout:
        line = proc.stdout.readline()
    proc.wait()  # the intermediate exits as soon as it has forked: no zombie of ours stays
    if not line.strip().isdigit():
        os.close(dismiss_w)
        log.warning("no reaper for backend %s: it exited with %s before it detached", owner.instance, proc.returncode)
        return None
    return Reaper(int(line), dismiss_w)


def _import_root() -> Path:
    """The directory the `orchestrator` package is imported from."""
    return Path(__file__).resolve().parents[3]


def wait_for_owner(pid: int, start: str, dismiss_fd: int | None) -> bool:
    """Block until process `pid` started at `start` is gone (True) or its backend dismisses us (False)."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    except OSError as e:  # no pidfd here (an old kernel, a seccomp profile that refuses it)
        log.debug("no pidfd for process %d (%s): polling it every %gs", pid, e, POLL_S)
        pidfd = None
    try:
        # checked after the pidfd is open: the pidfd then refers to the owner, not to a process given its pid since
        if not owner_alive(pid, start):
            return True
        poller = select.poll()
        if pidfd is not None:
            poller.register(pidfd, select.POLLIN)
        if dismiss_fd is not None:
            poller.register(dismiss_fd, select.POLLIN)
        timeout_ms = None if pidfd is not None else int(POLL_S * 1000)
        while True:
            for fd, _ in poller.poll(timeout_ms):
                if fd == pidfd:
                    return True
                if os.read(fd, 64):
                    return False
                # end of file and no word: every writer closed it, which the owner's exit does too, and so does a
                # fork of the owner; the owner's own exit is what counts
                poller.unregister(fd)
            if pidfd is None and not owner_alive(pid, start):
                return True
    finally:
        if pidfd is not None:
            os.close(pidfd)


async def reap(instance: str, socket_root: Path, engine: str | None) -> int:
    """Remove the sealed containers of backend `instance` and their socket directories; how many there were."""
    import asyncio

    from orchestrator.backends.docker.socket_dirs import KEY_FILE

    if not (socket_root / KEY_FILE).is_file():  # SocketDirs would make a new key, which verifies nothing of ours
        log.warning("no seal key in %s: nothing of backend %s can be verified, none removed", socket_root, instance)
        return 0
    # imported only now: the docker SDK and pydantic weigh some 50 MB, which the reaper need not hold while it waits
    from orchestrator.backends.docker.backend import DockerBackend, DockerBackendConfig

    config = DockerBackendConfig(
        owner=REAPER_OWNER, socket_root=socket_root, base_url=engine, api_timeout_s=ENGINE_TIMEOUT_S
    )
    # not DockerBackend.start: its sweep (and its close's) would judge every owner on this engine, and it would
    # launch a reaper of its own
    backend = DockerBackend(config)
    try:
        removed = await _remove_instance(backend, instance)
        await asyncio.sleep(SETTLE_S)
        return removed + await _remove_instance(backend, instance)
    finally:
        backend.engine.close()


async def _remove_instance(backend: DockerBackend, instance: str) -> int:
    """One pass of reap: list the instance's containers, remove those whose seal verifies."""
    import asyncio

    from orchestrator.backends.docker.sweeper import LABEL_INSTANCE, LABEL_MANAGED, LABEL_SEAL

    engine = backend.engine
    containers = await engine.call(
        engine.api.containers, all=True, filters={"label": [f"{LABEL_MANAGED}=1", f"{LABEL_INSTANCE}={instance}"]}
    )
    doomed: list[tuple[str, str]] = []
    for c in containers:
        labels = c.get("Labels") or {}
        name = (c.get("Names") or ["/?"])[0].lstrip("/")
        if labels.get(LABEL_INSTANCE) != instance:
            continue
        if not backend.sockets.verify(name, labels.get(LABEL_SEAL, "")):
            log.warning("not removing %s: its labels are not sealed by the key of %s", name, backend.sockets.root)
            continue
        log.info("removing %s (its owner is gone)", name)
        doomed.append((c["Id"], name))
    outcomes = await asyncio.gather(*(backend.discard(cid, name) for cid, name in doomed), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
    return len(doomed)


async def reap_with_retries(instance: str, socket_root: Path, engine: str | None) -> int | None:
    """reap, asked again with backoff while the engine does not answer; None once it never did."""
    import asyncio

    from docker.errors import DockerException

    from orchestrator.core.errors import ConfigError, SandboxError

    delay = 1.0
    for attempt in range(1, ENGINE_TRIES + 1):
        try:
            return await reap(instance, socket_root, engine)
        except ConfigError as e:  # the socket root is not ours: asking again changes nothing
            log.error("left the sandboxes of backend %s: %s", instance, e)
            return None
        except (SandboxError, DockerException, OSError) as e:
            if attempt == ENGINE_TRIES:
                log.error(
                    "gave up on the sandboxes of backend %s after %d tries: the engine did not answer: %s",
                    instance,
                    attempt,
                    e,
                )
                return None
            log.warning("the engine did not answer (%s); asking again in %gs", e, delay)
            await asyncio.sleep(delay)
            delay *= 2
    return None


def _detach() -> None:
    """Fork; the parent says the child's pid on stdout and exits, so the reaper is nobody's child (an exiting Ray
    worker kills its children) and its launcher waits for nothing."""
    pid = os.fork()
    if pid:
        os.write(1, f"{pid}\n".encode())
        os._exit(0)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The reaper's command line (start_reaper writes it)."""
    p = argparse.ArgumentParser(description="Remove a backend instance's sandboxes once its owner process is gone.")
    p.add_argument("--owner", default="", help="the owner's name, for the log")
    p.add_argument("--owner-pid", type=int, required=True)
    p.add_argument("--owner-start", required=True, help="the owner's start time (/proc/PID/stat field 22)")
    p.add_argument("--instance", required=True, help="the backend instance whose sandboxes are removed")
    p.add_argument("--socket-root", type=Path, required=True, help="the socket root, whose key verifies the seals")
    p.add_argument("--engine", default=None, help="the engine's address (default: DOCKER_HOST or the local socket)")
    p.add_argument("--dismiss-fd", type=int, default=None, help="a pipe: a word on it dismisses the reaper")
    p.add_argument("--detach", action="store_true", help="fork, print the reaper's pid and return")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Entry point: wait for the owner, then remove what it left."""
    args = parse_args(argv)
    if not args.owner_start:
        print("reaper: --owner-start is empty: a gone owner could not be told from a live one", file=sys.stderr)
        return 2
    if args.detach:
        _detach()
    if not wait_for_owner(args.owner_pid, args.owner_start, args.dismiss_fd):
        return 0
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s envfleet-reaper[{os.getpid()}] %(levelname)s %(message)s",
        stream=sys.stderr,
    )
    import asyncio

    began = time.monotonic()
    removed = asyncio.run(reap_with_retries(args.instance, args.socket_root, args.engine))
    if removed is None:
        return 1
    log.info(
        "owner %s (pid %d) is gone: removed %d sandbox(es) of backend %s in %.1fs",
        args.owner,
        args.owner_pid,
        removed,
        args.instance,
        time.monotonic() - began,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
