"""A job's policy URL is the tenant's choice, so the server behind it is untrusted: the operator may restrict policy
URLs to an allowlist, a response is read under a size cap, and no error message quotes a response body."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

from orchestrator.core.errors import PermissionDeniedError, PolicyHTTPError, PolicyResponseError
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.server.security import PolicyURLs, SecurityConfig
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc
from tests.orchestrator.conftest import ENV
from tests.orchestrator.servers import expect_error, serve

SECRET = "aws-secret-0123456789-from-the-metadata-service"
MESSAGES = [{"role": "user", "content": "hi"}]
Respond = Callable[[asyncio.StreamWriter], Awaitable[None]]


def test_allowlist_matching() -> None:
    allow = PolicyURLs(["http://127.0.0.1:8000/v1", "https://*.inference.internal"])
    for ok in ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1/", "https://a.inference.internal/v1"):
        allow.check(ok)
    for bad in (
        "http://169.254.169.254/latest/meta-data",
        "http://127.0.0.1:8001/v1",  # another port
        "https://127.0.0.1:8000/v1",  # another scheme
        "http://127.0.0.1:8000/v10",  # a path that only starts with the prefix's text
        "http://127.0.0.1:8000@evil.example/v1",  # user info: the host is evil.example
        "https://inference.internal.evil.example/v1",
        "https://evilinference.internal/v1",
    ):
        with pytest.raises(PermissionDeniedError, match="not in this server's allowlist"):
            allow.check(bad)
    PolicyURLs(None).check("http://169.254.169.254/")  # the default: any URL (documented)
    with pytest.raises(ValidationError, match="without user info"):
        SecurityConfig(policy_urls=["http://user@host/v1"])


async def test_submit_and_update_policy_obey_the_allowlist(tmp_path: Path, base_image: str) -> None:
    allowed = "http://127.0.0.1:9/v1"
    async with (
        serve(tmp_path / "data", security={"policy_urls": [allowed]}) as orch,
        grpc.aio.insecure_channel(orch.address) as channel,
    ):
        stub = pb_grpc.RolloutServiceStub(channel)

        def job(url: str) -> pb.JobSpec:
            tasks = pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["py-000"])
            return pb.JobSpec(env=ENV, tasks=tasks, policy=pb.PolicyEndpoint(base_url=url, max_retries=0))

        await expect_error(
            stub.SubmitJob(job("http://169.254.169.254/latest"), timeout=30),
            grpc.StatusCode.PERMISSION_DENIED,
            "not in this server's allowlist",
        )
        reply = await stub.SubmitJob(job(allowed), timeout=30)
        await expect_error(
            stub.UpdatePolicy(
                pb.UpdatePolicyRequest(job_id=reply.job_id, version="2", base_url="http://10.0.0.1/v1"), timeout=30
            ),
            grpc.StatusCode.PERMISSION_DENIED,
            "not in this server's allowlist",
        )
        await stub.CancelJob(pb.CancelJobRequest(job_id=reply.job_id), timeout=30)


@pytest.fixture
async def http_server() -> AsyncIterator[Callable[[Respond], Awaitable[str]]]:
    """Starts one-shot HTTP servers on loopback that answer every request with `respond`."""
    servers: list[asyncio.Server] = []

    async def start(respond: Respond) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            await reader.readexactly(length)
            try:
                await respond(writer)
            except ConnectionError:
                pass  # the client stopped reading: that is the point of some tests
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()


def _answer(status: str, body: bytes, content_type: str = "application/json") -> Respond:
    async def respond(writer: asyncio.StreamWriter) -> None:
        head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()

    return respond


@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        ("403 Forbidden", f'{{"Code": "Success", "SecretAccessKey": "{SECRET}"}}'.encode(), PolicyHTTPError),
        ("200 OK", f"<html>{SECRET}</html>".encode(), PolicyResponseError),
        ("200 OK", f'{{"{SECRET}": 1, "data": "{SECRET}"}}'.encode(), PolicyResponseError),
        (
            "200 OK",
            f'{{"choices": [{{"message": {{"tool_calls": [{{"x": "{SECRET}"}}]}}}}]}}'.encode(),
            PolicyResponseError,
        ),
    ],
)
async def test_error_messages_do_not_quote_response_bodies(
    http_server: Callable[[Respond], Awaitable[str]], status: str, body: bytes, error: type[Exception]
) -> None:
    url = await http_server(_answer(status, body))
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, max_retries=0))
    try:
        with pytest.raises(error) as e:
            await policy.complete(MESSAGES, [], Sampling())
    finally:
        await policy.aclose()
    assert SECRET[:20] not in str(e.value), str(e.value)
    assert SECRET[:20] not in getattr(e.value, "body", "")


async def test_a_huge_response_is_cut_at_the_cap(http_server: Callable[[Respond], Awaitable[str]]) -> None:
    sent = 0

    async def endless(writer: asyncio.StreamWriter) -> None:  # chunked, no length: the cap must stop the read
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"[" + b"1," * 32767 + b"1"
        for _ in range(4096):  # up to 256 MiB
            writer.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            await writer.drain()
            sent += len(chunk)

    url = await http_server(endless)
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, max_retries=0), max_response_bytes=1 << 20)
    started = time.monotonic()
    try:
        with pytest.raises(PolicyResponseError, match=r"sent more than 1048576 bytes; the limit is 1048576 bytes"):
            await policy.complete(MESSAGES, [], Sampling())
    finally:
        await policy.aclose()
    assert time.monotonic() - started < 10
    assert sent < 64 << 20  # the client stopped reading long before the end

    declared = await http_server(_answer("200 OK", b"x" * (2 << 20)))
    policy = OpenAIPolicy(PolicyEndpoint(base_url=declared, max_retries=0), max_response_bytes=1 << 20)
    try:
        with pytest.raises(PolicyResponseError, match="declares 2097152 bytes"):
            await policy.complete(MESSAGES, [], Sampling())
    finally:
        await policy.aclose()
