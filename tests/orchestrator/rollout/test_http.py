"""The policy's HTTP client (orchestrator/rollout/policy/http.py, on aiohttp) against raw servers on loopback sockets:
keep-alive, the three ways a body ends, informational answers, servers that hang up or break HTTP, proxies."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from orchestrator.core.errors import PolicyConnectionError, PolicyError, PolicyTokenError
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.rollout.policy import http
from orchestrator.rollout.policy.client import OpenAIPolicy, _dumps, _loads
from orchestrator.rollout.policy.parsing import parse_chat_completion

MESSAGES = [{"role": "user", "content": "hi"}]
OK_BODY = json.dumps({"model": "m", "choices": [{"message": {"content": "fine"}}]}).encode()


class Server:
    """A loopback HTTP server whose answers the test writes byte for byte; it records every request it read."""

    def __init__(self, answer: Callable[[int, asyncio.StreamWriter], Awaitable[bool]]) -> None:
        self.answer = answer  # (request number, writer) -> keep the connection open
        self.connections = 0
        self.requests: list[tuple[bytes, dict[bytes, bytes], bytes]] = []
        self.server: asyncio.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                headers: dict[bytes, bytes] = {}
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = h.partition(b":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get(b"content-length", b"0")))
                self.requests.append((line, headers, body))
                if not await self.answer(len(self.requests), writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"


@pytest.fixture
async def serve() -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    servers: list[Server] = []

    async def start(answer: Callable[[int, asyncio.StreamWriter], Awaitable[bool]]) -> Server:
        s = Server(answer)
        s.server = await asyncio.start_server(s._handle, "127.0.0.1", 0)
        servers.append(s)
        return s

    yield start
    for s in servers:
        assert s.server is not None
        s.server.close()


def _reply(body: bytes, *extra: str, status: str = "200 OK") -> bytes:
    head = [f"HTTP/1.1 {status}", "Content-Type: application/json", *extra]
    if not any(e.lower().startswith(("transfer-encoding", "content-length")) for e in extra):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def _complete(url: str, **kw: object) -> str:
    """One request, no retry, no wait for a server that is down: what one answer makes of it."""
    policy = OpenAIPolicy(PolicyEndpoint(base_url=url, max_retries=0, **{"outage_wait_s": 0, **kw}))  # type: ignore[arg-type]
    try:
        return (await policy.complete(MESSAGES, [], Sampling())).text
    finally:
        await policy.aclose()


async def test_keep_alive_reuses_one_connection_and_sends_the_request_as_httpx_did(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        w.write(_reply(OK_BODY))
        return True

    s = await serve(answer)
    policy = OpenAIPolicy(PolicyEndpoint(base_url=s.url, api_key="sk-1", max_retries=0))
    try:
        for _ in range(3):
            assert (await policy.complete(MESSAGES, [], Sampling(), user="j:t:0")).text == "fine"
    finally:
        await policy.aclose()
    assert (s.connections, len(s.requests)) == (1, 3)
    line, headers, body = s.requests[0]
    assert line == b"POST /v1/chat/completions HTTP/1.1\r\n"
    assert headers[b"host"] == s.url.split("/")[2].encode()
    assert headers[b"authorization"] == b"Bearer sk-1"
    assert headers[b"content-type"] == b"application/json"
    assert json.loads(body)["user"] == "j:t:0"


@pytest.mark.parametrize(
    "raw",
    [
        # chunked, split across chunks mid-JSON
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"%x\r\n%s\r\n" % (len(OK_BODY[i : i + 7]), OK_BODY[i : i + 7]) for i in range(0, len(OK_BODY), 7))
        + b"0\r\n\r\n",
        # HTTP/1.0 with neither length nor chunks: the body ends when the server closes
        b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + OK_BODY,
        # an informational answer first (103 Early Hints), then the real one
        b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" + _reply(OK_BODY),
    ],
    ids=["chunked", "until-close", "informational-first"],
)
async def test_every_way_a_body_ends(serve: Callable[..., Awaitable[Server]], raw: bytes) -> None:
    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        for i in range(0, len(raw), 5):  # dribbled, so that the parser sees partial heads and bodies
            w.write(raw[i : i + 5])
            await w.drain()
        return b"HTTP/1.0" not in raw

    s = await serve(answer)
    assert await _complete(s.url) == "fine"


async def test_a_connection_the_server_closed_while_idle_is_replaced(serve: Callable[..., Awaitable[Server]]) -> None:
    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        w.write(_reply(OK_BODY))
        return False  # and close, as a server's keep-alive timeout does

    s = await serve(answer)
    policy = OpenAIPolicy(PolicyEndpoint(base_url=s.url, max_retries=0))
    try:
        for _ in range(3):
            assert (await policy.complete(MESSAGES, [], Sampling())).text == "fine"
            await asyncio.sleep(0.05)
    finally:
        await policy.aclose()
    assert (s.connections, len(s.requests)) == (3, 3)


async def test_a_reused_connection_that_dies_unanswered_is_retried_once_on_a_new_one(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        if n == 2:
            return False  # read the request, hang up without a word (the race with a keep-alive timeout)
        w.write(_reply(OK_BODY))
        return True

    s = await serve(answer)
    policy = OpenAIPolicy(PolicyEndpoint(base_url=s.url, max_retries=0))
    try:
        assert (await policy.complete(MESSAGES, [], Sampling())).text == "fine"
        assert (await policy.complete(MESSAGES, [], Sampling())).text == "fine"
    finally:
        await policy.aclose()
    assert (s.connections, len(s.requests)) == (2, 3)


@pytest.mark.parametrize(
    ("raw", "match", "down"),
    [
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + OK_BODY[:10],
            "disconnected without a complete response",
            False,
        ),
        (b"SMTP ready\r\n\r\n", "malformed response", False),
        (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n", "headers are over aiohttp's limits", False),
        (b"", "disconnected without a complete response", False),
    ],
    ids=["cut-short", "not-http", "huge-head", "silent"],
)
async def test_a_broken_answer_is_a_connection_error(
    serve: Callable[..., Awaitable[Server]], raw: bytes, match: str, down: bool
) -> None:
    """None of these is a server down (waited out past the retries, PolicyEndpoint.outage_wait_s): it answered, or
    hung up on a request it had taken, which may be the request's doing (a proxy's limit on a long generation); the
    retry after a crash finds its port closed."""

    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        w.write(raw)
        await w.drain()
        return False

    s = await serve(answer)
    with pytest.raises(PolicyConnectionError, match=match) as e:
        await _complete(s.url)
    assert isinstance(e.value.__cause__, http.HTTPError) and e.value.__cause__.down is down


async def test_an_outage_counts_from_its_first_failure_not_from_the_start_of_the_request_it_cut(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    """A weight sync that aborts a generation 0.6 s along, then aborts for 0.2 s more, is a 0.2 s outage: counted
    from the start of the aborted request, the generation's own time made it one past outage_wait_s (0.5 s), and
    every request of the client then a POLICY_ERROR ("counts as gone"), the very drain the wait is for."""
    aborted = json.dumps({"model": "m", "choices": [{"message": {"content": "par"}, "finish_reason": "abort"}]})

    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        if n == 1:
            await asyncio.sleep(0.6)  # generating when the sync comes
        w.write(_reply(aborted.encode() if n <= 2 else OK_BODY))
        return True

    s = await serve(answer)
    policy = OpenAIPolicy(
        PolicyEndpoint(base_url=s.url, max_retries=0, outage_wait_s=0.5), backoff_base_s=0.05, backoff_cap_s=0.1
    )
    try:
        assert (await policy.complete(MESSAGES, [], Sampling())).text == "fine"
    finally:
        await policy.aclose()
    assert len(s.requests) == 3


async def test_only_no_connection_is_a_server_down() -> None:
    """Refused (a server restarting) is down; no such host (a name mistyped) is not."""
    holder = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = holder.sockets[0].getsockname()[1]
    holder.close()
    await holder.wait_closed()
    for url, down in ((f"http://127.0.0.1:{port}/v1", True), ("http://no-such-host.invalid/v1", False)):
        with pytest.raises(PolicyConnectionError) as e:
            await _complete(url)
        assert isinstance(e.value.__cause__, http.HTTPError) and e.value.__cause__.down is down, (url, e.value)


async def test_a_header_that_never_ends_is_stopped_at_the_cap(serve: Callable[..., Awaitable[Server]]) -> None:
    sent = 0

    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        nonlocal sent
        w.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
        for _ in range(4096):  # up to 64 MiB of one header line, unless the client hangs up
            w.write(b"a" * (16 << 10))
            await w.drain()
            sent += 16 << 10
        return False

    s = await serve(answer)
    with pytest.raises(PolicyConnectionError, match="headers are over aiohttp's limits"):
        await _complete(s.url)
    assert sent < 16 << 20


async def test_bytes_after_the_response_stop_the_connection_being_reused(
    serve: Callable[..., Awaitable[Server]],
) -> None:
    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        w.write(_reply(OK_BODY) + _reply(b'{"smuggled": true}'))
        return True

    s = await serve(answer)
    policy = OpenAIPolicy(PolicyEndpoint(base_url=s.url, max_retries=0))
    try:
        for _ in range(2):
            assert (await policy.complete(MESSAGES, [], Sampling())).text == "fine"
    finally:
        await policy.aclose()
    assert s.connections == 2


async def test_header_values_cannot_end_the_request(serve: Callable[..., Awaitable[Server]]) -> None:
    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        w.write(_reply(OK_BODY))
        return True

    s = await serve(answer)
    injected = "sk\r\nX-Injected: 1"
    with pytest.raises(ValueError, match="api_key holds a character an HTTP header cannot carry"):
        PolicyEndpoint(base_url=s.url, api_key=injected)  # refused at the submit
    # and the client refuses it too, should an unchecked endpoint reach it
    unchecked = PolicyEndpoint(base_url=s.url, max_retries=0).model_copy(update={"api_key": injected})
    policy = OpenAIPolicy(unchecked)
    try:
        with pytest.raises(PolicyError, match="LocalProtocolError: the Authorization header has characters"):
            await policy.complete(MESSAGES, [], Sampling())
    finally:
        await policy.aclose()
    assert s.requests == []


async def test_a_closed_policy_refuses_requests(serve: Callable[..., Awaitable[Server]]) -> None:
    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        w.write(_reply(OK_BODY))
        return True

    s = await serve(answer)
    policy = OpenAIPolicy(PolicyEndpoint(base_url=s.url, max_retries=0))
    await policy.aclose()
    with pytest.raises(PolicyError, match="closed"):
        await policy.complete(MESSAGES, [], Sampling())


async def test_a_proxy_the_environment_names_is_used_and_no_proxy_is_honoured(
    serve: Callable[..., Awaitable[Server]], monkeypatch: pytest.MonkeyPatch
) -> None:
    async def answer(n: int, w: asyncio.StreamWriter) -> bool:
        w.write(_reply(OK_BODY))
        return True

    proxy = await serve(answer)
    for var in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
        monkeypatch.delenv(var.upper(), raising=False)
    proxy_url = proxy.url.removesuffix("/v1")
    monkeypatch.setenv("HTTP_PROXY", proxy_url)
    monkeypatch.setenv("NO_PROXY", "direct.example")
    assert http.proxy_for("http://policy.example/v1") == proxy_url
    assert http.proxy_for("http://direct.example:8000/v1") is None
    assert http.proxy_for("https://policy.example/v1") is None  # no HTTPS_PROXY, no ALL_PROXY
    assert await _complete("http://policy.example/v1") == "fine"
    line, headers, _ = proxy.requests[0]
    assert line == b"POST http://policy.example/v1/chat/completions HTTP/1.1\r\n"  # the proxy's absolute form
    assert headers[b"host"] == b"policy.example"


def test_json_is_read_and_written_as_the_json_module_does() -> None:
    # what orjson refuses falls back to the json module, so every body reads as it did before
    for raw in (b'{"a": NaN}', '{"a": "é"}'.encode("utf-16")):
        assert repr(_loads(raw)) == repr(json.loads(raw))
    # but a lone surrogate's escape, no character, is U+FFFD: a rollout holding one could not be stored or sent
    assert _loads(b'{"a": "\\ud800", "\\udc00": ["\\ud83d\\ude00"]}') == {"a": "\ufffd", "\ufffd": ["\U0001f600"]}
    # an integer past 64 bits: orjson reads a float, and such a token id is refused, never rounded
    huge = {"choices": [{"message": {"content": "x"}, "token_ids": [123456789012345678901234567890]}]}
    with pytest.raises(PolicyTokenError, match=r"token_ids\[0\] is 1.2345678901234568e\+29 \(a float\)"):
        parse_chat_completion(_loads(json.dumps(huge).encode()), model="m")
    assert _loads(json.dumps({"x": -0.123456789012345678}).encode()) == {"x": -0.123456789012345678}
    with pytest.raises(ValueError):
        _loads(b"<html>")
    body = {"messages": [{"content": "\u00e9 \ud800"}], "t": 0.7, "n": 1}  # a lone surrogate: orjson refuses it
    assert json.loads(_dumps(body)) == body
    assert _dumps({"a": "\u00e9"}) == json.dumps({"a": "\u00e9"}, ensure_ascii=False, separators=(",", ":")).encode()
