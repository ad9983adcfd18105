"""The text of a token-in, token-out turn is what the policy wrote, never the token or the stop string its server
stopped on. Servers stop on more special tokens than the template's turn end (Qwen's <|endoftext|>, Llama's
<|eom_id|>, every id of a generation_config's eos list); the one a turn stopped on was decoded into its text, so an
exact answer was graded wrong and a tool call's arguments carried it; a job's stop strings ended chat mode's text but
not tito's. A sample with no finish_reason that used every token it could is cut, as chat mode's is, and logprobs of
another shape are refused in tito as in chat mode. The ids stay exactly what was sampled."""

from __future__ import annotations

from typing import Any, cast

import pytest

from orchestrator.core.errors import PolicyTokenError
from orchestrator.core.policy import Sampling
from orchestrator.rollout.policy.parsing import NOT_SAID
from orchestrator.rollout.tito.parsers import HermesParser
from orchestrator.rollout.tito.policy import Sample, TitoEpisode, TitoPolicy, parse_completion


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


async def test_a_tito_turn_ends_at_its_stop_string_and_one_cut_unsaid_is_cut() -> None:
    pytest.importorskip("transformers")
    from orchestrator.rollout.tito import ChatTemplateTokens, load_tokenizer
    from orchestrator.testing.qwen_like import QWEN_LIKE_DIR

    tokens = ChatTemplateTokens(load_tokenizer(QWEN_LIKE_DIR))
    encode = tokens.tokenizer.encode
    messages = [{"role": "user", "content": "Compute 6 * 7."}]
    # the server stops at a stop string of the job's and its own text ends before it (chat mode grades that);
    # tito decoded the ids, the stop string and what its last token carried past it included
    ids = encode("42</ans> and more", add_special_tokens=False)
    stub = cast(TitoPolicy, _StoppedOn(tokens, ids))
    c = await TitoEpisode(stub, None).complete(messages, [], Sampling(stop=["</ans>", "never"]))
    assert c.text == "42" and c.completion_ids == ids
    # no finish_reason at all, every token max_tokens allowed and no stop token: cut there, so no call of it runs
    call = encode('<tool_call>\n{"name": "submit", "arguments": {"answer": "4', add_special_tokens=False)
    stub = cast(TitoPolicy, _StoppedOn(tokens, call, NOT_SAID))
    cut = await TitoEpisode(stub, None).complete(messages, [], Sampling(max_tokens=len(call)))
    assert cut.finish_reason == "length" and cut.tool_calls == []


def test_tito_logprobs_of_another_shape_are_refused_as_chat_modes_are() -> None:
    answer = {"choices": [{"text": "", "token_ids": [5], "finish_reason": "stop", "logprobs": [-0.5]}]}
    with pytest.raises(PolicyTokenError, match=r"choices\[0\]\.logprobs is a list, expected an object"):
        parse_completion(answer, [1, 2], 16, model="m")
