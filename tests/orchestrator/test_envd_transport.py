"""The envd transport when its sandbox goes under a call: a real gRPC server on a real unix socket stands in for a
slow envd."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.backends.envd_transport import EnvdTransport
from orchestrator.core.errors import SandboxUnavailableError
from protos import envd_pb2 as pb
from protos import envd_pb2_grpc as pb_grpc


class SlowProcess(pb_grpc.ProcessServicer):  # type: ignore[misc]
    async def Run(self, request: pb.ProcessRequest, context: grpc.aio.ServicerContext) -> pb.RunResult:
        await asyncio.sleep(60)
        return pb.RunResult()

    async def Start(
        self, request: pb.ProcessRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessEvent]:
        yield pb.ProcessEvent(started=pb.Started(pid=7))
        await asyncio.sleep(60)

    async def StartStream(
        self, requests: AsyncIterator[pb.ProcessInput], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessEvent]:
        await asyncio.sleep(60)
        yield pb.ProcessEvent(started=pb.Started(pid=7))


class SlowFiles(pb_grpc.FilesystemServicer):  # type: ignore[misc]
    async def ReadFile(self, request: pb.ReadFileRequest, context: grpc.aio.ServicerContext) -> pb.ReadFileResponse:
        await asyncio.sleep(60)
        return pb.ReadFileResponse()

    async def Download(
        self, request: pb.DownloadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DataChunk]:
        await asyncio.sleep(60)
        yield pb.DataChunk()


@pytest.fixture
async def slow_envd(tmp_path: Path) -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_ProcessServicer_to_server(SlowProcess(), server)
    pb_grpc.add_FilesystemServicer_to_server(SlowFiles(), server)
    socket = str(tmp_path / "envd.sock")
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    yield socket
    await server.stop(0)


async def _stream(t: EnvdTransport, **stdin: Any) -> list[Any]:
    return [ev async for ev in t.exec_stream(["sleep", "60"], timeout=60, **stdin)]


async def _chunks() -> AsyncIterator[bytes]:
    yield b"in"


CALLS: dict[str, Callable[[EnvdTransport], Awaitable[Any]]] = {
    "exec": lambda t: t.exec(["sleep", "60"], timeout=60),
    "exec_stream": _stream,
    "exec_stream with stdin": lambda t: _stream(t, stdin=_chunks()),
    "read_file": lambda t: t.read_file("/workspace/x"),
    "download": lambda t: t.download("/workspace"),
}


@pytest.mark.parametrize("call", CALLS)
async def test_a_call_the_sandboxs_removal_ends_fails_as_the_sandboxs(slow_envd: str, call: str) -> None:
    # the transport's close (a Delete, a TTL, a session closed mid-step) cancels the calls on its channel, which grpc
    # raised as a bare CancelledError in a task nobody had cancelled: the Step or Exec that made the call got no
    # status at all (a client without a deadline waited for ever), and a rollout's task ended unlogged
    t = EnvdTransport(slow_envd, "token")
    running = asyncio.ensure_future(CALLS[call](t))
    await asyncio.sleep(0.3)
    await t.close()
    with pytest.raises(SandboxUnavailableError, match="removed while"):
        await running
    with pytest.raises(SandboxUnavailableError, match="removed before"):  # and a call after it
        await CALLS[call](t)
    assert await t.health(1) is False and await t.probe(1) == "gone"


async def test_a_cancelled_caller_is_still_cancelled(slow_envd: str) -> None:
    t = EnvdTransport(slow_envd, "token")
    running = asyncio.ensure_future(t.exec(["sleep", "60"], timeout=60))
    await asyncio.sleep(0.3)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    closing = asyncio.ensure_future(t.read_file("/x"))  # the caller's cancel, also while the channel closes
    await asyncio.sleep(0.3)
    closing.cancel()
    await t.close()
    with pytest.raises(asyncio.CancelledError):
        await closing
