"""TitoPolicy: token-in, token-out completions. The orchestrator renders the conversation with the model's own
tokenizer, sends token ids to `/v1/completions` (vLLM, SGLang), appends the sampled ids exactly, and tokenizes only
each observation as a chat template delta. So every id a trainer receives is one the server sampled (mask 1) or one
the template put between turns (mask 0), and a template that rewrites history (Qwen3 drops old thinking) or
re-serializes tool calls cannot make the arrays inconsistent: history is never rendered twice.

One TitoPolicy per endpoint, shared by every episode; `for_episode` gives the object that holds one episode's token
context. The transport (pools, retries, the response cap, redirects refused) is OpenAIPolicy's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.core.errors import (
    ConfigError,
    ContextFull,
    InvalidRequestError,
    PolicyError,
    PolicyResponseError,
    PolicyTokenError,
)
from orchestrator.core.policy import PolicyEndpoint, Sampling
from orchestrator.core.text import as_text
from orchestrator.rollout.policy import token_checks as checks
from orchestrator.rollout.policy.base import Completion, Policy, ToolCall
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.rollout.policy.parsing import CUT_OFF, NOT_SAID, finish_reason, served_model
from orchestrator.rollout.tito.parsers import ToolParser, get_parser
from orchestrator.rollout.tito.reasoning import OPEN, parse_turn, prompt_opens_thinking
from orchestrator.rollout.tito.template import ChatTemplateTokens
from orchestrator.rollout.tito.tokenizer import TokenizerCache


@dataclass(frozen=True)
class Sample:
    """What the server sampled for one prompt of token ids."""

    ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    model: str


class TitoPolicy(Policy):
    """A policy served by an OpenAI-compatible `/v1/completions` endpoint that takes token id prompts and returns
    the sampled token ids (vLLM's `return_token_ids`, or its `token_id:N` logprob tokens)."""

    def __init__(self, endpoint: PolicyEndpoint, tokenizers: TokenizerCache, *, http: OpenAIPolicy | None = None):
        self.endpoint = endpoint
        self._parser: ToolParser | None = None
        self._tokenizers = tokenizers
        self._http = http or OpenAIPolicy(endpoint)
        self._url = f"{endpoint.base_url}/completions"

    def for_episode(self, *, max_model_len: int | None = None) -> Policy:
        """A fresh token context for one episode, bounded by `max_model_len` tokens in all."""
        return TitoEpisode(self, max_model_len)

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *, user: str = ""
    ) -> Completion:
        """One turn of a one-turn episode (the agent loop uses `for_episode`)."""
        return await self.for_episode().complete(messages, tools, sampling, user=user)

    async def aclose(self) -> None:
        """Release connections."""
        await self._http.aclose()

    async def tokens(self) -> ChatTemplateTokens:
        """The endpoint's tokenizer, loaded once per process (the first episode waits for it)."""
        return await self._tokenizers.get(self.endpoint.tokenizer, self.endpoint.chat_template_kwargs)

    @property
    def parser(self) -> ToolParser:
        """The endpoint's tool-call parser; ConfigError when this process has no parser of that name (the control
        plane checked the name at submit, so this host lacks a plug-in the fleet promised)."""
        if self._parser is None:
            try:
                self._parser = get_parser(self.endpoint.tool_parser)
            except InvalidRequestError as e:
                raise ConfigError(f"this process cannot parse tool calls: {e}") from None
        return self._parser

    def request_body(self, prompt_ids: list[int], sampling: Sampling, max_tokens: int, user: str) -> dict[str, Any]:
        """The JSON body of one completions request with a token id prompt."""
        body: dict[str, Any] = {
            "model": self.endpoint.model,
            "prompt": prompt_ids,
            "stream": self.endpoint.stream,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "max_tokens": max_tokens,
            "logprobs": 1,  # the sampled token's logprob (plus the top one; 0 is not accepted everywhere)
            "return_token_ids": True,  # vLLM >= 0.10.2: choices[0].token_ids
            "return_tokens_as_token_ids": True,  # older vLLM: logprobs.tokens as "token_id:N"
            "skip_special_tokens": False,
        }
        if self.endpoint.stream:
            body["stream_options"] = {"include_usage": True}  # the count of sampled tokens, checked (streaming.py)
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if user:
            body["user"] = user
        return body

    async def sample(self, prompt_ids: list[int], sampling: Sampling, max_tokens: int, user: str) -> Sample:
        """POST the prompt ids; the sampled ids, exactly, and their logprobs."""
        return await self._http.post_json(
            self._url,
            self.request_body(prompt_ids, sampling, max_tokens, user),
            lambda data: parse_completion(data, prompt_ids, max_tokens, model=self.endpoint.model),
        )


