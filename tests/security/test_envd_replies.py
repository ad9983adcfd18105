"""The host does not take envd's word for how much it sends.

envd comes from the sandbox's image, and a tenant's image (a declarative spec's or a Harbor task's Dockerfile) can
hold another one. Whatever answers on the socket, the host holds no more than the call allowed: output past
max_output, a file past max_bytes, a reset's detail past a few KiB, or a stream that ends without the process's end
is an unavailable sandbox (SandboxUnavailableError), never a reply held in full or an assertion. A real gRPC server on
a real unix socket stands in for the hostile envd.
"""

from __future__ import annotations

import asyncio
import io
import subprocess
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orchestrator.backends.envd_transport import MAX_RESET_DETAIL, SMALL_REPLY_BYTES, STREAM_STDIN_OVER, EnvdTransport
from orchestrator.core.errors import SandboxUnavailableError
from orchestrator.core.sandbox import Transport
from orchestrator.rollout.snapshots import _rebase, _Unusable
from protos import envd_pb2 as pb
from protos import envd_pb2_grpc as pb_grpc

CHUNK = 1 << 20


class HostileProcess(pb_grpc.ProcessServicer):  # type: ignore[misc]
    """Sends what it likes: 4 MiB for a Run, output without end on a stream, an endless reset detail."""

    def __init__(self) -> None:
        self.streamed = 0  # bytes of output the stream handed to gRPC
        self.stream_over = asyncio.Event()
        self.end_without_exit = False
        self.run_bytes = 2 << 20  # of stdout, and as much of stderr
        self.reset_detail = 8 << 20

    async def Run(self, request: pb.ProcessRequest, context: grpc.aio.ServicerContext) -> pb.RunResult:
        out = b"o" * self.run_bytes
        return pb.RunResult(stdout=out, stderr=out, ended=pb.Ended(exit_code=0))

    async def _flood(self) -> AsyncIterator[pb.ProcessEvent]:
        yield pb.ProcessEvent(started=pb.Started(pid=7))
        if self.end_without_exit:
            yield pb.ProcessEvent(stdout=b"done\n")
            return
        try:
            while True:
                self.streamed += CHUNK
                yield pb.ProcessEvent(stdout=b"x" * CHUNK)
        finally:
            self.stream_over.set()

    async def Start(
        self, request: pb.ProcessRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessEvent]:
        async for ev in self._flood():
            yield ev

    async def StartStream(
        self, requests: AsyncIterator[pb.ProcessInput], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessEvent]:
        await anext(aiter(requests))
        async for ev in self._flood():
            yield ev

    async def Reset(self, request: pb.ResetRequest, context: grpc.aio.ServicerContext) -> pb.ResetResponse:
        return pb.ResetResponse(ok=False, detail="d" * self.reset_detail)


class HostileFiles(pb_grpc.FilesystemServicer):  # type: ignore[misc]
    async def ReadFile(self, request: pb.ReadFileRequest, context: grpc.aio.ServicerContext) -> pb.ReadFileResponse:
        return pb.ReadFileResponse(content=b"1" + b" " * (max(request.max_bytes, 16 << 20) + 100))


@pytest.fixture
async def hostile(tmp_path: Path) -> AsyncIterator[tuple[EnvdTransport, HostileProcess]]:
    process = HostileProcess()
    server = grpc.aio.server(options=[("grpc.max_send_message_length", 64 << 20)])
    pb_grpc.add_ProcessServicer_to_server(process, server)
    pb_grpc.add_FilesystemServicer_to_server(HostileFiles(), server)
    sock = tmp_path / "envd.sock"
    server.add_insecure_port(f"unix://{sock}")
    await server.start()
    transport = EnvdTransport(str(sock), "token")
    try:
        yield transport, process
    finally:
        await transport.close()
        await server.stop(None)


async def test_a_run_reply_past_max_output_is_refused(hostile: tuple[EnvdTransport, HostileProcess]) -> None:
    transport, _ = hostile
    with pytest.raises(SandboxUnavailableError, match="over the 65536 the call allowed"):
        await transport.exec(["true"], max_output=64 << 10)
    # no max_output named: envd's own default (1 MiB) is the cap
    with pytest.raises(SandboxUnavailableError, match="bytes of output"):
        await transport.exec(["true"])


async def test_a_reply_past_what_the_call_could_need_is_refused_before_it_is_held(
    hostile: tuple[EnvdTransport, HostileProcess],
) -> None:
    # every reply of up to 64 MiB was read and held whole before the call's cap was checked (about 200 MiB of the
    # worker's memory a call), and a gzip reply of 64 KiB on the wire was as much: now a call of a small cap takes a
    # reply of SMALL_REPLY_BYTES at most, refused by its length, and no compressed reply at all
    transport, process = hostile
    process.run_bytes = 30 << 20
    with pytest.raises(SandboxUnavailableError, match="RESOURCE_EXHAUSTED") as e:
        await transport.exec(["true"], max_output=64 << 10)
    assert "the call allowed" not in str(e.value)  # gRPC refused it by its length, not the check after holding it
    # a call whose own cap is large is still answered in full (a test log, a raw Exec's max_output)
    process.run_bytes = SMALL_REPLY_BYTES
    r = await transport.exec(["true"], max_output=3 * SMALL_REPLY_BYTES)
    assert len(r.stdout) == len(r.stderr) == SMALL_REPLY_BYTES


