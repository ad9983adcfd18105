"""The fast path into a sandbox: gRPC to envd over a unix socket in a bind-mounted host directory."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Iterator, Mapping
from typing import Any, Literal, NoReturn, TypeGuard

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from orchestrator.core.errors import (
    ArchiveTooLargeError,
    InvalidRequestError,
    SandboxFileError,
    SandboxFileNotFoundError,
    SandboxPermissionError,
    SandboxUnavailableError,
)
from orchestrator.core.sandbox import (
    Command,
    ExecEnded,
    ExecEvent,
    ExecOutput,
    ExecResult,
    ExecStarted,
    FileEntry,
    Liveness,
    ResetOutcome,
    Stdin,
    Transport,
    read_stdin,
)
from protos import envd_pb2 as pb
from protos import envd_pb2_grpc as pb_grpc

MAX_MESSAGE_BYTES = 64 << 20
# The most a reply may be on the channel most calls use: a reply's bytes are held whole (and copied) before any cap
# of the call's is checked, and a tenant's image can hold its own envd, which answered every call with 64 MiB (gzip
# made it 64 KiB on the wire) and held about 200 MiB of the worker's memory a call. A call whose own cap is larger
# (a test log, a raw Exec's max_output, a file read whole) goes over a second channel that takes MAX_MESSAGE_BYTES.
SMALL_REPLY_BYTES = 8 << 20
_REPLY_OVERHEAD = 64 << 10  # a reply's fields and framing past the output or content it carries
UPLOAD_CHUNK = 1 << 20
# Calls other than exec get this deadline; exec gets its own timeout plus this slack.
CALL_DEADLINE_S = 60.0
# An envd built before StartStream (a base image from an older tree) takes stdin in one message: streamed stdin is
# gathered for it up to this much
OLD_ENVD_STDIN_BYTES = 16 << 20
# stdin given as bytes over this goes to envd in UPLOAD_CHUNK pieces, as streamed stdin does: inline it is one gRPC
# message, which envd refuses over MAX_MESSAGE_BYTES, and each hop holds a copy of it whole
STREAM_STDIN_OVER = 8 << 20
_KINDS: dict[int, Literal["file", "dir", "symlink", "other"]] = {1: "file", 2: "dir", 3: "symlink", 4: "other"}
# envd's own caps where a call names none (envd/go/server.go, envd/server.py). A reply past the cap its call named is
# not envd's doing (a tenant's image can hold its own envd): it is refused, not held, logged or scored
ENVD_DEFAULT_MAX_OUTPUT = 1 << 20
ENVD_DEFAULT_READ_BYTES = 16 << 20
# an envd from before its "cannot execute" message counted within max_output sent up to ~4 KiB past it
ENVD_OUTPUT_SLACK = 8 << 10
# what of a failed reset's detail is kept (it is logged at every release)
MAX_RESET_DETAIL = 2048


def _inline(stdin: Stdin) -> TypeGuard[bytes]:
    """Whether stdin goes in the request message itself (bytes up to STREAM_STDIN_OVER) rather than streamed."""
    return isinstance(stdin, bytes) and len(stdin) <= STREAM_STDIN_OVER


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), UPLOAD_CHUNK):
        yield data[start : start + UPLOAD_CHUNK]


def _raise(e: grpc.aio.AioRpcError) -> NoReturn:
    code, msg = e.code(), e.details() or ""
    if code == grpc.StatusCode.NOT_FOUND:
        raise SandboxFileNotFoundError(msg) from None
    if code == grpc.StatusCode.PERMISSION_DENIED:
        raise SandboxPermissionError(msg) from None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise InvalidRequestError(msg) from None
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        raise SandboxFileError(msg) from None
    raise SandboxUnavailableError(f"envd: {code.name}: {msg}") from e


def _output_within(sent: int, max_output: int | None) -> None:
    """SandboxUnavailableError when `sent` bytes of output are past what a call of `max_output` allows (envd's
    default when None), its slack included."""
    cap = max_output or ENVD_DEFAULT_MAX_OUTPUT
    if sent > cap + ENVD_OUTPUT_SLACK:
        _overran("output", sent, cap)


def _overran(what: str, got: int, cap: int) -> NoReturn:
    raise SandboxUnavailableError(
        f"envd sent {got} bytes of {what}, over the {cap} the call allowed: this sandbox's envd is not envfleet's, "
        "or is broken"
    )


class EnvdTransport(Transport):
    """One gRPC channel to one sandbox's envd."""

    _closed = False

    def __init__(self, socket_path: str, token: str) -> None:
        self.socket_path = socket_path
        self._md = (("authorization", f"Bearer {token}"),)
        self._channel = self._open(SMALL_REPLY_BYTES, starting=True)
        self._large: grpc.aio.Channel | None = None  # opened by the first call whose cap needs it
        self._large_stubs: tuple[pb_grpc.ProcessStub, pb_grpc.FilesystemStub] | None = None
        self._proc = pb_grpc.ProcessStub(self._channel)
        self._fs = pb_grpc.FilesystemStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _open(self, max_reply: int, *, starting: bool) -> grpc.aio.Channel:
        options = [
            ("grpc.max_receive_message_length", max_reply),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # replies as sent, never compressed: a few KiB of gzip were a reply of 64 MiB to hold
            ("grpc.compression_enabled_algorithms_bitset", 1),
        ]
        if starting:
            # a sandbox socket appears once; reconnect quickly rather than after grpc's 1 s default backoff (the
            # start polls its health, so an attempt cut short is tried again). The minimum is also each attempt's
            # connect timeout: a channel opened once envd serves keeps grpc's 20 s, or its first call on a busy host
            # failed at once ("timed out before receiving SETTINGS frame"), an INFRA_ERROR
            options += [
                ("grpc.initial_reconnect_backoff_ms", 10),
                ("grpc.min_reconnect_backoff_ms", 10),
                ("grpc.max_reconnect_backoff_ms", 200),
            ]
        return grpc.aio.insecure_channel(f"unix://{self.socket_path}", options=options)

    def _for(self, cap: int) -> tuple[pb_grpc.ProcessStub, pb_grpc.FilesystemStub]:
        """The stubs of the channel whose reply limit takes a reply of `cap` bytes of output or content."""
        if cap + _REPLY_OVERHEAD <= SMALL_REPLY_BYTES or self._closed:  # closed: the call fails as any other does
            return self._proc, self._fs
        if self._large_stubs is None:
            self._large = self._open(MAX_MESSAGE_BYTES, starting=False)
            self._large_stubs = pb_grpc.ProcessStub(self._large), pb_grpc.FilesystemStub(self._large)
        return self._large_stubs

    async def health(self, timeout: float) -> bool:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):
            return False
        except asyncio.CancelledError:
            if self._closed and not _cancelled_from_outside():
                return False
            raise
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    async def probe(self, timeout: float) -> Liveness:
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            # a gone envd refuses the connection at once; one that has not answered in time is there but starved
            # of CPU, as the envds of a host at a load of 100 or more are
            return "slow" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "gone"
        except grpc.aio.UsageError:
            return "gone"  # closed: the sandbox was removed
        except asyncio.CancelledError:
            if self._closed and not _cancelled_from_outside():
                return "gone"
            raise
        return "alive" if reply.status == health_pb2.HealthCheckResponse.SERVING else "gone"

    @staticmethod
    def _request(
        cmd: Command,
        cwd: str | None,
        env: Mapping[str, str] | None,
        stdin: bytes,
        timeout: float | None,
        max_output: int | None,
    ) -> pb.ProcessRequest:
        """The request message (stdin inline: bytes only)."""
        req = pb.ProcessRequest(
            cwd=cwd or "", env=dict(env or {}), stdin=stdin, timeout_s=timeout or 0, max_output_bytes=max_output or 0
        )
        if isinstance(cmd, str):
            req.shell = cmd
        else:
            req.argv.args.extend(cmd)
        return req

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
        deadline = (timeout or 600.0) + CALL_DEADLINE_S
        call: Any
        with self._envd_errors():
            if _inline(stdin):
                call = self._proc.Start(
                    self._request(cmd, cwd, env, stdin, timeout, max_output), metadata=self._md, timeout=deadline
                )
            else:
                chunks = _chunks(stdin) if isinstance(stdin, bytes) else stdin
                request = self._request(cmd, cwd, env, b"", timeout, max_output)
                call = await self._start_stream(request, chunks, deadline)
        async for ev in self._events(call, max_output):
            yield ev

    async def _start_stream(self, req: pb.ProcessRequest, stdin: AsyncIterable[bytes], deadline: float) -> Any:
        """A StartStream call that sends `stdin` as the process reads it, once envd has answered the request (an old
        envd answers UNIMPLEMENTED, and has then taken no stdin: the call falls back to Start, stdin gathered)."""
        answered = asyncio.Event()

        async def messages() -> AsyncIterator[pb.ProcessInput]:
            yield pb.ProcessInput(request=req)
            await answered.wait()
            async for chunk in stdin:
                if chunk:
                    yield pb.ProcessInput(stdin=chunk)

        call = self._proc.StartStream(messages(), metadata=self._md, timeout=deadline)
        try:
            with self._envd_errors():
                try:
                    first = await call.read()
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                        raise
                    # stdin gathered before `answered`: the request stream must not take any of it meanwhile
                    data = await read_stdin(
                        stdin, OLD_ENVD_STDIN_BYTES, "this sandbox's envd (built before StartStream)"
                    )
                    req.stdin = data
                    return self._proc.Start(req, metadata=self._md, timeout=deadline)
        except BaseException:
            call.cancel()
            raise
        finally:
            answered.set()
        return _Prepended(first, call)

    async def _events(self, call: Any, max_output: int | None) -> AsyncIterator[ExecEvent]:
        """The call's events, up to the process's end; SandboxUnavailableError once its output (stdout and stderr
        together, as envd counts it) goes past `max_output`, and the call is cancelled, or when the stream ends
        without the end (a trainer's Exec read that as exit 0)."""
        sent = 0
        try:
            with self._envd_errors():
                async for ev in call:
                    which = ev.WhichOneof("event")
                    if which in ("stdout", "stderr"):
                        data = getattr(ev, which)
                        sent += len(data)
                        _output_within(sent, max_output)
                        yield ExecOutput(which, data)
                    elif which == "started":
                        yield ExecStarted(ev.started.pid)
                    elif which == "ended":
                        e = ev.ended
                        yield ExecEnded(e.exit_code, e.signal, e.timed_out, e.truncated, e.oom_killed, e.duration_s)
                        return  # nothing comes after the end
        finally:
            call.cancel()  # closing the stream early kills the process inside
        raise SandboxUnavailableError("envd's exec stream ended without the process's exit status")

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
        """One unary round trip: cheaper than the stream when nobody watches the output live."""
        if not _inline(stdin):
            return await super().exec(cmd, cwd=cwd, env=env, stdin=stdin, timeout=timeout, max_output=max_output)
        req = self._request(cmd, cwd, env, stdin, timeout, max_output)
        proc, _ = self._for((max_output or ENVD_DEFAULT_MAX_OUTPUT) + ENVD_OUTPUT_SLACK)
        with self._envd_errors():
            r = await proc.Run(req, metadata=self._md, timeout=(timeout or 600.0) + CALL_DEADLINE_S)
        _output_within(len(r.stdout) + len(r.stderr), max_output)
        end = r.ended
        return ExecResult(
            exit_code=end.exit_code,
            stdout=bytes(r.stdout),
            stderr=bytes(r.stderr),
            signal=end.signal,
            timed_out=end.timed_out,
            truncated=end.truncated,
            oom_killed=end.oom_killed,
            duration_s=end.duration_s,
        )

    async def reset(self, workspace_seed: str) -> ResetOutcome:
        try:
            r = await self._proc.Reset(
                pb.ResetRequest(workspace_seed=workspace_seed), metadata=self._md, timeout=CALL_DEADLINE_S
            )
        except grpc.aio.AioRpcError as e:
            return ResetOutcome(False, f"envd reset failed: {e.code().name}: {e.details()}")
        except grpc.aio.UsageError:
            return ResetOutcome(False, "the sandbox was removed before its envd could reset it")
        except asyncio.CancelledError:
            if self._closed and not _cancelled_from_outside():
                return ResetOutcome(False, "the sandbox was removed while its envd reset it")
            raise
        return ResetOutcome(bool(r.ok), r.detail[:MAX_RESET_DETAIL])

    async def read_file(self, path: str, max_bytes: int = 0) -> bytes:
        cap = max_bytes or ENVD_DEFAULT_READ_BYTES
        _, fs = self._for(cap)
        with self._envd_errors():
            r = await fs.ReadFile(
                pb.ReadFileRequest(path=path, max_bytes=max_bytes), metadata=self._md, timeout=CALL_DEADLINE_S
            )
        if len(r.content) > cap:
            _overran(f"{path!r}", len(r.content), cap)
        return bytes(r.content)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True) -> None:
        req = pb.WriteFileRequest(path=path, content=data, mode=mode, make_parents=make_parents)
        with self._envd_errors():
            await self._fs.WriteFile(req, metadata=self._md, timeout=CALL_DEADLINE_S)

    async def list_dir(self, path: str) -> list[FileEntry]:
        _, fs = self._for(MAX_MESSAGE_BYTES - _REPLY_OVERHEAD)  # a folder's listing has no cap of its own
        with self._envd_errors():
            r = await fs.ListDir(pb.ListDirRequest(path=path), metadata=self._md, timeout=CALL_DEADLINE_S)
        return [
            FileEntry(i.name, i.path, _KINDS.get(i.kind, "other"), i.size, i.mode, i.mtime, i.link_target)
            for i in r.entries
        ]

    async def upload(self, tar: bytes, dest_dir: str) -> int:
        async def chunks() -> AsyncIterator[pb.UploadChunk]:
            yield pb.UploadChunk(dest_dir=dest_dir)
            for i in range(0, len(tar), UPLOAD_CHUNK):
                yield pb.UploadChunk(data=tar[i : i + UPLOAD_CHUNK])

        with self._envd_errors():
            r = await self._fs.Upload(chunks(), metadata=self._md, timeout=CALL_DEADLINE_S)
        return int(r.files)

    async def download(self, path: str) -> bytes:
        return await self.download_at_most(path, 0)

    async def download_at_most(self, path: str, max_bytes: int) -> bytes:
        """The archive, at most `max_bytes` of it (0: no cap), or ArchiveTooLargeError. envd builds an archive whole
        before it sends any of it: told the cap, it stops building there (a workspace of gigabytes took past the
        call's deadline, an INFRA_ERROR, and went on filling the sandbox's /tmp after the cancel). It is counted here
        too, as it streams."""
        parts: list[bytes] = []
        total = 0
        request = pb.DownloadRequest(path=path, max_bytes=max_bytes)
        with self._envd_errors():
            call = self._fs.Download(request, metadata=self._md, timeout=CALL_DEADLINE_S)
        try:
            with self._envd_errors():
                try:
                    async for chunk in call:
                        total += len(chunk.data)
                        if max_bytes and total > max_bytes:
                            raise ArchiveTooLargeError(f"the archive of {path!r} is over the cap of {max_bytes} bytes")
                        parts.append(chunk.data)
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                        raise ArchiveTooLargeError(
                            e.details() or f"the archive of {path!r} is over {max_bytes} bytes"
                        ) from None
                    raise
        finally:
            call.cancel()
        return b"".join(parts)

    async def close(self) -> None:
        self._closed = True
        for channel in (self._channel, self._large):
            if channel is not None:
                with contextlib.suppress(Exception):
                    await channel.close()

    @contextlib.contextmanager
    def _envd_errors(self) -> Iterator[None]:
        """envd's statuses as the sandbox errors they mean. A call the channel's close ended (the sandbox removed
        under it: a Delete, a TTL, a session closed mid-step) fails as the sandbox's, where grpc raised a bare
        CancelledError in a task nobody cancelled, and the RPC that made the call got no status at all."""
        try:
            yield
        except grpc.aio.AioRpcError as e:
            _raise(e)
        except asyncio.CancelledError:
            if self._closed and not _cancelled_from_outside():
                raise SandboxUnavailableError("the sandbox was removed while this call to its envd ran") from None
            raise
        except grpc.aio.UsageError:
            if self._closed:  # a call made after the removal
                raise SandboxUnavailableError("the sandbox was removed before this call to its envd") from None
            raise


def _cancelled_from_outside() -> bool:
    """Whether the running task itself is being cancelled (not only a gRPC call it awaits)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Prepended:
    """A call's events with the first one, already read, in front; cancelling cancels the call."""

    def __init__(self, first: Any, call: Any) -> None:
        self._first = first
        self._call = call

    async def __aiter__(self) -> AsyncIterator[Any]:
        ev = self._first
        while ev is not grpc.aio.EOF:  # read(), not iteration: a call may not mix the two
            yield ev
            ev = await self._call.read()

    def cancel(self) -> bool:
        return bool(self._call.cancel())