class TitoEpisode(Policy):
    """One episode's token context: the first prompt, then each sample and observation delta, appended."""

    def __init__(self, policy: TitoPolicy, max_model_len: int | None) -> None:
        self._policy = policy
        self._limit = max_model_len
        self._context: list[int] | None = None
        self._last_sample: list[int] = []
        self._turn = 0

    async def complete(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], sampling: Sampling, *, user: str = ""
    ) -> Completion:
        """Sample the next assistant turn after the observations that followed the last one. ContextFull when
        max_model_len leaves no room for a token."""
        tokens, parser = await self._policy.tokens(), self._policy.parser
        prompt = self._prompt(tokens, messages, tools)
        room = sampling.max_tokens if self._limit is None else self._limit - len(prompt)
        if room <= 0:
            raise ContextFull(f"the context holds {len(prompt)} tokens; max_model_len is {self._limit}")
        max_tokens = min(sampling.max_tokens, room)
        s = await self._policy.sample(prompt, sampling, max_tokens, user)
        self._context, self._last_sample = prompt + s.ids, s.ids
        turn, self._turn = self._turn, self._turn + 1
        finish = s.finish_reason
        if finish == NOT_SAID and len(s.ids) >= max_tokens and not (s.ids and s.ids[-1] in tokens.stop_ids):
            finish = "length"  # no finish_reason, but every token it could sample and no stop: it was cut there
        text = tokens.turn_text(s.ids, cut=finish in CUT_OFF, stop=sampling.stop)
        calls: list[ToolCall]
        opened = prompt_opens_thinking(tokens.decode, prompt)  # the turn began inside a thinking the prompt opened
        if finish in CUT_OFF:
            # cut off: whatever call it was writing was never finished
            content, calls = (OPEN + text if opened else text), []
        else:
            # a call written while thinking is no call (a server's reasoning parser takes the thinking out first)
            content, calls = parse_turn(parser, text, tools, opened=opened)
        # made text: a parser's JSON keeps what a "\ud800" escape in the model's text says (a lone surrogate, which
        # neither the result log nor the wire can hold: the rollout could not be stored)
        calls = [
            dataclasses.replace(c, id=f"call_{turn}_{i}", name=as_text(c.name), arguments=as_text(c.arguments))
            for i, c in enumerate(calls)
        ]
        raw: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            raw["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
            ]
        return Completion(content, calls, finish, prompt, s.ids, s.logprobs, s.model, raw)

    def _prompt(
        self, tokens: ChatTemplateTokens, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]]
    ) -> list[int]:
        try:
            if self._context is None:
                return tokens.prompt_ids(messages, tools)
            last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
            new = messages[last + 1 :]
            delta = tokens.observation_ids(new, tools) if new else []
            if not self._last_sample or self._last_sample[-1] != tokens.turn_end_id:
                # the server stopped without the turn's end token (a stop string): the template's end goes in as
                # an observation token, so the next prompt is still a well-formed conversation
                delta = [tokens.turn_end_id, *delta]
            return self._context + delta
        except Exception as e:  # the template itself (jinja) refused the conversation
            raise PolicyError(
                f"the chat template of tokenizer {self._policy.endpoint.tokenizer!r} could not render the "
                f"conversation: {type(e).__name__}: {e}"
            ) from e

    async def aclose(self) -> None:
        """The connections are the shared TitoPolicy's."""


def parse_completion(data: Any, prompt_ids: list[int], max_tokens: int, *, model: str) -> Sample:
    """A Sample from a `/v1/completions` answer; PolicyResponseError when it carries no sampled ids, more than
    max_tokens of them, or echoes a prompt other than the one sent (the response is described, never quoted);
    PolicyTokenError when an id or a logprob is not an exact value a rollout can carry (token_checks.py)."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise PolicyResponseError("the completions response has no choices[0] object")
    choice = choices[0]
    finish = finish_reason(choice.get("finish_reason"), "choices[0].finish_reason")  # first: a partial sample is moot
    raw_lp = choice.get("logprobs")
    if raw_lp is not None and not isinstance(raw_lp, dict):  # as chat mode's: no logprobs at all, never none
        raise PolicyTokenError(f"choices[0].logprobs is a {type(raw_lp).__name__}, expected an object")
    lp: dict[str, Any] = raw_lp or {}
    ids = checks.token_ids(choice.get("token_ids"), "choices[0].token_ids")
    labels = lp.get("tokens")
    if ids is None and isinstance(labels, list):
        ids = checks.ids_from_labels(labels, "choices[0].logprobs.tokens[{i}]")
    if ids is None:
        raise PolicyResponseError(
            "the completions response has no sampled token ids (choices[0].token_ids); tito needs a server that "
            "returns them (vLLM with return_token_ids or return_tokens_as_token_ids, SGLang), or use token_mode chat"
        )
    if len(ids) > max_tokens:
        raise PolicyResponseError(f"the server sampled {len(ids)} tokens, more than the max_tokens of {max_tokens}")
    if not ids:
        # a finished request samples at least its stop token (max_tokens >= 1): none is a broken server or proxy,
        # whose empty turn was scored as the policy's answer
        raise PolicyResponseError("the server sampled no tokens (a finished request returns at least its stop token)")
    echoed = choice.get("prompt_token_ids")
    # compared whole, not checked id by id: a list equal to the ids sent is ints, and it is thousands long
    if isinstance(echoed, list) and echoed != prompt_ids:
        raise PolicyResponseError(
            f"the server echoed a prompt of {len(echoed)} token ids that is not the {len(prompt_ids)} sent"
        )
    logprobs: list[float] | None = None
    raw = lp.get("token_logprobs")
    if raw is not None:  # absent: the tokens are "missing" for training, never invented
        if not isinstance(raw, list):
            raise PolicyTokenError("the policy server's choices[0].logprobs.token_logprobs is not a list")
        logprobs = checks.logprobs(raw, "choices[0].logprobs.token_logprobs[{i}]")
        checks.same_length(ids, logprobs, "choices[0].token_ids", "choices[0].logprobs.token_logprobs")
    return Sample(ids=ids, logprobs=logprobs, finish_reason=finish, model=served_model(data.get("model"), model))