async def test_a_stream_past_max_output_is_cut(hostile: tuple[EnvdTransport, HostileProcess]) -> None:
    transport, process = hostile
    # stdin over STREAM_STDIN_OVER takes the streamed path, where the output is gathered here
    with pytest.raises(SandboxUnavailableError, match="bytes of output"):
        await asyncio.wait_for(
            transport.exec(["cat"], stdin=b"i" * (STREAM_STDIN_OVER + 1), max_output=64 << 10), timeout=30
        )
    await asyncio.wait_for(process.stream_over.wait(), timeout=30)  # the call was cancelled: the flood stopped
    assert process.streamed < 64 << 20
    # and the plain stream, as a raw Exec reads it
    process.stream_over.clear()
    seen = 0
    with pytest.raises(SandboxUnavailableError):
        async for ev in transport.exec_stream(["yes"], cwd=None, env=None, stdin=b"", timeout=5, max_output=3 << 20):
            seen += len(getattr(ev, "data", b""))
    assert seen <= 3 << 20
    await asyncio.wait_for(process.stream_over.wait(), timeout=30)


async def test_a_stream_without_the_exit_is_unavailable(hostile: tuple[EnvdTransport, HostileProcess]) -> None:
    transport, process = hostile
    process.end_without_exit = True
    with pytest.raises(SandboxUnavailableError, match="without the process's exit status"):
        await Transport.exec(transport, ["true"])  # gathered from the stream (Start), as a large stdin's exec is


async def test_a_file_past_max_bytes_is_refused(hostile: tuple[EnvdTransport, HostileProcess]) -> None:
    transport, _ = hostile
    # a grader reading "1" and a megabyte of blanks as the whole file would read a reward
    with pytest.raises(SandboxUnavailableError, match="RESOURCE_EXHAUSTED"):  # refused by its length, never held
        await transport.read_file("/logs/verifier/reward.txt", max_bytes=1025)
    with pytest.raises(SandboxUnavailableError, match="bytes of '/x'"):
        await transport.read_file("/x")


async def test_a_reset_detail_is_cut(hostile: tuple[EnvdTransport, HostileProcess]) -> None:
    transport, process = hostile
    outcome = await transport.reset("")  # 8 MiB: refused by its length
    assert not outcome.ok and "RESOURCE_EXHAUSTED" in outcome.detail and len(outcome.detail) <= MAX_RESET_DETAIL
    process.reset_detail = 1 << 20
    outcome = await transport.reset("")
    assert not outcome.ok
    assert len(outcome.detail) == MAX_RESET_DETAIL


def test_a_sparse_snapshot_is_not_expanded(tmp_path: Path) -> None:
    """A workspace archive of a few KB whose sparse member claims 64 MiB is refused, not written out as zeros."""
    ws = tmp_path / "workspace"
    ws.mkdir()
    with open(ws / "big", "wb") as f:
        f.truncate(64 << 20)
    tar = subprocess.run(
        ["tar", "-C", str(tmp_path), "--sparse", "--format=gnu", "-cf", "-", "workspace"],
        check=True,
        capture_output=True,
    ).stdout
    assert len(tar) < 64 << 10
    with pytest.raises(_Unusable, match="sparse"):
        _rebase(tar, "/workspace", 256 << 20)


def test_a_snapshot_past_its_room_is_refused() -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as t:
        for name in ("workspace/a", "workspace/b"):
            info = tarfile.TarInfo(name)
            info.size = 600
            t.addfile(info, io.BytesIO(b"z" * 600))
    assert _rebase(out.getvalue(), "/workspace", 1200)
    with pytest.raises(_Unusable, match="over 1000 bytes"):
        _rebase(out.getvalue(), "/workspace", 1000)


async def test_a_stream_without_the_exit_is_refused_as_it_streams(
    hostile: tuple[EnvdTransport, HostileProcess],
) -> None:
    """A raw Exec passes envd's events on as they come: a stream that ends without the exit status must not end as
    one that did (a trainer reading `ended.exit_code` read 0)."""
    transport, process = hostile
    process.end_without_exit = True
    events = []
    with pytest.raises(SandboxUnavailableError, match="without the process's exit status"):
        async for ev in transport.exec_stream(["true"], cwd=None, env=None, stdin=b"", timeout=5, max_output=None):
            events.append(ev)
    assert len(events) == 2  # started, the output: then the refusal
