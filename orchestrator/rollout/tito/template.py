"""Token ids of a conversation under the model's own chat template, for token-in, token-out rollouts.

The first prompt is the template rendered with the tools and the generation prompt, then tokenized as vLLM does
(`add_special_tokens=False`: the template writes its own BOS). After that no history is ever re-rendered: the
sampled ids are kept as they are, and each observation (tool results, a user message) is tokenized as a delta. The
delta comes from a fixed base conversation rendered with and without the new messages (the method verl and SkyRL
use): what follows the end of the base's assistant turn is exactly the template's glue, the new messages and the
next generation prompt. The end of that turn is found by counting turn-end tokens, not by comparing prefixes, so a
template that renders its last assistant turn differently (Qwen3 adds an empty think block there) still works.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.core.policy import TEMPLATE_RENDER_ARGUMENTS

Message = Mapping[str, Any]
MAX_CACHED_TOOLSETS = 64  # base renderings kept, one per distinct tool list

# Never changed, so its rendering is cached: only its shape matters (system, user, assistant).
BASE_CONVERSATION: tuple[Message, ...] = (
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "I am a user."},
    {"role": "assistant", "content": "I am an assistant."},
)


PROBES: tuple[tuple[Message, ...], ...] = (
    ({"role": "tool", "tool_call_id": "probe", "content": "a tool result"},),
    ({"role": "user", "content": "a user message"},),
)


@dataclass(frozen=True)
class _Base:
    """The base conversation under one tool list: its turn ends, and whether deltas depend on the tools at all."""

    ends: int
    tools_matter: bool


class ChatTemplateTokens:
    """A Hugging Face tokenizer's chat template as token ids: the first prompt, then observation deltas.

    `tokenizer` is anything with `apply_chat_template`, `encode` and `decode` (a transformers tokenizer); it needs a
    chat template and an end-of-turn token (its eos, or the last special token of a rendered turn).

    Two savings keep a delta cheap (it runs every turn): only the text after the base's last turn end is tokenized
    (the end token is special, so the tokenizer splits there anyway and the ids are the same), and when probing shows
    that a tool list changes no delta (it lives in the system prompt, as in Qwen's templates) it is not rendered.
    """

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat_template (tokenizer_config.json or chat_template.jinja)")
        self.tokenizer = tokenizer
        # the template's own variables at every render (a trainer's `enable_thinking=False`, say): the prompt and
        # each observation's delta are rendered as the trainer renders its own prompts
        self.template_kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in TEMPLATE_RENDER_ARGUMENTS}
        base = self.encode(self._render(BASE_CONVERSATION, None, gen=False))
        self.turn_end_id = self._turn_end(base)
        text = self.decode([self.turn_end_id])
        # the text cut is exact only if the end token's text always tokenizes as that one token
        self._turn_end_text = text if self.encode(text) == [self.turn_end_id] else None
        self._bases: dict[str, _Base] = {"": _Base(base.count(self.turn_end_id), tools_matter=False)}
        self._check_turns(base)
        # what ends a turn: its end token and the eos; and what a server may stop a turn on, any special token
        self.end_ids = frozenset({self.turn_end_id, getattr(tokenizer, "eos_token_id", None)} - {None})
        self.stop_ids = self.end_ids | frozenset(getattr(tokenizer, "all_special_ids", ()) or ())

    def _render(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None, gen: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=gen,
            tokenize=False,
            **self.template_kwargs,
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template returned a {type(text).__name__}, expected text")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text, without the tokenizer's own special tokens (the template wrote them)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Sampled ids as text, special tokens included (tool call markers may be special tokens)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def turn_text(self, ids: Sequence[int], *, cut: bool, stop: Sequence[str] = ()) -> str:
        """A sampled turn's text, as the fleet reads it (its tito turns and the verl driver alike): the token it
        stopped on is no text of the turn's, so it goes (a cut turn's only when it is the turn's end or the eos; a
        finished turn's when it is any special token the server stops on: Qwen's <|endoftext|>, Llama's
        <|eom_id|>, which a grader or a parser would read as text); other special tokens stay (a tool-call marker may
        be one, and skipping them all hid a Llama `<|python_tag|>` call from the parser). A finished turn ends at the
        first of `stop`, the stop strings the server stopped at, as the server's own text does (chat mode)."""
        end = self.end_ids if cut else self.stop_ids
        text = self.decode(ids[:-1] if ids and ids[-1] in end else ids)
        if not cut and stop:
            at = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
            if at >= 0:
                text = text[:at]
        return text

    def _turn_end(self, base_ids: list[int]) -> int:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and eos in base_ids:
            return eos
        special = set(getattr(self.tokenizer, "all_special_ids", ()) or ())
        for i in reversed(base_ids):
            if i in special:
                return int(i)
        raise ValueError("the chat template ends an assistant turn with no special token; tito cannot find turns")

    def _check_turns(self, base_ids: list[int]) -> None:
        """ValueError unless the turn end found closes the assistant's turn and each probe's delta is that probe's
        messages and the template's glue: a template whose assistant turn has no closing token (GLM-4's) made its
        opening marker the "end", and every observation then carried a made-up assistant turn into the context,
        with token arrays that were still consistent; one that writes its eos only after a conversation without the
        generation prompt (Phi-3's) failed every rollout at its second turn."""
        said = BASE_CONVERSATION[-1]["content"]
        last = len(base_ids) - 1 - base_ids[::-1].index(self.turn_end_id)
        if said not in self.decode(base_ids[: last + 1]) or said in self.decode(base_ids[last + 1 :]):
            raise ValueError(
                f"the chat template's turn end found, {self.decode([self.turn_end_id])!r}, does not close an "
                "assistant turn (the template writes none after the assistant's text?): tito cannot find turns"
            )
        for probe in PROBES:
            try:
                self._render([*BASE_CONVERSATION, *probe], None, gen=True)
            except Exception:
                continue  # a role the template refuses (no tool turns): such an observation fails where it comes
            delta = self.decode(self._delta(probe, None, self._bases[""].ends, by_text=False))
            if said in delta or not all(str(m["content"]) in delta for m in probe):
                raise ValueError(
                    f"the chat template's delta for a {probe[0]['role']} message is not that message and the next "
                    f"generation prompt ({delta[:200]!r}): tito cannot append observations to this template's turns"
                )

    def _base(self, tools: Sequence[Mapping[str, Any]] | None) -> tuple[_Base, Sequence[Mapping[str, Any]] | None]:
        """The base under `tools`, and the tools to render deltas with (None when they change no delta)."""
        key = json.dumps(tools, sort_keys=True, default=str) if tools else ""
        base = self._bases.get(key)
        if base is None:
            if len(self._bases) >= MAX_CACHED_TOOLSETS:
                self._bases = {"": self._bases[""]}
            ends = self.encode(self._render(BASE_CONVERSATION, tools, gen=False)).count(self.turn_end_id)
            plain = self._bases[""].ends
            matter = any(
                self._delta(probe, tools, ends, by_text=False) != self._delta(probe, None, plain, by_text=False)
                for probe in PROBES
            )
            base = self._bases[key] = _Base(ends, matter)
        return base, (tools if base.tools_matter else None)

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The first prompt: the conversation with the tools, and the generation prompt."""
        return self.encode(self._render(messages, tools, gen=True))

    def observation_ids(
        self, new_messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        """The ids that follow an assistant turn's end token for `new_messages` (tool results, user messages): the
        template's glue, the messages, and the next generation prompt."""
        if not new_messages:
            raise ValueError("observation_ids needs at least one new message")
        base, render_tools = self._base(tools)
        ends = base.ends if render_tools else self._bases[""].ends
        return self._delta(new_messages, render_tools, ends, by_text=self._turn_end_text is not None)

    def _delta(
        self, new: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None, ends: int, *, by_text: bool
    ) -> list[int]:
        full = self._render([*BASE_CONVERSATION, *new], tools, gen=True)
        end_text = self._turn_end_text
        if ends < 1:
            pass
        elif by_text and end_text is not None:
            at = -1
            for _ in range(ends):
                at = full.find(end_text, at + 1)
                if at < 0:
                    break
            else:
                return self.encode(full[at + len(end_text) :])
        else:
            ids = self.encode(full)
            seen = 0
            for i, t in enumerate(ids):
                if t == self.turn_end_id:
                    seen += 1
                    if seen == ends:
                        return ids[i + 1 :]
        raise ValueError(
            f"the chat template rendered the base conversation's {ends} turn end(s) differently once messages "
            "followed; its observation delta cannot be found"
        )
