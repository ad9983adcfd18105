"""The policy seam: chat messages and tools in, a Completion with token ids and logprobs out.

OpenAIPolicy speaks OpenAI-compatible chat completions over HTTP and asks vLLM/SGLang-style servers for the token ids
and logprobs a trainer needs (`return_token_ids`, `logprobs`). What the server does not return stays None: token ids
and logprobs are never invented here. Requests go through one aiohttp session per policy (`http.py`: keep-alive,
proxies from the environment; a fraction of httpx's CPU per request).

The URL is the tenant's choice, so the server at it is untrusted: its response is read with a size cap (streamed,
stopped at `response_cap`), redirects are not followed, and error messages give the status, the size and the
content type of a response, never its body.

A 200 whose finish_reason says the server did not finish the generation ("abort": vLLM and SGLang abort what is
running for a weight sync; "error") is retried as a 5xx is: the partial answer is never a turn (parsing.py). A 400
that says the conversation is over the model's context is ContextFull: the episode ends there, TRUNCATED.

A server that is down or busy (no connection: refused, reset, its host unreachable; HTTP 429, 502, 503; a
generation aborted) is waited out past max_retries, for the endpoint's outage_wait_s (a request's, and all of a
rollout attempt's requests' together: http.Waits): a trainer's inference server restarting, or its router with no
replica up, made every rollout in flight, and every one started meanwhile, a POLICY_ERROR within seconds, the job's
queue drained into masked samples. The wait is the server's time, not the policy's: every limit of the rollout
moves on by it. A server down longer than outage_wait_s counts as gone: requests fail after their retries until one
is answered.

With `PolicyEndpoint.stream` the answer is asked for as a stream (streaming.py): `request_timeout_s` then bounds the
longest silence, not the whole generation, so a long generation is a turn, never a POLICY_ERROR for its length. Its
byte cap grows with its max_tokens (`response_cap`); a stream that passes it whose complete events the parser takes
as more tokens than an episode keeps, and no more than max_tokens, is GenerationTooLong, the episode's end
(TRUNCATED), and one that passes it otherwise is the server's fault (PolicyResponseError).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from orchestrator.core.errors import (
    ContextFull,
    EnvfleetError,
    GenerationAborted,
    GenerationTooLong,
    PolicyConnectionError,
    PolicyError,
    PolicyHTTPError,
    PolicyResponseError,
    PolicyTimeoutError,
)
from orchestrator.core.log_limit import LogLimit
from orchestrator.core.policy import PolicyEndpoint, Sampling, shown_url, without_secrets
from orchestrator.core.text import texts
from orchestrator.rollout.policy import http, streaming
from orchestrator.rollout.policy.base import Completion, Policy
from orchestrator.rollout.policy.parsing import CONTEXT_FULL, parse_chat_completion
from orchestrator.rollout.step import EPISODE_BYTES, TOKEN_BYTES

log = logging.getLogger(__name__)
T = TypeVar("T")

BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 5.0
# A chat completion with token ids and logprobs of a long episode is a few MB; anything past this is refused.
MAX_RESPONSE_BYTES = 32 << 20
# A streamed answer is about 400 bytes a token (vLLM: a chunk per token with its id and logprob entry), so 32 MiB
# held about 85,000 tokens: a longer generation within max_tokens was refused, POLICY_ERROR, masked. A stream's cap
# is MAX_RESPONSE_BYTES and this much for each token it may carry: max_tokens, but at most one more than an episode
# keeps (KEPT_TOKENS), since a stream past that many is TRUNCATED whatever follows (GenerationTooLong).
STREAMED_TOKEN_BYTES = 1024
KEPT_TOKENS = EPISODE_BYTES // TOKEN_BYTES  # a turn of more tokens never fits an episode (rollout/step.py)
# A streamed answer bigger than this is put back together in a thread: a hostile server's millions of tiny events
# would hold the event loop (and every other rollout of the worker) for seconds.
STREAM_INLINE_BYTES = 1 << 20


# a server down or busy answers so: rate limited, and a proxy or the server itself with no model to serve yet. Not
# 504: a proxy's time limit, which a long generation reaches again on every try (a timeout, retried max_retries times)
DOWN_STATUSES = frozenset({429, 502, 503})
# A server's outage goes on while its requests keep finding it down this often (a waiting request asks at least
# every BACKOFF_CAP_S): a longer gap, with no answer seen, was no traffic (a server stopped after one job and
# loading for the next, hours later, counted as down all along and gone at once)
DOWN_GAP_S = 3 * BACKOFF_CAP_S


class _Retryable(Exception):
    """An attempt failed in a way worth retrying; carries the error to raise when the retries run out. `down`: the
    server was down or busy (no connection, DOWN_STATUSES, a generation aborted), waited out past the retries."""

    def __init__(
        self,
        error: PolicyError,
        retry_after_s: float | None = None,
        cause: BaseException | None = None,
        *,
        down: bool = False,
    ) -> None:
        super().__init__(str(error))
        error.__cause__ = cause
        self.error = error
        self.retry_after_s = retry_after_s
        self.down = down


class OpenAIPolicy(Policy):
    """A policy served by an OpenAI-compatible chat completions endpoint (vLLM, SGLang, the scripted server)."""

    def __init__(
        self,
        endpoint: PolicyEndpoint,
        *,
        backoff_base_s: float = BACKOFF_BASE_S,
        backoff_cap_s: float = BACKOFF_CAP_S,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        kept_tokens: int = KEPT_TOKENS,
    ) -> None:
        self.endpoint = endpoint
        self.max_response_bytes = max_response_bytes
        self.kept_tokens = kept_tokens
        tls = endpoint.base_url.startswith("https:")
        self._client = http.Client(endpoint.base_url, http.ssl_context() if tls else None)
        self._closed = False
        self._backoff_base_s = backoff_base_s
        self._backoff_cap_s = backoff_cap_s
        self._url = f"{endpoint.base_url}/chat/completions"
        # since when the server has been down or busy, by its requests' failures since its last answer (and the
        # latest of them): past outage_wait_s it counts as gone, and requests fail after their retries until one is
        # answered (a server down for good, or a port mistyped, held every rollout of a job outage_wait_s each)
        self._down_since: float | None = None
        self._down_last = -math.inf
        # a line a minute for what every request of a rollout would say: retries (a server down or at its rate
        # limit), a stream without usage (a server that ignores include_usage)
        self._said = LogLimit()

    async def aclose(self) -> None:
        """Close the HTTP client and its connections."""
        self._closed = True
        await self._client.aclose()

    def request_body(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, user: str = ""
    ) -> dict[str, Any]:
        """The JSON body of one chat completions request."""
        body: dict[str, Any] = {
            "model": self.endpoint.model,
            "messages": messages,
            "stream": self.endpoint.stream,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            # vLLM: token ids of prompt and completion, and the sampled token's logprob, its token as "token_id:N"
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if self.endpoint.stream:
            body["stream_options"] = {"include_usage": True}  # the count of sampled tokens, checked (streaming.py)
        if tools:
            body["tools"] = tools
            body["tool_choice"] = "auto"
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if user:
            body["user"] = user
        if self.endpoint.chat_template_kwargs:
            body["chat_template_kwargs"] = self.endpoint.template_kwargs  # rendered by the server (vLLM, SGLang)
        return body

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *, user: str = ""
    ) -> Completion:
        """POST one chat completion, retrying 429, 5xx, timeouts, connection errors and unfinished generations with
        backoff."""
        return await self.post_json(
            self._url,
            self.request_body(messages, tools, sampling, user),
            lambda data: parse_chat_completion(data, model=self.endpoint.model),
        )

    async def post_json(self, url: str, body: dict[str, Any], parse: Callable[[Any], T]) -> T:
        """POST a JSON body to `url` (an endpoint of this server) and return `parse` of the decoded JSON answer,
        retrying 429, 5xx, timeouts, connection errors and an answer `parse` finds unfinished (GenerationAborted: a
        200 for a request the server aborted, as during a weight sync) with backoff; the shared transport of chat and
        tito requests. A server that is down or busy (`_Retryable.down`) is asked again past the retries, for the
        endpoint's outage_wait_s (in a rollout, what is left of it for the rollout: http.Waits)."""
        headers = {"Authorization": f"Bearer {self.endpoint.api_key}"} if self.endpoint.api_key else {}
        attempts = self.endpoint.max_retries + 1
        loop = asyncio.get_running_loop()
        progress = http.PROGRESS.get()
        waits = progress.waits if progress is not None else None
        waited = 0.0  # past the retries, waiting out a server down or busy
        down_at: float | None = None  # this request's first failure of a server down or busy
        attempt = 0
        while True:
            started = loop.time()
            try:
                try:  # unfinished: an answer parse finds so, or a stream cut short (streaming.py)
                    answer = parse(await self._attempt(url, body, headers))
                except GenerationAborted as e:
                    raise _Retryable(e, down=e.down) from None
                except _CutAtCap as cut:
                    raise await self._past_cap(cut, parse, _max_tokens(body)) from None
                self._down_since = None
                return answer
            except _Retryable as r:
                attempt += 1
                now = loop.time()
                delay = self._backoff(attempt - 1, r.retry_after_s)
                spent = now - started + delay  # the failed attempt and the pause: the server's time
                if r.down:
                    down_at = now if down_at is None else down_at
                    self._went_down(now)
                if progress is not None:
                    progress.last = -math.inf  # what streamed in was no answer
                if attempt < attempts:
                    if progress is not None:
                        progress.lost += spent
                    if (more := self._said.allow("retry")) is not None:
                        log.warning(
                            "policy request failed (attempt %d/%d), retrying in %.2fs: %s%s",
                            attempt,
                            attempts,
                            delay,
                            r,
                            more,
                        )
                else:
                    refused = self._no_wait(r, attempt, spent, down_at, now + delay, waits)
                    if refused is not None:
                        r.error.args = (f"{r.error} ({refused})",)
                        raise r.error from r.error.__cause__
                    waited += spent
                    if (more := self._said.allow("down")) is not None:
                        log.warning(
                            "policy server down or busy for %.0fs past the retries (waited out for up to %gs), asking "
                            "again in %.2fs: %s%s",
                            waited - delay,
                            self.endpoint.outage_wait_s,
                            delay,
                            r,
                            more,
                        )
                await asyncio.sleep(delay)

    def _went_down(self, now: float) -> None:
        """A request found the server down or busy at `now`: the outage began then, unless one is going on (a failure
        of it within DOWN_GAP_S, and no answer since)."""
        if self._down_since is None or now - self._down_last > DOWN_GAP_S:
            self._down_since = now
        self._down_last = now

    def _no_wait(
        self,
        r: _Retryable,
        attempt: int,
        spent: float,
        down_at: float | None,
        retry_at: float,
        waits: http.Waits | None,
    ) -> str | None:
        """None when a request whose retries are spent waits once more for its server down or busy (`spent`: this
        pause, with the attempt before it; `down_at`: its first such failure; asked again at `retry_at`), the pause
        taken from its rollout's `waits`; else what its error says of why not."""
        wait_s = self.endpoint.outage_wait_s
        attempts = self.endpoint.max_retries + 1
        if not r.down or not wait_s:
            return f"attempt {attempt} of {attempts}" if attempt == attempts else f"attempt {attempt}, retries spent"
        down_s = retry_at - (self._down_since if self._down_since is not None else retry_at)
        if down_s > wait_s:
            return (
                f"attempt {attempt}: the server down or busy for {down_s:.1f}s, past outage_wait_s ({wait_s:g}s); "
                "it counts as gone until it answers a request"
            )
        if down_at is None or retry_at - down_at > wait_s:
            return (
                f"attempt {attempt}: the server down or busy for {retry_at - (down_at or retry_at):.1f}s of this "
                f"request's, all of outage_wait_s ({wait_s:g}s)"
            )
        if waits is not None and not waits.take(spent):
            return (
                f"attempt {attempt}: its rollout waited {waits.waited:.1f}s in all for the server down or busy, all "
                f"of outage_wait_s ({wait_s:g}s)"
            )
        return None

    def _backoff(self, attempt: int, retry_after_s: float | None) -> float:
        delay = self._backoff_base_s * (1 << min(attempt, 16)) + random.uniform(0, self._backoff_base_s)
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return min(self._backoff_cap_s, delay)

    def response_cap(self, body: dict[str, Any]) -> int:
        """The most bytes read of the answer to `body`: `max_response_bytes`, and for a stream STREAMED_TOKEN_BYTES
        for each token it may carry."""
        if body.get("stream") is not True:
            return self.max_response_bytes
        return self.max_response_bytes + STREAMED_TOKEN_BYTES * min(_max_tokens(body), self.kept_tokens + 1)

    async def _attempt(self, url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        timeout_s = self.endpoint.request_timeout_s
        shown = shown_url(url)  # in what is said of it: an error's message goes to logs, traces and the trainer
        streamed = body.get("stream") is True
        cap = self.response_cap(body)
        try:
            if streamed:  # the longest silence: the answer may take as long as it keeps coming (streaming.py)
                resp = await self._send(url, _dumps(body), headers, cap, idle_timeout_s=timeout_s)
            else:  # the whole attempt: connect, send and read, a slow trickle included
                async with asyncio.timeout(timeout_s):
                    resp = await self._send(url, _dumps(body), headers, cap)
        except TimeoutError as e:
            said = "sent nothing for" if streamed else "did not answer within"
            msg = f"policy server {shown} {said} {timeout_s:g}s"
            raise _Retryable(PolicyTimeoutError(msg), cause=e) from e
        except (http.ConnectError, http.ReadError, http.RemoteProtocolError) as e:
            raise _Retryable(self._unreachable(shown, without_secrets(str(e), url), e), cause=e, down=e.down) from e
        except http.ResponseTooLarge as e:
            message = self._too_big(shown, e.status, e.what, cap)
            partial, e.partial = e.partial, b""  # up to the cap's bytes: never kept by an error's traceback
            if not (streamed and _max_tokens(body) > self.kept_tokens):
                raise PolicyResponseError(message) from None
            answer = await _cut_answer(partial, self.kept_tokens)
            del partial
            raise _CutAtCap(answer, message) from None
        except http.HTTPError as e:
            said = without_secrets(str(e), url)
            raise PolicyError(f"request to policy server {shown} failed: {type(e).__name__}: {said}") from e

        if resp.is_success:
            if streamed and resp.headers.get("content-type", "").startswith(streaming.EVENT_STREAM):
                if len(resp.content) > STREAM_INLINE_BYTES:
                    return await asyncio.to_thread(streaming.collect, resp.content, self._said)
                return streaming.collect(resp.content, self._said)
            if len(resp.content) > self.max_response_bytes:  # a whole answer to a stream's request: a whole one's cap
                what = f"is {len(resp.content)} bytes of {resp.headers.get('content-type') or 'no content type'}"
                raise PolicyResponseError(self._too_big(shown, resp.status, what, self.max_response_bytes))
            try:  # a whole answer, also from a server that does not stream
                return _loads(resp.content)
            except ValueError as e:
                raise PolicyResponseError(
                    f"policy server {shown} answered {resp.status} with a body that is not JSON ({_described(resp)})"
                ) from e
        if resp.status not in DOWN_STATUSES:
            self._down_since = None  # it answered: up, whatever it said
        log.debug("policy server %s answered HTTP %d: %r", shown, resp.status, resp.content[:200])
        if resp.status == 400 and CONTEXT_FULL.search(resp.content[:4096].decode(errors="replace")):
            # the conversation outgrew the model: the policy's own length, an episode cut there (TRUNCATED) as the
            # token-in, token-out client cuts it when it counts the tokens itself; never a POLICY_ERROR, masked
            raise ContextFull(f"policy server {shown} answered HTTP 400: the conversation is over the model's context")
        said = f"policy server {shown} answered HTTP {resp.status} ({_described(resp)})"
        http_err = PolicyHTTPError(said, resp.status)
        if resp.status == 429 or resp.status >= 500:
            raise _Retryable(http_err, _retry_after(resp), down=resp.status in DOWN_STATUSES)
        raise http_err

    @staticmethod
    def _unreachable(url: str, said: str, e: Exception) -> PolicyConnectionError:
        return PolicyConnectionError(f"policy server {url} unreachable: {type(e).__name__}: {said}")

    async def _past_cap(self, cut: _CutAtCap, parse: Callable[[Any], Any], max_tokens: int) -> EnvfleetError:
        """What a stream cut at its cap is: GenerationTooLong when its complete events are an answer the parser
        takes, of more tokens than an episode keeps and at most max_tokens (the policy's length: TRUNCATED);
        otherwise the server's bytes, not the policy's tokens, took it there (PolicyResponseError)."""
        if cut.answer is not None:
            try:
                sampled = _sampled(await asyncio.to_thread(parse, cut.answer))
            except EnvfleetError:
                sampled = None
            if sampled is not None and self.kept_tokens < sampled <= max_tokens:
                return GenerationTooLong(
                    f"the policy's answer carried {sampled} tokens when its stream passed its cap: more than an "
                    f"episode keeps ({self.kept_tokens}), so the episode ends there, TRUNCATED"
                )
        return PolicyResponseError(cut.message)

    async def _send(
        self, url: str, content: bytes, headers: dict[str, str], cap: int, idle_timeout_s: float | None = None
    ) -> http.Response:
        """POST a JSON body through this policy's session, reading at most `cap` bytes of the answer
        (`idle_timeout_s`: see http.Client.post)."""
        if self._closed:
            raise PolicyError("the policy client is closed")
        return await self._client.post(url, content, headers, cap, idle_timeout_s)

    @staticmethod
    def _too_big(url: str, status: int, what: str, cap: int) -> str:
        return f"policy server {url} answered HTTP {status} but its response {what}; the limit is {cap} bytes"


class _CutAtCap(Exception):
    """A stream that passed its cap, asked for more tokens than an episode keeps: the answer its complete events make
    (None when they make none) for the request's parser, and the error to raise if it is not the policy's length."""

    def __init__(self, answer: dict[str, Any] | None, message: str) -> None:
        super().__init__(message)
        self.answer = answer
        self.message = message


async def _cut_answer(partial: bytes, tokens: int) -> dict[str, Any] | None:
    """streaming.cut_answer in a thread (the cut is tens of MB), None when its events are not chunks."""
    try:
        return await asyncio.to_thread(streaming.cut_answer, partial, tokens)
    except EnvfleetError:
        return None


def _sampled(parsed: object) -> int | None:
    """How many sampled token ids a parsed answer carries: a chat Completion's, or a tito Sample's."""
    ids = parsed.completion_ids if isinstance(parsed, Completion) else getattr(parsed, "ids", None)
    return len(ids) if isinstance(ids, list) else None


def _max_tokens(body: dict[str, Any]) -> int:
    """The request's max_tokens (every request of a rollout sets it; 0 for one that does not)."""
    n = body.get("max_tokens")
    return n if type(n) is int else 0


def _dumps(body: dict[str, Any]) -> bytes:
    """The request body as compact UTF-8 JSON, as httpx's `json=` wrote it, by orjson; what orjson refuses (a lone
    surrogate, which a policy's own answer may carry back) is escaped to ASCII by the json module, where httpx raised
    UnicodeEncodeError."""
    try:
        return orjson.dumps(body)
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


def _loads(content: bytes) -> Any:
    """A JSON body decoded by orjson, or by the json module where orjson refuses it (NaN, UTF-16, a lone surrogate's
    escape: its strings then made text, core.text.texts); ValueError when it is not JSON. One difference remains:
    orjson reads an integer past 64 bits as a float, so a token id that large (past the wire's int32 anyway) is
    refused by the parser as a float, never rounded."""
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError:
        try:
            return texts(json.loads(content))  # a lone surrogate's escape, which orjson refuses, is U+FFFD
        except RecursionError:  # nested past the json module's depth (orjson stops at 1024): no JSON we can read
            raise ValueError("nested too deeply") from None


def _described(resp: http.Response) -> str:
    kind = resp.headers.get("content-type", "no content type").split(";")[0].strip()[:60]
    return f"{len(resp.content)} bytes of {kind}; the body is not shown"


def _retry_after(resp: http.Response) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the backoff schedule is good enough
