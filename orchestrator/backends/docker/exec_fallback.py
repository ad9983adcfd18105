"""The fallback path into a sandbox whose image has no envd: `docker exec` through the engine.

Slower (every call is a round trip through dockerd) but behind the same Transport interface. Timeouts use
coreutils `timeout`, which signals its whole process group; output is capped on the host side; files move as tar
streams through `tar` inside the sandbox, which also refuses members that escape the destination.
"""

from __future__ import annotations

import asyncio
import io
import shlex
import socket
import tarfile
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from docker.utils.socket import frames_iter

from orchestrator.core.errors import SandboxFileError, SandboxFileNotFoundError, SandboxUnavailableError
from orchestrator.core.sandbox import (
    Command,
    ExecEnded,
    ExecEvent,
    ExecOutput,
    ExecResult,
    ExecStarted,
    FileEntry,
    SandboxSpec,
    Transport,
)

if TYPE_CHECKING:
    from orchestrator.backends.docker.backend import DockerBackend

DEFAULT_TIMEOUT_S = 600.0
DEFAULT_MAX_OUTPUT = 1 << 20
_KIND = {"f": "file", "d": "dir", "l": "symlink"}


class DockerExecTransport(Transport):
    """Commands and files through the engine's exec API."""

    def __init__(self, backend: DockerBackend, cid: str, spec: SandboxSpec) -> None:
        self._backend = backend
        self._cid = cid
        self._spec = spec

    def _run_blocking(
        self, argv: list[str], cwd: str, env: Mapping[str, str], stdin: bytes, max_output: int
    ) -> tuple[int, bytes, bytes, bool]:
        api = self._backend.api
        exec_id = api.exec_create(
            self._cid, argv, stdin=True, workdir=cwd, environment=dict(env), user=self._spec.hardening.user
        )["Id"]
        sock: Any = api.exec_start(exec_id, socket=True)
        raw: socket.socket = sock._sock
        try:
            if stdin:
                raw.sendall(stdin)
            raw.shutdown(socket.SHUT_WR)
            out: list[bytes] = []
            err: list[bytes] = []
            left, truncated = max_output, False
            for stream, data in frames_iter(sock, tty=False):
                keep = data[:left]
                truncated |= len(keep) < len(data)
                left -= len(keep)
                if keep:
                    (out if stream == 1 else err).append(keep)
        finally:
            sock.close()
        code = api.exec_inspect(exec_id).get("ExitCode")
        return (code if code is not None else -1), b"".join(out), b"".join(err), truncated

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
        limit = timeout or DEFAULT_TIMEOUT_S
        inner = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        argv = ["timeout", "-k", "1", f"{limit:g}", *inner]
        t0 = time.monotonic()
        try:
            code, out, err, truncated = await self._backend.run_blocking(
                self._run_blocking,
                argv,
                cwd or self._spec.workspace,
                env or {},
                stdin,
                max_output or DEFAULT_MAX_OUTPUT,
            )
        except Exception as e:
            raise SandboxUnavailableError(f"docker exec failed: {e}") from e
        elapsed = time.monotonic() - t0
        timed_out = code in (124, 137) and elapsed >= limit
        sig = code - 128 if code > 128 else 0
        return ExecResult(code, out, err, sig, timed_out, truncated, False, elapsed)

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
        # The fallback does not stream: it yields the collected result as events.
        r = await self.exec(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output)
        yield ExecStarted(0)
        if r.stdout:
            yield ExecOutput("stdout", r.stdout)
        if r.stderr:
            yield ExecOutput("stderr", r.stderr)
        yield ExecEnded(r.exit_code, r.signal, r.timed_out, r.truncated, r.oom_killed, r.duration_s)

    async def _checked(self, argv: list[str], stdin: bytes = b"", max_output: int = 256 << 20) -> bytes:
        r = await self.exec(argv, stdin=stdin, max_output=max_output, timeout=120)
        if r.exit_code != 0:
            msg = r.stderr.decode(errors="replace").strip()
            if "No such file" in msg or "Cannot stat" in msg:
                raise SandboxFileNotFoundError(msg)
            raise SandboxFileError(msg or f"{argv[0]} exited {r.exit_code}")
        return r.stdout

    async def download(self, path: str) -> bytes:
        parent, _, base = path.rstrip("/").rpartition("/")
        return await self._checked(["tar", "-c", "-C", parent or "/", "--", base or "."])

    async def upload(self, tar: bytes, dest_dir: str) -> int:
        await self._checked(["mkdir", "-p", "--", dest_dir])
        listing = await self._checked(["tar", "-x", "-v", "--no-same-owner", "-C", dest_dir], stdin=tar)
        return len(listing.splitlines())

    async def read_file(self, path: str, max_bytes: int = 0) -> bytes:
        script = f'test -L {shlex.quote(path)} && {{ echo "{path}: is a symbolic link" >&2; exit 1; }}; cat -- "$1"'
        data = await self._checked(["/bin/sh", "-c", script, "sh", path], max_output=max_bytes or 16 << 20)
        return data

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True) -> None:
        parent, _, base = path.rpartition("/")
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
            ["find", path, "-mindepth", "1", "-maxdepth", "1", "-printf", r"%y\t%s\t%m\t%T@\t%l\t%p\0"]
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
                r = await self.exec(["true"])
        except (TimeoutError, SandboxUnavailableError):
            return False
        return r.exit_code == 0

    async def close(self) -> None:
        return None
