"""Policy configuration: where the trainer's policy is served and how to sample from it."""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

_NOT_IN_URL = re.compile(r"[\x00-\x20\x7f]")
_HEADER_VALUE = re.compile(r"[\x20-\x7e\t]*")  # what the policy client sends (rollout/policy/http.py)


class Sampling(BaseModel):
    """Sampling parameters of one completion request."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(1024, ge=1, le=1_000_000)
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)


REPLAY_URL = "replay://reference"
# A tokenizer or tool parser is named, never given as a path: a name is one folder under the server's tokenizer
# directories (orchestrator/rollout/tito/tokenizer.py resolves it), or one entry point of `envfleet.tool_parsers`.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DEFAULT_TOOL_PARSER = "hermes"
MAX_TEMPLATE_KWARGS = 4096  # characters of chat_template_kwargs' JSON
# apply_chat_template's own arguments, which the fleet sets at every render: never a template variable of the caller's
TEMPLATE_RENDER_ARGUMENTS = frozenset({"conversation", "messages", "tools", "add_generation_prompt", "tokenize"})


def shown_url(url: str) -> str:
    """`url` as an error message, a log line or a trace shows it: without the password (and user) of its userinfo,
    which the policy client sends as HTTP Basic auth, and without its query, which may hold a key (`?key=...`)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return url.split("?", 1)[0].rsplit("@", 1)[-1]
    if "@" not in parts.netloc and not parts.query and not parts.fragment:
        return url
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{port}" if port is not None else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def without_secrets(text: str, url: str) -> str:
    """`text` (an exception's, which may quote the whole URL) with `url`'s password and query left out."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return text
    for secret in (parts.password, parts.query):
        if secret:
            text = text.replace(secret, "***")
    return text


def check_name(value: str, what: str) -> str:
    """`value` if it is a plain name (letters, digits, '.', '_', '-'; no path separator, no '..'), else ValueError."""
    if NAME_PATTERN.fullmatch(value) and ".." not in value:
        return value
    raise ValueError(
        f"{what} must be a plain name of at most 128 letters, digits, '.', '_' or '-' (no path separator, no '..', "
        f"not starting with '.'): the server resolves it in its own configured directories, never as a path"
    )


def origin(url: str) -> tuple[str, str, int | None]:
    """A checked base_url's origin (scheme, host, port; the scheme's default port filled in): where its api_key may
    go. The key is a bearer secret, so a new base_url on another origin does not take it along (as a browser drops
    Authorization on a redirect to another origin)."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or _DEFAULT_PORTS.get(scheme)


_DEFAULT_PORTS = {"http": 80, "https": 443}


class PolicyEndpoint(BaseModel):
    """Where the policy is served: an OpenAI-compatible base URL (usually ending in /v1) and how to call it.

    `replay://reference` is no server: each task's reference solution is replayed in process, instantly. It is for
    measuring and simulating the fleet itself; its rollouts carry no tokens.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str
    model: str = "policy"
    api_key: str = Field("", repr=False)
    version: str = "0"
    request_timeout_s: float = Field(
        120.0,
        gt=0,
        le=3600,
        description="one attempt's limit: the whole answer's time, or with `stream` the longest silence in it",
    )
    stream: bool = Field(
        False,
        description="ask for streamed answers (server-sent events, as vLLM and SGLang send them): a generation may "
        "then take as long as it keeps sending, where a whole answer must come within request_timeout_s",
    )
    max_retries: int = Field(3, ge=0, le=20)
    outage_wait_s: float = Field(
        300.0,
        ge=0,
        le=86400,
        description="how long a rollout waits out its server down or busy (no connection: refused, reset, its host "
        "unreachable; HTTP 429, 502 or 503; a generation aborted, as for a weight sync) once a request's max_retries "
        "are spent, asked again every few seconds; for all of a rollout attempt's requests together, none of it the "
        "rollout's time (its limits move on by it). A server down longer than this counts as gone until it answers "
        "a request. 0: such a failure is a POLICY_ERROR once the retries are spent",
    )
    tokenizer: str = Field(
        "",
        max_length=128,
        description="the model's tokenizer, by name: a folder in the server's tokenizer directories "
        "(`--tokenizer-dir`); it turns on token-in, token-out rollouts (JobSpec.token_mode)",
    )
    tool_parser: str = Field(
        DEFAULT_TOOL_PARSER,
        max_length=128,
        description="how tool calls are read from sampled text in tito mode: hermes, qwen3_coder, llama3_json, or "
        "an entry point of `envfleet.tool_parsers`",
    )
    chat_template_kwargs: str = Field(
        "",
        max_length=MAX_TEMPLATE_KWARGS,
        description='the chat template\'s own variables, a JSON object ({"enable_thinking": false} for Qwen3; a '
        "dict is taken too): tito renders every prompt and observation with them, chat mode sends them as the "
        "request's chat_template_kwargs (vLLM, SGLang); kept as its JSON text",
    )

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs as a dict ({} unset)."""
        return dict(json.loads(self.chat_template_kwargs)) if self.chat_template_kwargs else {}

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if v == REPLAY_URL:
            return v
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https:// (or be {REPLAY_URL}), got {shown_url(v)!r}")
        # one no request can be made to (no host, a port past 65535, a space) failed each of the job's rollouts as a
        # POLICY_ERROR instead of the submit
        if _NOT_IN_URL.search(v):
            raise ValueError(f"base_url holds a space or a control character, got {shown_url(v)!r}")
        try:
            parts = urllib.parse.urlsplit(v)
            parts.port  # noqa: B018 - raises ValueError when the port is not a number within 0-65535
        except ValueError as e:
            raise ValueError(f"base_url is not a URL ({e}), got {shown_url(v)!r}") from None
        if not parts.hostname:
            raise ValueError(f"base_url names no host, got {shown_url(v)!r}")
        return v.rstrip("/")

    @field_validator("api_key")
    @classmethod
    def _header_value(cls, v: str) -> str:
        # it goes in the Authorization header: a character no header can carry failed every request (never echoed)
        if not _HEADER_VALUE.fullmatch(v):
            raise ValueError("api_key holds a character an HTTP header cannot carry (visible ASCII and spaces only)")
        return v

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_name(cls, v: str) -> str:
        return check_name(v, "tokenizer") if v else v

    @field_validator("tool_parser")
    @classmethod
    def _tool_parser_name(cls, v: str) -> str:
        return check_name(v, "tool_parser")

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs_given(cls, v: Any) -> Any:
        """A dict is taken as its JSON (PolicyEndpoint(chat_template_kwargs={"enable_thinking": False}))."""
        if isinstance(v, dict):
            try:
                return json.dumps(v, sort_keys=True, separators=(",", ":"))
            except (TypeError, ValueError) as e:
                raise ValueError(f"chat_template_kwargs is not JSON: {e}") from None
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: str) -> str:
        if not v:
            return v
        try:
            kwargs = json.loads(v)
        except (ValueError, RecursionError):
            raise ValueError("chat_template_kwargs is not JSON (a JSON object of the template's variables)") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"chat_template_kwargs must be a JSON object, got a {type(kwargs).__name__}")
        taken = sorted(set(kwargs) & TEMPLATE_RENDER_ARGUMENTS)
        if taken:
            raise ValueError(f"chat_template_kwargs sets {taken}, which the fleet sets itself at every render")
        return json.dumps(kwargs, sort_keys=True, separators=(",", ":"))  # one text for one set of variables
