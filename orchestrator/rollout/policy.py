"""The policy seam: chat messages and tools in, a Completion with token ids and logprobs out.

OpenAIPolicy speaks OpenAI-compatible chat completions over httpx and asks vLLM/SGLang-style servers for the token ids
and logprobs a trainer needs (`return_token_ids`, `logprobs`). What the server does not return stays None: token ids
and logprobs are never invented here.
"""

from __future__ import annotations

import abc
import asyncio
import json
import logging
import random
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestrator.errors import EnvfleetError

log = logging.getLogger(__name__)

BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 5.0
# Head of an error response body kept in an exception message.
ERROR_BODY_HEAD = 500
# httpcore's pool does work quadratic in its size on every request (encode/httpcore#1035): 200 requests at once
# take 3-10 s through one pool, under 1 s through pools of 8. So an owned client is a set of small pools, another
# opened when every pool has SHARD_TARGET requests in flight. The scheduler, not the pools, bounds concurrency.
SHARD_TARGET = 8
MAX_SHARDS = 128
SHARD_MAX_CONNECTIONS = 64
TOKEN_ID_PREFIX = "token_id:"


class PolicyError(EnvfleetError):
    """The policy server could not produce a completion; the rollout is POLICY_ERROR, never scored."""


class PolicyHTTPError(PolicyError):
    """The server answered with an HTTP error status (after the retries, for 429 and 5xx)."""

    def __init__(self, message: str, status: int, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (str(self), self.status, self.body))


class PolicyTimeoutError(PolicyError, TimeoutError):
    """The server did not answer within the endpoint's request timeout (on every attempt)."""


class PolicyConnectionError(PolicyError, ConnectionError):
    """The server could not be reached, or dropped the connection (on every attempt)."""


class PolicyResponseError(PolicyError, ValueError):
    """The server answered 2xx with a body that is not a chat completion."""


@dataclass(frozen=True)
class ToolCall:
    """One function call the model asked for; arguments is the raw JSON string as the model produced it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Completion:
    """One assistant turn: what it said, the tools it called, and, when the server gave them, its tokens."""

    text: str
    tool_calls: list[ToolCall]
    finish_reason: str
    prompt_ids: list[int] | None
    completion_ids: list[int] | None
    logprobs: list[float] | None
    model: str
    raw_message: dict[str, Any]


class Sampling(BaseModel):
    """Sampling parameters of one completion request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(1024, ge=1, le=1_000_000)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)


class PolicyEndpoint(BaseModel):
    """Where the policy is served: an OpenAI-compatible base URL (usually ending in /v1) and how to call it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str
    model: str = "policy"
    api_key: str = Field("", repr=False)
    version: str = "0"
    request_timeout_s: float = Field(120.0, gt=0, le=3600)
    max_retries: int = Field(3, ge=0, le=20)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {v!r}")
        return v.rstrip("/")


class Policy(abc.ABC):
    """The model being trained, as the rollout runner sees it."""

    @abc.abstractmethod
    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *, user: str = ""
    ) -> Completion:
        """One assistant turn for the conversation so far; user tags the request (the rollout id)."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release connections."""


class _Retryable(Exception):
    """An attempt failed in a way worth retrying; carries the error to raise when the retries run out."""

    def __init__(
        self, error: PolicyError, retry_after_s: float | None = None, cause: BaseException | None = None
    ) -> None:
        super().__init__(str(error))
        error.__cause__ = cause
        self.error = error
        self.retry_after_s = retry_after_s


