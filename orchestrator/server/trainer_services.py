"""SessionService and SandboxService, for trainers that run their own agent loop: thin adapters from the wire to
the SessionManager and the SandboxManager.

Every call acts as the calling tenant (from its bearer token); the managers keep tenants apart.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Mapping

import grpc

from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.sandbox import ExecEvent
from orchestrator.server.convert_sessions import (
    action_from_pb,
    check_id,
    command_from_pb,
    exec_event_pb,
    reset_response_pb,
    sandbox_info_pb,
    step_response_pb,
)
from orchestrator.server.convert_specs import limits_overrides
from orchestrator.server.replies import UnreadReplies, at_end, unread_replies
from orchestrator.server.security import Authenticator
from orchestrator.service.sandboxes import MAX_ENV_VARS, SandboxManager
from orchestrator.service.sessions import SessionManager
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc

MAX_ENV_REF = 200
MAX_PATH = 4096
MAX_IMAGE = 256
MAX_TASK_ID = 128
MAX_ARGS = 65_536  # arguments of one Exec's argv
MAX_ARGV_CHARS = 2 << 20  # all of them together: Linux's ARG_MAX at the default 8 MiB stack
MAX_STDIN_CHUNK = 4 << 20  # stdin of one ExecStream message: the server holds a chunk or two of each call
FIRST_INPUT_S = 30.0  # how long an ExecStream may wait for its request (it holds no Exec slot until then)


def _env_ref(value: str, required: bool = True) -> str:
    if required and not value:
        raise InvalidRequestError("env is empty: give an environment name or name@version")
    if len(value) > MAX_ENV_REF:
        raise InvalidRequestError(f"env is too long (over {MAX_ENV_REF} characters)")
    return value


def _capped(value: str, what: str, limit: int) -> str:
    if len(value) > limit:
        raise InvalidRequestError(f"{what} is too long ({len(value)} characters, over {limit})")
    return value


def _path(value: str, what: str = "path") -> str:
    if not value:
        raise InvalidRequestError(f"{what} is empty")
    if len(value) > MAX_PATH or "\0" in value:
        raise InvalidRequestError(f"{what} is over {MAX_PATH} characters or holds NUL")
    return value


def _counted(request: pb.ExecRequest) -> None:
    """Refuse an Exec whose variables or arguments are too many, counted before anything copies them: 3 million
    variables held the event loop 125 s here in `_stdin_size`'s copy, before their own check refused them (the
    request's parse, which stalls the same way, map_guard bounds)."""
    _few_vars(request.env, "env")
    if request.HasField("argv"):
        args = request.argv.args
        if len(args) > MAX_ARGS:
            raise InvalidRequestError(f"argv: at most {MAX_ARGS} arguments, got {len(args)}")
        if (chars := sum(map(len, args))) > MAX_ARGV_CHARS:
            raise InvalidRequestError(f"argv: at most {MAX_ARGV_CHARS} characters in all, got {chars}")


def _stdin_chunk(data: bytes) -> bytes:
    if len(data) > MAX_STDIN_CHUNK:
        raise InvalidRequestError(
            f"an ExecStream message's stdin is {len(data)} bytes; send it in chunks of at most {MAX_STDIN_CHUNK}"
        )
    return data


def _stdin_size(request: pb.ExecRequest) -> int:
    """The length of the request's stdin from message sizes alone: reading the field would copy it."""
    rest = pb.ExecRequest(
        sandbox_id=request.sandbox_id,
        cwd=request.cwd,
        env=request.env,
        timeout_s=request.timeout_s,
        max_output_bytes=request.max_output_bytes,
    )
    if request.HasField("argv"):
        rest.argv.CopyFrom(request.argv)
    elif request.HasField("shell"):
        rest.shell = request.shell
    framed = request.ByteSize() - rest.ByteSize() - 1  # the stdin's length varint and bytes, less its tag
    for varint in range(1, 11):
        if framed - varint < 1 << (7 * varint):  # the length whose varint takes `varint` bytes
            return max(0, framed - varint)
    return max(0, framed)


def _few_vars(field: Mapping[str, str], what: str) -> None:
    if len(field) > MAX_ENV_VARS:
        raise InvalidRequestError(f"{what}: at most {MAX_ENV_VARS} variables, got {len(field)}")


def _env_vars(field: Mapping[str, str], what: str) -> dict[str, str]:
    """A request's variables, counted before they are copied: 2 million of them held the event loop for seconds."""
    _few_vars(field, what)
    return dict(field)


STDIN_END_GRACE_S = 0.05  # ExecStream's stdin ends this long after its caller's last message (_StreamedStdin)


