"""The fallback path into a sandbox whose image has no envd: `docker exec` through the engine.

Slower (every call is a round trip through dockerd) but behind the same Transport interface and, where the engine
allows, with envd's exec guarantees, enforced from the host: a wall-clock timeout after which everything the
command started is killed (every process in the sandbox but init and the keeper, stopped first so a fork bomb
cannot outrun it), and the same kill when the command exits and no other exec is running, so no process outlives
its exec; output capped with a truncation flag; stdin streamed; exit status and timed_out measured here, not
guessed from an exit code. What it cannot give: an OOM flag per exec, and concurrent execs in one sandbox are told
apart only by their end (the kill waits for the last; a timeout kills them all). Files move as tar streams through
`tar` inside the sandbox, which also refuses members that escape the destination.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import posixpath
import socket
import struct
import tarfile
from collections.abc import AsyncIterator, Mapping
from typing import Any

import docker.errors

from orchestrator.backends.docker.backend import DockerBackend
from orchestrator.core.errors import (
    SandboxCreateError,
    SandboxFileError,
    SandboxFileNotFoundError,
    SandboxUnavailableError,
)
from orchestrator.core.runtime import to_the_end
from orchestrator.core.sandbox import (
    Command,
    ExecEnded,
    ExecEvent,
    ExecOutput,
    ExecStarted,
    FileEntry,
    SandboxSpec,
    Stdin,
    Transport,
)

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_OUTPUT = 1 << 20
# after the command exits (or is killed), how long its pipes are read before the call ends anyway
DRAIN_S = 2.0
# how often the engine is asked whether the command has exited while its output stream is still open
POLL_S = 0.25
# how often the engine is asked whether a command it was told to start runs yet (a kill waits for that)
STARTED_POLL_S = 0.05
READ_CHUNK = 64 << 10
_KIND = {"f": "file", "d": "dir", "l": "symlink"}

# Kill every process but init (1), the keeper ($1) and this shell: SIGSTOP in rounds until no new one shows up (a
# fork bomb cannot outrun it), then SIGKILL in rounds. Only shell builtins, so the sweep forks nothing itself.
SWEEP = r"""
keep=$1; me=$$
sweep() {
  any=
  for d in /proc/[0-9]*; do
    p=${d#/proc/}
    case $p in 1|"$keep"|"$me") continue ;; esac
    kill "-$1" "$p" 2>/dev/null && any=1
  done
  [ -n "$any" ]
}
i=0; while [ $i -lt 200 ] && sweep STOP; do i=$((i + 1)); done
i=0; while [ $i -lt 100 ] && sweep KILL; do i=$((i + 1)); done
"""


class DockerExecTransport(Transport):
    """Commands and files through the engine's exec API."""

    def __init__(self, backend: DockerBackend, cid: str, spec: SandboxSpec) -> None:
        self._backend = backend
        self._cid = cid
        self._spec = spec
        self._keeper = ""  # the container's main process under init: never killed (see start)
        self._running = 0  # commands started or starting: the last to end kills what they left
        self._killing: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Learn the keeper's pid before any command runs (init's only child then); without it no kill is safe, so
        the create fails."""
        code, out = await self._quiet(["cat", "/proc/1/task/1/children"])
        pids = out.split()
        if code != 0 or len(pids) > 1:
            raise SandboxCreateError(f"docker-exec sandbox: cannot tell init's children apart ({out[:200]!r})")
        self._keeper = pids[0].decode() if pids else "1"

    async def _quiet(self, argv: list[str]) -> tuple[int, bytes]:
        """A short command of the transport's own (no timeout handling, no sweep): exit code and stdout."""
        out: list[bytes] = []
        code = -1
        async for ev in self._run(argv, "/", {}, b"", 30.0, 1 << 20, sweep=False):
            if isinstance(ev, ExecOutput) and ev.stream == "stdout":
                out.append(ev.data)
            elif isinstance(ev, ExecEnded):
                code = ev.exit_code
        return code, b"".join(out)

    def _kill(self, started: str = "") -> asyncio.Task[None]:
        """Start killing what the commands left (once exec `started`, if named, has begun: see _has_begun); a
        command that starts meanwhile waits, or it would be killed too."""
        self._killing = asyncio.create_task(self._kill_once_begun(started))
        return self._killing

    async def _kill_once_begun(self, started: str) -> None:
        if not started or await self._has_begun(started):
            await self.kill_leftovers()

    async def _has_begun(self, exec_id: str) -> bool:
        """Whether exec `exec_id` runs or ran, waiting DRAIN_S at most: the engine answers a start before the
        command runs, and a kill that came first would miss it. False: it never began (its start was never sent,
        the caller cancelled before the limiter let it through); an engine that refuses or does not answer counts
        as begun."""
        for _ in range(int(DRAIN_S / STARTED_POLL_S)):
            try:
                info = await self._inspect(exec_id)
            except SandboxUnavailableError:
                return True  # the kill says what is wrong
            if info.get("Running") or info.get("ExitCode") is not None:
                return True
            await asyncio.sleep(STARTED_POLL_S)
        return False

    async def kill_leftovers(self) -> None:
        """Kill every process in the sandbox but init and the keeper (none where the container is gone or stopped:
        the engine refuses the exec, and the command that asked says what became of the sandbox)."""
        argv = ["/bin/sh", "-c", SWEEP, "sweep", self._keeper or "1"]
        # the engine refuses an exec in a container gone (404) or stopped (409 at its create, 500 at its start)
        with contextlib.suppress(SandboxUnavailableError, docker.errors.APIError):
            await self._engine_exec(argv, "/", {}, wait=True)

    async def _inspect(self, exec_id: str) -> dict[str, Any]:
        """The engine's view of exec `exec_id`; SandboxUnavailableError where the engine refuses it (its container
        removed or stopped meanwhile: the raw APIError reached the caller, a rollout's unclassified error)."""
        try:
            info: dict[str, Any] = await self._backend.engine.call(self._backend.api.exec_inspect, exec_id)
        except docker.errors.APIError as e:
            raise SandboxUnavailableError(f"docker exec: the engine cannot say how the command ended: {e}") from e
        return info

    async def _engine_exec(self, argv: list[str], cwd: str, env: Mapping[str, str], *, wait: bool = False) -> Any:
        api = self._backend.api
        created = await self._backend.engine.call(
            api.exec_create,
            self._cid,
            argv,
            stdin=not wait,
            workdir=cwd,
            environment=dict(env),
            user=self._spec.hardening.user,
        )
        if wait:
            return await self._backend.engine.call(api.exec_start, created["Id"])
        try:
            # waited for even when cancelled: a thread cannot be stopped, and the command it starts must be known
            sock = await self._backend.engine.call_to_completion(api.exec_start, created["Id"], socket=True)
        except asyncio.CancelledError:
            # the engine may have started it: it would run on, free of its timeout, until another command's end
            await to_the_end(self._kill(started=created["Id"]))
            raise
        return created["Id"], sock

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
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        limit = timeout or DEFAULT_TIMEOUT_S
        cap = max_output or DEFAULT_MAX_OUTPUT
        async for ev in self._run(argv, cwd or self._spec.workspace, env or {}, stdin, limit, cap, sweep=True):
            yield ev

    async def _run(
        self,
        argv: list[str],
        cwd: str,
        env: Mapping[str, str],
        stdin: Stdin,
        limit: float,
        cap: int,
        *,
        sweep: bool,
    ) -> AsyncIterator[ExecEvent]:
        loop = asyncio.get_running_loop()
        while self._killing is not None and not self._killing.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._killing)
        t0 = loop.time()
        # counted before the engine starts it: a command ending meanwhile must not take this one for a leftover
        self._running += 1
        try:
            exec_id, sock = await self._engine_exec(argv, cwd, env)
        except Exception as e:
            self._running -= 1
            raise SandboxUnavailableError(f"docker exec failed: {e}") from e
        except BaseException:
            self._running -= 1
            raise
        raw: socket.socket = sock._sock
        raw.setblocking(False)
        feeder = asyncio.create_task(_feed(loop, raw, stdin))
        exited = asyncio.create_task(self._exited(exec_id))
        frames = _Frames(loop, raw)
        left, truncated, timed_out, finished = cap, False, False, False
        try:
            yield ExecStarted(0)
            # 1. output until the stream closes, the command exits or its time is up
            async for stream, data in frames.until(exited, t0 + limit):
                keep = data[:left]
                truncated |= len(keep) < len(data)
                left -= len(keep)
                if keep:
                    yield ExecOutput("stdout" if stream == 1 else "stderr", keep)
            timed_out = not exited.done() and loop.time() >= t0 + limit
            # 2. kill what it started (what is left once the last exec ends), then read what is left, briefly
            # the pipes are read while the kill runs: the engine does not finish a killed exec whose output is unread
            killing = None
            if timed_out or (sweep and self._running == 1):
                killing = self._kill()
            async for stream, data in frames.until(None, loop.time() + DRAIN_S):
                keep = data[:left]
                truncated |= len(keep) < len(data)
                left -= len(keep)
                if keep:
                    yield ExecOutput("stdout" if stream == 1 else "stderr", keep)
            frames.close()
            sock.close()  # a holder of the pipes that survived gets EPIPE, and the engine lets the exec end
            if killing is not None:
                await killing
            finished = True
        finally:
            self._running -= 1
            feeder.cancel()
            exited.cancel()
            frames.close()
            sock.close()
            if not finished:  # cancelled or failed: what it started goes
                await to_the_end(self._kill(started=exec_id))
        code = await self._exit_code(exec_id)
        if code > 128 and not timed_out and await self._removed():
            # its sandbox was removed under it: the command's 137 was the sandbox's end, which a scoring command
            # passed on as its reward, 0. One that stopped is left as the command's exit: here the sandbox's own
            # processes can stop it (docker-init passes their signals on), and an unscored retry would be theirs
            raise SandboxUnavailableError(f"docker exec: the sandbox was removed while the command ran (exit {code})")
        sig = code - 128 if code > 128 else 0
        yield ExecEnded(code, sig, timed_out, truncated, False, loop.time() - t0)

    async def _removed(self) -> bool:
        """Whether the sandbox's container is gone or being removed, which only the engine's side can do (the engine
        cannot say: not removed; the next call finds out)."""
        try:
            info = await self._backend.engine.call(self._backend.api.inspect_container, self._cid)
        except docker.errors.NotFound:
            return True
        except (SandboxUnavailableError, docker.errors.APIError):
            return False
        return (info.get("State") or {}).get("Status") in ("removing", "dead")

    async def _exit_code(self, exec_id: str) -> int:
        """The command's exit status from the engine (128 + signal when killed; 137 if it never shows as ended)."""
        for _ in range(int(DRAIN_S / POLL_S)):
            info = await self._inspect(exec_id)
            if not info.get("Running") and info.get("ExitCode") is not None:
                return int(info["ExitCode"])
            await asyncio.sleep(POLL_S)
        return 137

    async def _exited(self, exec_id: str) -> None:
        """Return once the engine says the command's own process has exited (its output may still be held open), or
        that the exec is gone (_exit_code then says so). An engine that fails a poll is polled again: the command's
        deadline bounds the wait."""
        while True:
            await asyncio.sleep(POLL_S)
            try:
                info = await self._inspect(exec_id)
            except SandboxUnavailableError as e:
                if isinstance(e.__cause__, docker.errors.NotFound):
                    return
                continue
            if not info.get("Running"):
                return

    async def _checked(self, argv: list[str], stdin: bytes = b"", max_output: int = 256 << 20) -> bytes:
        """A file command of the transport's own (tar, cat, find): its stdout, or the file error it reported."""
        out: list[bytes] = []
        err: list[bytes] = []
        end: ExecEnded | None = None
        async for ev in self._run(argv, self._spec.workspace, {}, stdin, 120.0, max_output, sweep=False):
            if isinstance(ev, ExecOutput):
                (out if ev.stream == "stdout" else err).append(ev.data)
            elif isinstance(ev, ExecEnded):
                end = ev
        assert end is not None
        if end.exit_code != 0 or end.timed_out:
            msg = b"".join(err).decode(errors="replace").strip()
            if "No such file" in msg or "Cannot stat" in msg:
                raise SandboxFileNotFoundError(msg)
            raise SandboxFileError(msg or f"{argv[0]} exited {end.exit_code}")
        return b"".join(out)

    def _abs(self, path: str) -> str:
        """A relative path starts at the workspace, as envd's do. Its commands got it as written: write_file put a
        relative one under / (a read-only file system), and find read "-delete" as its expression, which emptied
        the working directory."""
        return path if path.startswith("/") else posixpath.join(self._spec.workspace, path)

    async def download(self, path: str) -> bytes:
        parent, _, base = self._abs(path).rstrip("/").rpartition("/")
        return await self._checked(["tar", "-c", "-C", parent or "/", "--", base or "."])

    async def upload(self, tar: bytes, dest_dir: str) -> int:
        dest_dir = self._abs(dest_dir)
        await self._checked(["mkdir", "-p", "--", dest_dir])
        listing = await self._checked(["tar", "-x", "-v", "--no-same-owner", "-C", dest_dir], stdin=tar)
        return len(listing.splitlines())

    async def read_file(self, path: str, max_bytes: int = 0) -> bytes:
        # the path only ever as an argument: in the script's text, a link the policy named `$(...)` ran that
        script = 'test -L "$1" && { echo "$1: is a symbolic link" >&2; exit 1; }; cat -- "$1"'
        return await self._checked(["/bin/sh", "-c", script, "sh", self._abs(path)], max_output=max_bytes or 16 << 20)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True) -> None:
        parent, _, base = self._abs(path).rpartition("/")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo(base)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
        if make_parents:
            await self._checked(["mkdir", "-p", "--", parent or "/"])
        await self.upload(buf.getvalue(), parent or "/")

    async def list_dir(self, path: str) -> list[FileEntry]:
        out = await self._checked(
            ["find", self._abs(path), "-mindepth", "1", "-maxdepth", "1", "-printf", r"%y\t%s\t%m\t%T@\t%l\t%p\0"]
        )
        entries = []
        for rec in out.split(b"\0"):
            if not rec:
                continue
            kind, size, mode, mtime, link, full = rec.decode(errors="replace").split("\t", 5)
            name = full.rsplit("/", 1)[-1]
            entries.append(
                FileEntry(name, full, _KIND.get(kind, "other"), int(size), int(mode, 8), float(mtime), link)  # type: ignore[arg-type]
            )
        return sorted(entries, key=lambda e: e.name)

    async def health(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(timeout):  # not wait_for, which can swallow a cancel on Python 3.11
                code, _ = await self._quiet(["true"])
        except (TimeoutError, SandboxUnavailableError):
            return False
        return code == 0

    async def close(self) -> None:
        return None


async def _feed(loop: asyncio.AbstractEventLoop, raw: socket.socket, stdin: Stdin) -> None:
    """Write stdin as the command reads it (the socket's buffer holds the sender back), then close its stdin."""
    with contextlib.suppress(OSError):
        if isinstance(stdin, bytes):
            if stdin:
                await loop.sock_sendall(raw, stdin)
        else:
            async for chunk in stdin:
                await loop.sock_sendall(raw, chunk)
        raw.shutdown(socket.SHUT_WR)


class _Frames:
    """The engine's multiplexed exec stream (8-byte headers: stream, 0, 0, 0, length), read without blocking."""

    def __init__(self, loop: asyncio.AbstractEventLoop, raw: socket.socket) -> None:
        self._loop = loop
        self._raw = raw
        self._buf = b""
        self._reading: asyncio.Future[bytes] | None = None
        self.closed = False

    async def until(self, stop: asyncio.Future[None] | None, deadline: float) -> AsyncIterator[tuple[int, bytes]]:
        """Frames until the stream closes, `stop` is done or the loop's clock passes `deadline`."""
        while not self.closed:
            while len(self._buf) >= 8:
                stream, size = self._buf[0], struct.unpack(">I", self._buf[4:8])[0]
                if len(self._buf) < 8 + size:
                    break
                data, self._buf = self._buf[8 : 8 + size], self._buf[8 + size :]
                yield stream, data
            if (stop is not None and stop.done()) or self._loop.time() >= deadline:
                return  # a stream that never pauses must not hold the call past its deadline
            if self._reading is None:
                self._reading = asyncio.ensure_future(self._loop.sock_recv(self._raw, READ_CHUNK))
            waits: set[asyncio.Future[Any]] = {self._reading}
            if stop is not None:
                waits.add(stop)
            timeout = max(0.0, deadline - self._loop.time())
            done, _ = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if self._reading in done:
                reading, self._reading = self._reading, None
                try:
                    chunk = reading.result()
                except OSError:
                    chunk = b""
                if not chunk:
                    self.closed = True
                self._buf += chunk
                continue
            return  # stopped or out of time; a read in progress carries over to the next call

    def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