class OpenAIPolicy(Policy):
    """A policy served by an OpenAI-compatible chat completions endpoint (vLLM, SGLang, the scripted server)."""

    def __init__(
        self,
        endpoint: PolicyEndpoint,
        client: httpx.AsyncClient | None = None,
        *,
        backoff_base_s: float = BACKOFF_BASE_S,
        backoff_cap_s: float = BACKOFF_CAP_S,
    ) -> None:
        self.endpoint = endpoint
        self._own_client = client is None
        self._ssl_context = httpx.create_ssl_context() if client is None else None  # shared: 60 ms to build each
        self._clients = [client or self._new_client()]
        self._inflight = [0]
        self._backoff_base_s = backoff_base_s
        self._backoff_cap_s = backoff_cap_s
        self._url = f"{endpoint.base_url}/chat/completions"

    async def aclose(self) -> None:
        """Close the HTTP client if this policy made it."""
        if self._own_client:
            clients, self._clients, self._inflight = self._clients, [], []
            for c in clients:
                await c.aclose()

    def _new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            verify=self._ssl_context or True,
            timeout=httpx.Timeout(self.endpoint.request_timeout_s),
            limits=httpx.Limits(max_connections=SHARD_MAX_CONNECTIONS, max_keepalive_connections=SHARD_TARGET),
        )

    def _pick_client(self) -> int:
        if not self._clients:
            raise PolicyError("the policy client is closed")
        i = min(range(len(self._clients)), key=self._inflight.__getitem__)
        if self._own_client and self._inflight[i] >= SHARD_TARGET and len(self._clients) < MAX_SHARDS:
            self._clients.append(self._new_client())
            self._inflight.append(0)
            i = len(self._clients) - 1
        return i

    def request_body(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, user: str = ""
    ) -> dict[str, Any]:
        """The JSON body of one chat completions request."""
        body: dict[str, Any] = {
            "model": self.endpoint.model,
            "messages": messages,
            "stream": False,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": sampling.max_tokens,
            # vLLM: token ids of prompt and completion, and the sampled token's logprob, its token as "token_id:N"
            "logprobs": True,
            "top_logprobs": 0,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if tools:
            body["tools"] = tools
            body["tool_choice"] = "auto"
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if user:
            body["user"] = user
        return body

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *, user: str = ""
    ) -> Completion:
        """POST one chat completion, retrying 429, 5xx, timeouts and connection errors with backoff."""
        body = self.request_body(messages, tools, sampling, user)
        headers = {"Authorization": f"Bearer {self.endpoint.api_key}"} if self.endpoint.api_key else {}
        attempts = self.endpoint.max_retries + 1
        for attempt in range(attempts):
            try:
                data = await self._attempt(body, headers)
            except _Retryable as r:
                if attempt + 1 >= attempts:
                    r.error.args = (f"{r.error} (attempt {attempt + 1} of {attempts})",)
                    raise r.error from r.error.__cause__
                delay = self._backoff(attempt, r.retry_after_s)
                log.warning(
                    "policy request failed (attempt %d/%d), retrying in %.2fs: %s", attempt + 1, attempts, delay, r
                )
                await asyncio.sleep(delay)
                continue
            return parse_chat_completion(data, model=self.endpoint.model)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _backoff(self, attempt: int, retry_after_s: float | None) -> float:
        delay = self._backoff_base_s * (1 << attempt) + random.uniform(0, self._backoff_base_s)
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return min(self._backoff_cap_s, delay)

    async def _attempt(self, body: dict[str, Any], headers: dict[str, str]) -> Any:
        timeout_s = self.endpoint.request_timeout_s
        i = self._pick_client()
        self._inflight[i] += 1
        try:
            # httpx's timeouts bound each phase; this bounds the whole attempt, a slow trickle included
            async with asyncio.timeout(timeout_s):
                resp = await self._clients[i].post(self._url, json=body, headers=headers)
        except (TimeoutError, httpx.TimeoutException) as e:
            msg = f"policy server {self._url} did not answer within {timeout_s:g}s"
            raise _Retryable(PolicyTimeoutError(msg), cause=e) from e
        except (httpx.NetworkError, httpx.RemoteProtocolError) as e:
            msg = f"policy server {self._url} unreachable: {type(e).__name__}: {e}"
            raise _Retryable(PolicyConnectionError(msg), cause=e) from e
        except httpx.HTTPError as e:
            raise PolicyError(f"request to policy server {self._url} failed: {type(e).__name__}: {e}") from e
        finally:
            if i < len(self._inflight):  # aclose may have emptied the list meanwhile
                self._inflight[i] -= 1

        if resp.is_success:
            try:
                return resp.json()
            except ValueError as e:
                raise PolicyResponseError(
                    f"policy server {self._url} answered {resp.status_code} with a body that is not JSON: "
                    f"{resp.text[:ERROR_BODY_HEAD]!r}"
                ) from e
        head = resp.text[:ERROR_BODY_HEAD]
        http_err = PolicyHTTPError(
            f"policy server {self._url} answered HTTP {resp.status_code}: {head}", resp.status_code, head
        )
        if resp.status_code == 429 or resp.status_code >= 500:
            raise _Retryable(http_err, _retry_after(resp))
        raise http_err


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("retry-after")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: the backoff schedule is good enough


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    return None