class _StreamedStdin:
    """ExecStream's stdin: the request's own, then each later message's, read only as the process takes them.

    A later message that does not parse is kept in `unreadable`, and stdin then never ends: an end would let the
    command run on with part of its input (a write cut short, say), so ExecStream stops the command instead and
    answers the error. Raised from the chunks, the error was swallowed by the task that feeds envd, whose call was
    cancelled, and the caller's call hung without a status."""

    def __init__(self, first: pb.ExecInput, rest: AsyncIterator[pb.ExecInput]) -> None:
        self._first: bytes = _stdin_chunk(first.request.stdin)
        self._rest = rest
        self.unreadable: InvalidRequestError | None = None
        self.broken = asyncio.Event()

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._first:
            yield self._first
        self._first = b""
        try:
            async for m in self._rest:
                if m.WhichOneof("input") == "stdin" and m.stdin:
                    yield _stdin_chunk(m.stdin)
            # gRPC ends the messages of a call its caller cancelled as it ends those of one it closed, and the
            # handler's cancellation comes a few loop turns later: ended at once, stdin let the command run on with
            # part of its input (`cat > f; touch done` ran to its end) whenever the end got to envd first. A cancel
            # is in by the end of this pause (its callback is queued before the timer), a close's end is this late
            await asyncio.sleep(STDIN_END_GRACE_S)
        except InvalidRequestError as e:
            self.unreadable = e
            self.broken.set()
            await asyncio.Event().wait()  # until the command is stopped, which cancels this read


