"""A job's policy URL is the tenant's choice, so the server behind it is untrusted: the operator may restrict policy
URLs to an allowlist (compared on the path that is sent), a response is read under a size cap, no error message quotes
a response body, a redirect is an answer (never followed), no credentials from ~/.netrc are sent, and the clients of
the endpoints a tenant names are bounded."""

from __future__ import annotations

import asyncio
import json
import netrc
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from pydantic import ValidationError

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import EnvfleetError, PermissionDeniedError, PolicyHTTPError, PolicyResponseError
from orchestrator.core.models import RolloutStatus
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.server.security import PolicyURLs, SecurityConfig
from orchestrator.service import executor
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, Step, start_scripted_server
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE, expect_error, serve

SECRET = "aws-secret-0123456789-from-the-metadata-service"
MESSAGES = [{"role": "user", "content": "hi"}]
API_KEY = "sk-tenant-key-0123456789"
# a complete chat completion: what a canary answers, so a followed redirect would come back as the policy's turn
CHAT = json.dumps({"choices": [{"message": {"content": "canary"}, "finish_reason": "stop"}]}).encode()
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
        # dot segments: the client resolves them before sending, so these go to /v2 (or /) on an allowed host
        "http://127.0.0.1:8000/v1/../v2",
        "http://127.0.0.1:8000/v1/%2e%2e/v2",
        "http://127.0.0.1:8000/v1/%2E%2e/%2e./",
        "http://127.0.0.1:8000/v1/./../v2",
        "http://127.0.0.1:8000/v1/..",
        "http://127.0.0.1:8000/v1/%252e%252e/v2",  # decoded twice by a gateway
        "http://127.0.0.1:8000/v1/..%2fv2",  # %2f decoded by a gateway
        "http://127.0.0.1:8000/v1\\..\\v2",  # backslashes read as slashes by a gateway
        "http://127.0.0.1:8000/v1/..;x=1/v2",  # a path parameter (Tomcat, Spring) on a dot segment
    ):
        with pytest.raises(PermissionDeniedError, match="not in this server's allowlist"):
            allow.check(bad)
    with pytest.raises(PermissionDeniedError, match=r"its path has a dot segment .*; give the path without them"):
        allow.check("http://127.0.0.1:8000/v1/%2e%2e/v2")
    allow.check("http://127.0.0.1:8000/v1/a..b/.well-known/%2e%2e.c")  # dots inside a segment are just names
    PolicyURLs(None).check("http://169.254.169.254/")  # the default: any URL (documented)
    with pytest.raises(ValidationError, match="has a dot segment in its path"):
        SecurityConfig(policy_urls=["http://127.0.0.1:8000/v1/../v2"])
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


