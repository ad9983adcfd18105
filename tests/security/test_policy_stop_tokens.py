"""The text of a token-in, token-out turn is what the policy wrote, never the token its server stopped on. Servers
stop on more special tokens than the template's turn end (Qwen's <|endoftext|>, Llama's <|eom_id|>, every id of a
generation_config's eos list); the one a turn stopped on was decoded into its text, so an exact answer was graded
wrong and a tool call's arguments carried it. The ids stay exactly what was sampled."""

from __future__ import annotations

from typing import Any, cast

import pytest

from orchestrator.core.policy import Sampling
from orchestrator.rollout.tito.parsers import HermesParser
from orchestrator.rollout.tito.policy import Sample, TitoEpisode, TitoPolicy


class _StoppedOn:
    """A tito server that samples `ids` and stops (finish_reason `finish`)."""

    def __init__(self, tokens: Any, ids: list[int], finish: str = "stop") -> None:
        self.parser = HermesParser()
        self._tokens, self._ids, self._finish = tokens, ids, finish

    async def tokens(self) -> Any:
        return self._tokens

    async def sample(self, prompt_ids: list[int], sampling: Sampling, max_tokens: int, user: str) -> Sample:
        return Sample(list(self._ids), None, self._finish, "m")


async def _text_and_calls(tokens: Any, ids: list[int], finish: str = "stop") -> tuple[str, list[tuple[str, str]]]:
    stub = cast(TitoPolicy, _StoppedOn(tokens, ids, finish))
    c = await TitoEpisode(stub, None).complete([{"role": "user", "content": "Compute 6 * 7."}], [], Sampling())
    assert c.completion_ids == ids  # the ids stay what was sampled
    return c.text, [(t.name, t.arguments) for t in c.tool_calls]


async def test_the_special_token_a_tito_turn_stopped_on_is_no_text_of_the_turn() -> None:
    pytest.importorskip("transformers")
    from orchestrator.rollout.tito import ChatTemplateTokens, load_tokenizer
    from orchestrator.testing.qwen_like import QWEN_LIKE_DIR

    tokens = ChatTemplateTokens(load_tokenizer(QWEN_LIKE_DIR))
    other_stop = tokens.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert other_stop != tokens.turn_end_id and other_stop in tokens.tokenizer.all_special_ids
    answer = tokens.tokenizer.encode("42", add_special_tokens=False)
    assert await _text_and_calls(tokens, [*answer, other_stop]) == ("42", [])
    call = tokens.tokenizer.encode('<tool_call>\n{"name": "python", "arguments": {"a": 1}}\n</tool_call>')
    assert await _text_and_calls(tokens, [*call, other_stop]) == ("", [("python", '{"a": 1}')])
    # a turn cut at max_tokens keeps its text whole: its last token was no stop
    assert await _text_and_calls(tokens, [*answer, other_stop], "length") == ("42<|endoftext|>", [])