async def _until(events: AsyncIterator[ExecEvent], stop: asyncio.Event) -> AsyncGenerator[ExecEvent]:
    """The events until `stop` is set. The read of the next one is then cancelled, as it is when the caller goes:
    the command's call is cancelled on its way out, and envd kills the command."""
    stopped = asyncio.ensure_future(stop.wait())
    step: asyncio.Future[ExecEvent | None] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(events, None))
            await asyncio.wait((step, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not step.done() or (event := step.result()) is None:
                return
            yield event
    finally:
        stopped.cancel()
        if step is not None and not step.done():
            step.cancel()
            await asyncio.wait((step,))


class SessionService(pb_grpc.SessionServiceServicer):  # type: ignore[misc]
    """Reset, Step, CloseSession (and Close, its deprecated alias)."""

    def __init__(self, sessions: SessionManager, auth: Authenticator) -> None:
        self._sessions = sessions
        self._auth = auth

    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.ResetResponse:
        tenant = self._auth.tenant(context)
        if len(request.task_id) > MAX_TASK_ID:
            raise InvalidRequestError(f"task_id is too long ({len(request.task_id)} characters, over {MAX_TASK_ID})")
        view, obs = await self._sessions.reset(
            tenant,
            _env_ref(request.env),
            request.task_id,
            request.seed if request.HasField("seed") else None,
            request.max_turns,
        )
        return reset_response_pb(view, obs)

    async def Step(self, request: pb.StepRequest, context: grpc.aio.ServicerContext) -> pb.StepResponse:
        tenant = self._auth.tenant(context)
        sid = check_id(request.session_id, "session_id")
        turn = request.turn if request.HasField("turn") else None
        result = await self._sessions.step(tenant, sid, action_from_pb(request.action), turn)
        return step_response_pb(result)

    async def CloseSession(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        tenant = self._auth.tenant(context)
        running = await self._sessions.close(tenant, check_id(request.session_id, "session_id"))
        return pb.CloseSessionResponse(was_running=running)

    async def Close(
        self, request: pb.CloseSessionRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseSessionResponse:
        """Deprecated alias of CloseSession, served for one more release (its name collides with close() in
        generated Node.js clients)."""
        return await self.CloseSession(request, context)


class SandboxService(pb_grpc.SandboxServiceServicer):  # type: ignore[misc]
    """Create, Get, List, Exec, files, Delete."""

    def __init__(self, sandboxes: SandboxManager, auth: Authenticator, unread: UnreadReplies | None = None) -> None:
        self._sandboxes = sandboxes
        self._auth = auth
        self._unread = unread or unread_replies()

    async def Create(self, request: pb.CreateSandboxRequest, context: grpc.aio.ServicerContext) -> pb.SandboxInfo:
        tenant = self._auth.tenant(context)
        record = await self._sandboxes.create(
            tenant,
            image=_capped(request.image, "image", MAX_IMAGE),
            env=_env_ref(request.env, required=False),
            limits=limits_overrides(request.limits),
            ttl_s=request.ttl_s,
            env_vars=_env_vars(request.env_vars, "env_vars"),
            runtime=_capped(request.runtime, "runtime", 64),
        )
        return sandbox_info_pb(record)

    async def Get(self, request: pb.GetSandboxRequest, context: grpc.aio.ServicerContext) -> pb.SandboxInfo:
        tenant = self._auth.tenant(context)
        return sandbox_info_pb(await self._sandboxes.get(tenant, check_id(request.sandbox_id, "sandbox_id")))

    async def List(
        self, request: pb.ListSandboxesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListSandboxesResponse:
        tenant = self._auth.tenant(context)
        reply = pb.ListSandboxesResponse(sandboxes=[sandbox_info_pb(r) for r in await self._sandboxes.list(tenant)])
        return self._unread.hold(tenant, reply, context)

    async def Exec(self, request: pb.ExecRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExecEvent]:
        # a request refused by a stdin cap is never copied out of its message
        tenant = self._auth.tenant(context)
        _counted(request)
        events = self._exec(tenant, request, lambda: request.stdin, _stdin_size(request))
        async for ev in events:
            yield exec_event_pb(ev)

    def _exec(
        self,
        tenant: str,
        request: pb.ExecRequest,
        stdin: Callable[[], bytes] | AsyncIterable[bytes],
        stdin_size: int | None,
    ) -> AsyncIterator[ExecEvent]:
        """The events of one exec request, its fields checked (Exec and ExecStream differ only in their stdin)."""
        if len(request.cwd) > MAX_PATH:
            raise InvalidRequestError(f"cwd is over {MAX_PATH} characters")
        return self._sandboxes.exec_stream(
            tenant,
            check_id(request.sandbox_id, "sandbox_id"),
            command_from_pb(request),
            cwd=request.cwd,
            env=_env_vars(request.env, "env"),
            stdin=stdin,
            stdin_size=stdin_size,
            timeout_s=request.timeout_s,
            max_output=request.max_output_bytes,
        )

    async def ExecStream(
        self, request_iterator: AsyncIterator[pb.ExecInput], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ExecEvent]:
        tenant = self._auth.tenant(context)
        try:
            async with asyncio.timeout(FIRST_INPUT_S):  # waiting, it counts against no cap
                first = await anext(aiter(request_iterator), None)
        except TimeoutError:
            raise InvalidRequestError(f"ExecStream: no request within {FIRST_INPUT_S:g}s of the call") from None
        if first is None or first.WhichOneof("input") != "request":
            raise InvalidRequestError("the first message of ExecStream must be the request (ExecInput.request)")
        _counted(first.request)
        stdin = _StreamedStdin(first, request_iterator)
        events = self._exec(tenant, first.request, stdin.chunks(), None)
        del first
        async with contextlib.aclosing(_until(events, stdin.broken)) as until:
            async for ev in until:
                yield exec_event_pb(ev)
        if stdin.unreadable is not None:
            raise stdin.unreadable

    async def ReadFile(
        self, request: pb.SandboxReadFileRequest, context: grpc.aio.ServicerContext
    ) -> pb.SandboxReadFileResponse:
        tenant = self._auth.tenant(context)
        data, truncated = await self._sandboxes.read_file(
            tenant,
            check_id(request.sandbox_id, "sandbox_id"),
            _path(request.path),
            request.max_bytes,
            until_sent=at_end(context),
        )
        return pb.SandboxReadFileResponse(content=data, truncated=truncated)

    async def WriteFile(
        self, request: pb.SandboxWriteFileRequest, context: grpc.aio.ServicerContext
    ) -> pb.SandboxWriteFileResponse:
        tenant = self._auth.tenant(context)
        await self._sandboxes.write_file(
            tenant, check_id(request.sandbox_id, "sandbox_id"), _path(request.path), request.content, request.mode
        )
        return pb.SandboxWriteFileResponse()

    async def Upload(
        self, request: pb.SandboxUploadRequest, context: grpc.aio.ServicerContext
    ) -> pb.SandboxUploadResponse:
        tenant = self._auth.tenant(context)
        dest = _path(request.dest_dir, "dest_dir") if request.dest_dir else "."
        files = await self._sandboxes.upload(tenant, check_id(request.sandbox_id, "sandbox_id"), request.tar, dest)
        return pb.SandboxUploadResponse(files=files)

    async def Download(
        self, request: pb.SandboxDownloadRequest, context: grpc.aio.ServicerContext
    ) -> pb.SandboxDownloadResponse:
        tenant = self._auth.tenant(context)
        tar = await self._sandboxes.download(
            tenant, check_id(request.sandbox_id, "sandbox_id"), _path(request.path), until_sent=at_end(context)
        )
        return pb.SandboxDownloadResponse(tar=tar)

    async def Delete(
        self, request: pb.DeleteSandboxRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteSandboxResponse:
        tenant = self._auth.tenant(context)
        await self._sandboxes.delete(tenant, check_id(request.sandbox_id, "sandbox_id"))
        return pb.DeleteSandboxResponse()