def _logprob_entries(choice: dict[str, Any]) -> list[dict[str, Any]] | None:
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if isinstance(content, list) and all(isinstance(e, dict) for e in content):
        return content
    return None


def _logprobs(entries: list[dict[str, Any]]) -> list[float] | None:
    out: list[float] = []
    for e in entries:
        v = e.get("logprob")
        if not isinstance(v, int | float) or isinstance(v, bool):
            return None
        out.append(float(v))
    return out


def _ids_from_logprob_tokens(entries: list[dict[str, Any]]) -> list[int] | None:
    # With return_tokens_as_token_ids, vLLM writes each sampled token as "token_id:N".
    out: list[int] = []
    for e in entries:
        tok = e.get("token")
        if not isinstance(tok, str) or not tok.startswith(TOKEN_ID_PREFIX):
            return None
        try:
            out.append(int(tok[len(TOKEN_ID_PREFIX) :]))
        except ValueError:
            return None
    return out


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise PolicyResponseError(f"message content is a {type(content).__name__}, expected a string")


def _tool_calls(raw: Any) -> tuple[list[ToolCall], list[dict[str, Any]]]:
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise PolicyResponseError(f"message tool_calls is a {type(raw).__name__}, expected a list")
    calls: list[ToolCall] = []
    wire: list[dict[str, Any]] = []
    for i, tc in enumerate(raw):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise PolicyResponseError(f"tool call {i} has no function name: {str(tc)[:200]}")
        args = fn.get("arguments", "")
        if not isinstance(args, str):  # some servers send the parsed object; keep it as the JSON text it was
            args = json.dumps(args)
        call_id = tc.get("id")
        if not isinstance(call_id, str) or not call_id:
            call_id = f"call_{i}"  # the tool result must name a call; the id is the server's, not the model's
        calls.append(ToolCall(call_id, fn["name"], args))
        wire.append({"id": call_id, "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return calls, wire


def parse_chat_completion(data: Any, *, model: str) -> Completion:
    """A Completion from a chat completions response body; raises PolicyResponseError when it is not one."""
    if not isinstance(data, dict):
        raise PolicyResponseError(f"response is a {type(data).__name__}, expected a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise PolicyResponseError(f"response has no choices: {json.dumps(data)[:ERROR_BODY_HEAD]}")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise PolicyResponseError("choices[0] has no message object")
    content = message.get("content")
    text = _text(content)
    tool_calls, wire_calls = _tool_calls(message.get("tool_calls"))

    prompt_ids = _int_list(data.get("prompt_token_ids"))
    if prompt_ids is None:
        prompt_ids = _int_list(choice.get("prompt_token_ids"))
    entries = _logprob_entries(choice)
    completion_ids = _int_list(choice.get("token_ids"))
    if completion_ids is None and entries is not None:
        completion_ids = _ids_from_logprob_tokens(entries)
    logprobs = _logprobs(entries) if entries is not None else None
    if completion_ids is not None and logprobs is not None and len(completion_ids) != len(logprobs):
        log.warning(
            "policy returned %d completion ids but %d logprobs; dropping the logprobs",
            len(completion_ids),
            len(logprobs),
        )
        logprobs = None

    raw_message: dict[str, Any] = {"role": "assistant", "content": content if isinstance(content, str) else text}
    if content is None:
        raw_message["content"] = None if wire_calls else ""
    if wire_calls:
        raw_message["tool_calls"] = wire_calls
    finish_reason = choice.get("finish_reason")
    served_model = data.get("model")
    return Completion(
        text=text,
        tool_calls=tool_calls,
        finish_reason=finish_reason if isinstance(finish_reason, str) else "unknown",
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        logprobs=logprobs,
        model=served_model if isinstance(served_model, str) and served_model else model,
        raw_message=raw_message,
    )
