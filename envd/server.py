"""envd's gRPC server: the Process and Filesystem services, grpc.health.v1, and the token check."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import stat
from _operator import _compare_digest  # hmac.compare_digest without hmac, which loads OpenSSL through _hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from envd import files
from envd.errors import (
    EnvdError,
    InvalidRequestError,
    NotFoundError,
    PathError,
    SymlinkRefusedError,
    TooLargeError,
)
from envd.process import Command, Ended, Output, ProcessRunner, Started
from protos import envd_pb2 as pb
from protos import envd_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
# Run answers in one message: its output (stdout and stderr together) stops short of the message limit, the rest
# of the room for the reply's framing and fields. Past it, a command's output was a RESOURCE_EXHAUSTED failure (an
# infrastructure retry) instead of a truncated result
RUN_MAX_OUTPUT_BYTES = MAX_MESSAGE_BYTES - (64 << 10)
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class EnvdConfig:
    """How one envd serves: where, for whom, and its default limits."""

    socket_path: str
    token: str
    workspace: str = "/workspace"
    default_timeout_s: float = 600.0
    max_timeout_s: float = 24 * 3600.0
    default_max_output_bytes: int = 1 << 20
    max_output_bytes_limit: int = 256 << 20
    default_read_bytes: int = 16 << 20
    # False where the kernel refused to make envd a sub-reaper (gVisor): orphans are then looked for under init too
    subreaper: bool = True
    base_env: dict[str, str] = field(
        default_factory=lambda: {
            "PATH": DEFAULT_PATH,
            "HOME": "/tmp",
            "LANG": "C.UTF-8",
            "TZ": "UTC",
            "TMPDIR": "/tmp",
        }
    )


_STATUS: list[tuple[type[BaseException], grpc.StatusCode]] = [
    (SymlinkRefusedError, grpc.StatusCode.PERMISSION_DENIED),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (PathError, grpc.StatusCode.FAILED_PRECONDITION),
    (TooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EnvdError, grpc.StatusCode.INTERNAL),
]

F = TypeVar("F", bound=Callable[..., Any])


def _status_for(exc: BaseException) -> grpc.StatusCode:
    return next(code for cls, code in _STATUS if isinstance(exc, cls))


# The most bytes of a status message kept: a message carries what the caller sent (a path of 20,000 characters, in
# ENAMETOOLONG's), and past grpc's metadata limit (8 KiB) the call broke as INTERNAL "Stream removed", which the host
# takes for a lost sandbox: a masked INFRA_ERROR a policy reached with one read_file. The Go envd cuts alike.
MAX_STATUS_MESSAGE = 1024


def _bounded(message: str) -> str:
    """`message` as UTF-8 text, each byte that is no UTF-8 (a path's, through surrogateescape) as \\xNN, within
    MAX_STATUS_MESSAGE bytes cut at a character's start, with how much was cut. grpc sends a status message as strict
    UTF-8: one holding a surrogate broke the abort itself, and the call hung until the host's deadline (INFRA_ERROR)."""
    try:
        raw = message.encode(errors="surrogateescape")
    except UnicodeEncodeError:  # a surrogate no byte stands for
        raw = message.encode(errors="backslashreplace")
    text = raw.decode(errors="backslashreplace")
    data = text.encode()
    if len(data) <= MAX_STATUS_MESSAGE:
        return text
    cut = MAX_STATUS_MESSAGE
    while cut > 0 and data[cut] & 0xC0 == 0x80:  # a continuation byte: not a character's start
        cut -= 1
    return f"{data[:cut].decode()}...[{len(data) - cut} more bytes]"


def _abort_for(e: Exception) -> tuple[grpc.StatusCode, str]:
    """The status and message a call that raised `e` ends with: envd's errors and OSErrors from file calls."""
    if isinstance(e, EnvdError):
        return _status_for(e), _bounded(str(e))
    if isinstance(e, OSError):
        return grpc.StatusCode.FAILED_PRECONDITION, _bounded(f"{e.filename or ''}: {e.strerror}")
    # a path no system call can take (a NUL in a tar member's name): bad input
    return grpc.StatusCode.INVALID_ARGUMENT, _bounded(str(e))


def maps_errors(fn: F) -> F:
    """Turn envd's errors (and OSErrors from file calls) into gRPC statuses with their message."""

    @functools.wraps(fn)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except (EnvdError, OSError, ValueError) as e:
            await context.abort(*_abort_for(e))

    @functools.wraps(fn)
    async def streaming(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        try:
            async for item in fn(self, request, context):
                yield item
        except (EnvdError, OSError, ValueError) as e:
            await context.abort(*_abort_for(e))

    return streaming if inspect.isasyncgenfunction(fn) else unary  # type: ignore[return-value]


class TokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses every call but health checks unless it carries `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong sandbox token")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.stream_unary_rpc_method_handler(deny)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if details.method.startswith("/grpc.health.v1."):
            return await continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
                if _compare_digest(given, self._expected):
                    return await continuation(details)
        handler = await continuation(details)
        if handler is not None and handler.request_streaming:
            return self._deny_stream
        return self._deny_unary


def _command(req: pb.ProcessRequest, cfg: EnvdConfig) -> Command:
    which = req.WhichOneof("command")
    if which == "argv":
        argv = list(req.argv.args)
        if not argv or not argv[0]:
            raise InvalidRequestError("argv is empty: give the program and its arguments")
    elif which == "shell":
        if not req.shell.strip():
            raise InvalidRequestError("shell command is empty")
        argv = ["/bin/sh", "-c", req.shell]
    else:
        raise InvalidRequestError("no command: set argv or shell")
    if req.timeout_s < 0 or req.timeout_s > cfg.max_timeout_s or req.timeout_s != req.timeout_s:
        raise InvalidRequestError(f"timeout_s must be between 0 and {cfg.max_timeout_s:g}, got {req.timeout_s}")
    if req.max_output_bytes < 0 or req.max_output_bytes > cfg.max_output_bytes_limit:
        raise InvalidRequestError(
            f"max_output_bytes must be between 0 and {cfg.max_output_bytes_limit}, got {req.max_output_bytes}"
        )
    for key in req.env:
        if not key or "=" in key or "\0" in key:
            raise InvalidRequestError(f"invalid environment variable name {key!r}")
    # no exec can carry a NUL (Popen raised ValueError, which came back UNKNOWN: an unavailable sandbox)
    if any("\0" in a for a in argv):
        raise InvalidRequestError("the command contains a NUL byte")
    for key in sorted(req.env):
        if "\0" in req.env[key]:
            raise InvalidRequestError(f"environment variable {key!r} contains a NUL byte")
    cwd = req.cwd or cfg.workspace
    if "\0" in cwd:
        raise InvalidRequestError("cwd contains a NUL byte")
    if not os.path.isabs(cwd):
        cwd = os.path.join(cfg.workspace, cwd)
    return Command(
        argv=argv,
        cwd=cwd,
        env=dict(req.env),
        stdin=req.stdin,
        timeout_s=req.timeout_s or cfg.default_timeout_s,
        max_output_bytes=req.max_output_bytes or cfg.default_max_output_bytes,
        keep_background=req.keep_background,
    )


async def _stdin_chunks(messages: AsyncIterator[pb.ProcessInput]) -> AsyncIterator[bytes]:
    """The stdin chunks of StartStream's later messages (another request among them is ignored)."""
    async for m in messages:
        if m.WhichOneof("input") == "stdin" and m.stdin:
            yield m.stdin


def _ended_pb(e: Ended) -> pb.Ended:
    return pb.Ended(
        exit_code=e.exit_code,
        signal=e.signal,
        timed_out=e.timed_out,
        truncated=e.truncated,
        oom_killed=e.oom_killed,
        duration_s=e.duration_s,
    )


class ProcessService(pb_grpc.ProcessServicer):  # type: ignore[misc]
    """Runs commands; see protos/envd.proto."""

    def __init__(self, cfg: EnvdConfig) -> None:
        self._cfg = cfg
        adopters = () if cfg.subreaper or os.getpid() == 1 else (os.getpid(), 1)  # PID 1 adopts all orphans
        self._runner = ProcessRunner(base_env=cfg.base_env, adopters=adopters)
        self._modes: dict[str, int] = {}  # what Reset puts back (remember_inodes)

    def remember_inodes(self) -> None:
        """Note the permission bits of the workspace and the socket, before any command runs: what Reset puts back.
        The other places a rollout can write are root's (/tmp, /dev/shm; the socket's directory, which the host
        takes once envd listens), so it cannot change them."""
        for path in (self._cfg.workspace, self._cfg.socket_path):
            with contextlib.suppress(OSError):
                self._modes[path] = stat.S_IMODE(os.lstat(path).st_mode)

    @maps_errors
    async def Start(self, request: pb.ProcessRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for ev in self._events(_command(request, self._cfg)):
            yield ev

    async def _events(self, cmd: Command) -> AsyncIterator[pb.ProcessEvent]:
        async with contextlib.aclosing(self._runner.run(cmd)) as events:
            async for ev in events:
                if isinstance(ev, Output):
                    yield pb.ProcessEvent(stdout=ev.data) if ev.stream == 1 else pb.ProcessEvent(stderr=ev.data)
                elif isinstance(ev, Started):
                    yield pb.ProcessEvent(started=pb.Started(pid=ev.pid))
                else:
                    yield pb.ProcessEvent(ended=_ended_pb(ev))

    @maps_errors
    async def StartStream(
        self, request_iterator: AsyncIterator[pb.ProcessInput], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("input") != "request":
            raise InvalidRequestError("the first message of StartStream must be the request")
        cmd = dataclasses.replace(_command(first.request, self._cfg), stdin_stream=_stdin_chunks(request_iterator))
        del first
        async for ev in self._events(cmd):
            yield ev

    @maps_errors
    async def Run(self, request: pb.ProcessRequest, context: grpc.aio.ServicerContext) -> pb.RunResult:
        cmd = _command(request, self._cfg)
        cmd = dataclasses.replace(cmd, max_output_bytes=min(cmd.max_output_bytes, RUN_MAX_OUTPUT_BYTES))
        out: list[bytes] = []
        err: list[bytes] = []
        result = pb.RunResult()
        async with contextlib.aclosing(self._runner.run(cmd)) as events:
            async for ev in events:
                if isinstance(ev, Output):
                    (out if ev.stream == 1 else err).append(ev.data)
                elif isinstance(ev, Started):
                    result.pid = ev.pid
                else:
                    result.ended.CopyFrom(_ended_pb(ev))
        result.stdout = b"".join(out)
        result.stderr = b"".join(err)
        return result

    @maps_errors
    async def Signal(self, request: pb.SignalRequest, context: grpc.aio.ServicerContext) -> pb.SignalResponse:
        self._runner.signal(request.pid, request.signal)
        return pb.SignalResponse()

    @maps_errors
    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.ResetResponse:
        seed = request.workspace_seed
        if seed and (not os.path.isabs(seed) or not os.path.isdir(seed)):
            raise InvalidRequestError(f"workspace_seed {seed!r} is not an absolute path to a directory")
        from envd.reset import reset_sandbox  # with shutil, loaded by the first Reset: private memory per sandbox

        socket_dir, socket_name = os.path.split(self._cfg.socket_path)
        managed = set(self._runner.running)
        r = await asyncio.to_thread(
            reset_sandbox, self._cfg.workspace, socket_dir, socket_name, seed, managed, self._modes
        )
        self._runner.forget_all()
        return pb.ResetResponse(ok=r.ok, detail=r.detail, killed=r.killed, duration_s=r.duration_s)


def _info_pb(e: files.Entry) -> pb.FileInfo:
    return pb.FileInfo(
        name=e.name,
        path=e.path,
        kind=f"FILE_KIND_{e.kind.name}",
        size=e.size,
        mode=e.mode,
        mtime=e.mtime,
        link_target=e.link_target,
    )


class FilesystemService(pb_grpc.FilesystemServicer):  # type: ignore[misc]
    """File operations that never follow symbolic links; see envd/files.py."""

    def __init__(self, cfg: EnvdConfig) -> None:
        self._cfg = cfg

    @maps_errors
    async def ReadFile(self, request: pb.ReadFileRequest, context: grpc.aio.ServicerContext) -> pb.ReadFileResponse:
        if request.max_bytes < 0:
            raise InvalidRequestError(f"max_bytes must be >= 0, got {request.max_bytes}")
        limit = min(request.max_bytes or self._cfg.default_read_bytes, MAX_MESSAGE_BYTES - 4096)
        data, truncated = await asyncio.to_thread(files.read_file, request.path, self._cfg.workspace, limit)
        return pb.ReadFileResponse(content=data, truncated=truncated)

    @maps_errors
    async def WriteFile(self, request: pb.WriteFileRequest, context: grpc.aio.ServicerContext) -> pb.WriteFileResponse:
        mode = request.mode or 0o644
        if mode > 0o7777:
            raise InvalidRequestError(f"mode {oct(mode)} is not a permission mode")
        await asyncio.to_thread(
            files.write_file, request.path, self._cfg.workspace, request.content, mode, request.make_parents
        )
        return pb.WriteFileResponse()

    @maps_errors
    async def ListDir(self, request: pb.ListDirRequest, context: grpc.aio.ServicerContext) -> pb.ListDirResponse:
        entries = await asyncio.to_thread(files.list_dir, request.path, self._cfg.workspace)
        return pb.ListDirResponse(entries=[_info_pb(e) for e in entries])

    @maps_errors
    async def Stat(self, request: pb.StatRequest, context: grpc.aio.ServicerContext) -> pb.FileInfo:
        return _info_pb(files.stat_path(request.path, self._cfg.workspace))

    @maps_errors
    async def Upload(
        self, request_iterator: AsyncIterator[pb.UploadChunk], context: grpc.aio.ServicerContext
    ) -> pb.UploadResponse:
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("chunk") != "dest_dir" or not first.dest_dir:
            raise InvalidRequestError("the first upload chunk must name dest_dir")
        with files.spool() as spool:
            async for chunk in request_iterator:
                spool.write(chunk.data)
            spool.seek(0)
            count = await asyncio.to_thread(files.extract_tar, spool, first.dest_dir, self._cfg.workspace)
        return pb.UploadResponse(files=count)

    @maps_errors
    async def Download(self, request: pb.DownloadRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        if request.max_bytes < 0:
            raise InvalidRequestError(f"max_bytes must be >= 0 (0: no cap), got {request.max_bytes}")
        spool = await asyncio.to_thread(files.build_tar, request.path, self._cfg.workspace, request.max_bytes)
        with spool:
            for chunk in files.iter_chunks(spool):
                yield pb.DataChunk(data=chunk)


async def create_server(cfg: EnvdConfig) -> grpc.aio.Server:
    """A started envd server on cfg.socket_path, reporting SERVING."""
    server = grpc.aio.server(
        interceptors=[TokenInterceptor(cfg.token)],
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    process = ProcessService(cfg)
    pb_grpc.add_ProcessServicer_to_server(process, server)
    pb_grpc.add_FilesystemServicer_to_server(FilesystemService(cfg), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(cfg.socket_path)
    server.add_insecure_port(f"unix://{cfg.socket_path}")
    await server.start()
    process.remember_inodes()  # the socket is there now, and no command has run
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return server


async def serve(cfg: EnvdConfig) -> None:
    """Serve until cancelled."""
    server = await create_server(cfg)
    log.info("envd serving on %s", cfg.socket_path)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=1)