@pytest.mark.parametrize("new_key", ["sk-for-the-new-host", ""])
async def test_an_api_key_stays_on_the_origin_it_was_given_for(
    tmp_path: Path, recording_server: Callable[[Respond], Awaitable[tuple[str, Heard]]], new_key: str
) -> None:
    """UpdatePolicy moved a job to any base_url with the job's api_key: whoever held the tenant's token (not the key,
    which no call answers) pointed the job at a host of theirs and read the key in the next rollout's header. A new
    origin (scheme, host, port) needs its own key in the request; a new path on the same origin keeps the key."""

    async def slow(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(1.5)  # past the job's request timeout: its rollout fails, and the next one starts
        await _answer("200 OK", CHAT)(writer)

    old_url, old = await recording_server(slow)
    new_url, new = await recording_server(_answer("200 OK", CHAT))
    async with serve(tmp_path / "data", backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        stub = client.rollout_stub
        tasks = pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["py-000", "py-001"])
        policy = pb.PolicyEndpoint(base_url=old_url, api_key=API_KEY, max_retries=0, request_timeout_s=1)
        job_id = (await stub.SubmitJob(pb.JobSpec(env=ENV, tasks=tasks, policy=policy, max_concurrency=1))).job_id

        async def update(version: str, url: str, **key: str) -> None:
            await stub.UpdatePolicy(pb.UpdatePolicyRequest(job_id=job_id, version=version, base_url=url, **key))

        details = await expect_error(
            update("2", new_url), grpc.StatusCode.INVALID_ARGUMENT, "another origin", "send api_key with the new"
        )
        assert API_KEY not in details
        await update("2", old_url.removesuffix("/v1") + "/v2")  # the same origin: the key goes along
        await update("3", new_url, api_key=new_key)
        for _ in range(200):
            if new.requests:
                break
            await asyncio.sleep(0.05)
        sent = {h.get("authorization") for _, h, _ in new.requests}
        assert sent == {f"Bearer {new_key}" if new_key else None}, sent
        assert all(h.get("authorization") == f"Bearer {API_KEY}" for _, h, _ in old.requests), old.requests
        await client.cancel_job(job_id)


@dataclass
class Heard:
    """The requests one loopback server received: request line, headers (names in lower case), body."""

    requests: list[tuple[str, dict[str, str], bytes]] = field(default_factory=list)


@pytest.fixture
async def recording_server() -> AsyncIterator[Callable[[Respond], Awaitable[tuple[str, Heard]]]]:
    """Starts HTTP servers on loopback that answer every request with `respond` (one per connection) and record
    what they receive; each start gives the server's base URL (.../v1) and its record."""
    servers: list[asyncio.Server] = []

    async def start(respond: Respond) -> tuple[str, Heard]:
        heard = Heard()

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            request_line = (await reader.readline()).decode(errors="replace").strip()
            headers: dict[str, str] = {}
            while (line := await reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode(errors="replace").partition(":")
                headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            heard.requests.append((request_line, headers, body))
            try:
                await respond(writer)
            except ConnectionError:
                pass  # the client stopped reading: that is the point of some tests
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1", heard

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()


@pytest.fixture
def http_server(
    recording_server: Callable[[Respond], Awaitable[tuple[str, Heard]]],
) -> Callable[[Respond], Awaitable[str]]:
    """Starts HTTP servers on loopback that answer every request with `respond`; each start gives the base URL."""

    async def start(respond: Respond) -> str:
        url, _ = await recording_server(respond)
        return url

    return start


def _answer(status: str, body: bytes, content_type: str = "application/json", extra: str = "") -> Respond:
    async def respond(writer: asyncio.StreamWriter) -> None:
        head = f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
        writer.write(head.encode() + body)
        await writer.drain()

    return respond


@pytest.mark.parametrize("status", ["307 Temporary Redirect", "308 Permanent Redirect"])
async def test_a_redirect_is_an_answer_and_never_followed(
    tmp_path: Path, recording_server: Callable[[Respond], Awaitable[tuple[str, Heard]]], status: str
) -> None:
    """An allowlisted server that redirects the POST (say to the metadata service) gets a POLICY_ERROR back; the
    place it names hears nothing: not the request, not the tenant's API key, and its answer is never a turn."""
    canary_url, canary = await recording_server(_answer("200 OK", CHAT))
    policy_url, policy = await recording_server(
        _answer(status, b"", extra=f"Location: {canary_url}/chat/completions\r\n")
    )
    task = Registry.from_entry_points().get(ENV).tasks()[0].id
    spec = job(policy_url, [task])
    spec = spec.model_copy(update={"policy": spec.policy.model_copy(update={"api_key": API_KEY, "max_retries": 0})})
    async with serve(tmp_path / "data", backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        job_id = await client.submit(spec)
        async with asyncio.timeout(60):
            (r,) = [r async for r in client.rollouts(job_id)]
    assert [(line, h.get("authorization")) for line, h, _ in policy.requests] == [
        ("POST /v1/chat/completions HTTP/1.1", f"Bearer {API_KEY}")
    ]
    assert canary.requests == []
    assert r.status == RolloutStatus.POLICY_ERROR and r.reward is None, (r.status, r.reward, r.error)
    assert r.error is not None and f"answered HTTP {status.split()[0]}" in r.error.message


async def test_netrc_credentials_are_never_sent(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    recording_server: Callable[[Respond], Awaitable[tuple[str, Heard]]],
) -> None:
    """The environment gives the client proxies only: a ~/.netrc entry for the policy's host (the operator's
    credentials for some other service there) is never sent to the tenant's server."""
    url, heard = await recording_server(_answer("200 OK", CHAT))
    rc = tmp_path / ".netrc"
    rc.write_text(f"machine 127.0.0.1 login operator password {SECRET}\n")
    rc.chmod(0o600)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("NETRC", raising=False)
    assert netrc.netrc(str(Path.home() / ".netrc")).authenticators("127.0.0.1") is not None  # a client would use it
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, max_retries=0))
    try:
        completion = await policy.complete(MESSAGES, [], Sampling())
    finally:
        await policy.aclose()
    assert completion.text == "canary"
    ((_, headers, _),) = heard.requests
    assert "authorization" not in headers, headers
    assert SECRET not in repr(headers)


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


@pytest.mark.parametrize("answer", ["500 Internal Server Error", "unreachable", "too big"])
async def test_error_messages_leave_out_the_urls_credentials(
    http_server: Callable[[Respond], Awaitable[str]], answer: str
) -> None:
    # the client sends a URL's user:password as HTTP Basic auth, and a gateway's key may ride in its query; every
    # error's message quoted the whole URL, into the log, the trainer's rollout and each trace's span (an OTLP
    # collector's), where the api_key itself is never shown
    if answer == "unreachable":
        holder = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = holder.sockets[0].getsockname()[1]
        holder.close()
        await holder.wait_closed()
        url = f"http://127.0.0.1:{port}/v1"
    else:
        body = b"x" * 4096 if answer == "too big" else b"{}"
        url = await http_server(_answer("200 OK" if answer == "too big" else answer, body, "text/plain"))
    secret_url = url.replace("http://", f"http://alice:{SECRET}@") + f"?key={SECRET}x"
    endpoint = PolicyEndpoint(base_url=secret_url, max_retries=0, outage_wait_s=0)
    policy = OpenAIPolicy(endpoint, max_response_bytes=1024)
    try:
        with pytest.raises(EnvfleetError) as e:
            await policy.complete(MESSAGES, [], Sampling())
    finally:
        await policy.aclose()
    message = str(e.value)
    assert "policy server http://127.0.0.1:" in message and SECRET[:20] not in message and "alice" not in message


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


def _established_to(port: int) -> int:
    """TCP connections of this host in state ESTABLISHED whose remote end is 127.0.0.1:`port`."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for line in lines if line.split()[2] == f"0100007F:{port:04X}" and line.split()[3] == "01")


async def test_policy_clients_of_many_endpoints_are_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # every API key is an endpoint of its own, with its own client and pools: a tenant cycling through keys (or
    # models) made clients and sockets without end; past the cap the least recently used idle ones are closed
    monkeypatch.setattr(executor, "MAX_POLICY_CLIENTS", 3)
    task_id = Registry.from_entry_points().get(ENV).tasks()[0].id
    script = Script(default=[Step(content="done")])
    async with (
        await start_scripted_server(script, tokens=False) as scripted,
        serve(tmp_path / "data", backend=FAKE) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        port = int(scripted.url.rsplit(":", 1)[1].split("/")[0])
        for n in range(8):
            spec = job(scripted.url, [task_id])
            spec = spec.model_copy(update={"policy": spec.policy.model_copy(update={"api_key": f"key-{n}"})})
            statuses = [r.status async for r in client.rollouts(await client.submit(spec))]
            assert statuses == [RolloutStatus.OK]
        local = orch.jobs.executor
        assert isinstance(local, executor.LocalExecutor)
        assert local.open_clients == 3
        for _ in range(20):  # and their sockets: evicted clients close in the background (within the 5 s an idle
            if _established_to(port) <= 3:  # keep-alive connection lasts anyway)
                break
            await asyncio.sleep(0.1)
        assert 1 <= _established_to(port) <= 3


async def test_a_job_resumed_after_the_allowlist_narrowed_is_cancelled_not_run(tmp_path: Path) -> None:
    # a restart resumed the log's jobs without SubmitJob's checks: a job kept calling a policy URL the operator had
    # since taken off the allowlist, with the job's API key
    hit: list[str] = []

    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hit.append("called")  # never answers: the job stays unfinished across the restart
        await reader.read()

    server = await asyncio.start_server(held, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
    try:
        async with serve(tmp_path / "data", backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
            tasks = pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["py-000"])
            spec = pb.JobSpec(env=ENV, tasks=tasks, policy=pb.PolicyEndpoint(base_url=url, max_retries=0))
            job_id = (await client.rollout_stub.SubmitJob(spec)).job_id
            for _ in range(100):
                if hit:
                    break
                await asyncio.sleep(0.05)
        hit.clear()
        narrowed = {"policy_urls": ["http://127.0.0.1:9/v1"]}
        async with serve(tmp_path / "data", backend=FAKE, security=narrowed) as orch, EnvfleetClient(orch.address) as c:
            status = await c.get_job(job_id)
            await asyncio.sleep(0.5)
        assert status.state == "CANCELLED" and not hit
    finally:
        server.close()
        await server.wait_closed()


async def test_refusals_and_logs_leave_out_a_policy_urls_credentials(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # the allowlist's refusal, a malformed URL's and a stored job that no longer loads quoted the URL (or the
    # api_key) whole: the caller's own, but each went to the server log too, read by others
    import sqlite3

    from orchestrator.service.store import ResultStore

    url = "https://user:S3CRET@evil.example/v1?key=QKEY"
    with pytest.raises(PermissionDeniedError) as refused:
        PolicyURLs(["https://good.example/v1"]).check(url)
    with pytest.raises(ValidationError) as malformed:
        PolicyEndpoint(base_url="https://user:S3CRET@/v1?key=QKEY")
    from orchestrator.core.echo import error_text
    from orchestrator.server.convert import validation_message

    for shown in (str(refused.value), validation_message(malformed.value), error_text(malformed.value)):
        assert "S3CRET" not in shown and "QKEY" not in shown, shown
    assert "evil.example/v1" in str(refused.value)

    path = tmp_path / "log.sqlite3"
    store = await ResultStore.open(path)
    await store.close()
    spec = {"env": "python-tool", "policy": {"base_url": "http://127.0.0.1:1/v1", "api_key": "sk-SENTINEL\u0007"}}
    with sqlite3.connect(path) as db:
        db.execute(
            "INSERT INTO jobs (job_id, spec, state, created_at, total) VALUES (?, ?, 'RUNNING', 0, 1)",
            ("j", json.dumps(spec)),
        )
    store = await ResultStore.open(path)
    try:
        with caplog.at_level("ERROR"):
            assert await store.jobs() == []
    finally:
        await store.close()
    assert "does not load" in caplog.text and "SENTINEL" not in caplog.text, caplog.text
