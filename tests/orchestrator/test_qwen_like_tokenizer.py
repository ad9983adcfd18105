"""The offline Qwen3-like tokenizer: it loads with both libraries, the committed files equal a fresh build, and its
chat template breaks the prefix property the way Qwen3's does (earlier <think> dropped, tool calls re-serialized)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from tokenizers import Tokenizer
from transformers import AutoTokenizer

from orchestrator.testing.qwen_like import FILES, MARKER_TOKENS, QWEN_LIKE_DIR, SPECIAL_TOKENS, build

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    }
]


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(QWEN_LIKE_DIR)


def _ids(enc: Any) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def test_committed_files_equal_a_fresh_build(tmp_path: Path) -> None:
    build(tmp_path)
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (QWEN_LIKE_DIR / name).read_bytes(), (
            f"{name} is stale: run `python -m orchestrator.testing.qwen_like` and commit the result"
        )
    assert sum((QWEN_LIKE_DIR / n).stat().st_size for n in (*FILES, "corpus.txt")) < 1 << 20


def test_both_libraries_load_it_and_agree(tok: Any) -> None:
    raw = Tokenizer.from_file(str(QWEN_LIKE_DIR / "tokenizer.json"))
    assert 2000 <= raw.get_vocab_size() <= 4096 and len(tok) == raw.get_vocab_size()
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in (*SPECIAL_TOKENS, *MARKER_TOKENS):
        assert tok.convert_tokens_to_ids(t) == raw.token_to_id(t) is not None
        assert tok.encode(t, add_special_tokens=False) == [raw.token_to_id(t)]
    text = (QWEN_LIKE_DIR / "corpus.txt").read_text(encoding="utf-8")[:5000] + " héllo ✓ 😀 <tool_call>{}</tool_call>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == raw.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text
    # trained on the environments' text: ordinary words are one piece, not bytes
    assert len(tok.encode(" Compute the sum of all primes", add_special_tokens=False)) <= 8
    # the chat markers are special (skipped), the think and tool markers are not (a tool parser sees them)
    marked = tok.encode("<|im_start|>a<think>b</think><tool_call>c</tool_call><|im_end|>", add_special_tokens=False)
    assert tok.decode(marked, skip_special_tokens=True) == "a<think>b</think><tool_call>c</tool_call>"


def test_decode_then_encode_differs_from_sampled_ids(tok: Any) -> None:
    # A model may sample " Comp" "ute" where the tokenizer would merge " Compute": decoding and re-encoding the
    # text gives other ids, one of the ways re-tokenized chat turns drift from what was sampled.
    pieces = [tok.convert_tokens_to_ids(t) for t in tok.tokenize(" Compute")]
    split = [i for p in ("Ġ", "C", "o", "m", "p", "u", "t", "e") for i in [tok.convert_tokens_to_ids(p)]]
    assert tok.decode(split) == tok.decode(pieces) == " Compute"
    assert tok.encode(tok.decode(split), add_special_tokens=False) == pieces != split


def _conversation(reasoning: str, arguments: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You solve computation puzzles."},
        {"role": "user", "content": "Compute 2 + 2."},
        {
            "role": "assistant",
            "content": f"<think>\n{reasoning}\n</think>\n\n",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "python", "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "4"},
    ]


def test_template_renders_like_qwen3(tok: Any) -> None:
    msgs = _conversation("I add them.", {"code": "print(2 + 2)"})
    text = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nYou solve computation puzzles.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    # the last assistant turn (after the last user query) keeps its thinking; the tool call is rendered from the dict
    assert (
        '<think>\nI add them.\n</think>\n\n<tool_call>\n{"name": "python", "arguments": {"code": "print(2 + 2)"}}'
        in text
    )
    assert text.endswith("<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # a new user query drops the earlier assistant turn's <think>
    later = [*msgs, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "And 3 + 3?"}]
    again = tok.apply_chat_template(later, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "I add them." not in again and "<think>" not in again


def test_rerendered_history_does_not_extend_prompt_plus_completion(tok: Any) -> None:
    """The real-world failure: the ids the model saw and sampled are not a prefix of the next turn's prompt."""
    first = [{"role": "system", "content": "You solve puzzles."}, {"role": "user", "content": "Compute 2 + 2."}]
    prompt = _ids(tok.apply_chat_template(first, tools=TOOLS, add_generation_prompt=True))
    sampled_text = (
        '<think>\nI add them.\n</think>\n\n<tool_call>\n{"name":"python",  "arguments": {"code":"print(2 + 2)"}}\n'
        "</tool_call><|im_end|>"
    )
    completion = tok.encode(sampled_text, add_special_tokens=False)
    # what a client sends back: the parsed call, arguments as JSON text (a server re-serializes them)
    args = json.dumps({"code": "print(2 + 2)"})
    history = [
        *first,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I add them.",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "python", "arguments": args}}],
        },
        {"role": "tool", "tool_call_id": "c0", "content": "4"},
        {"role": "user", "content": "Now 3 + 3."},
    ]
    nxt = _ids(tok.apply_chat_template(history, tools=TOOLS, add_generation_prompt=True))
    assert nxt[: len(prompt)] == prompt  # the system and user turns are stable ...
    assert nxt[: len(prompt) + len(completion)] != prompt + completion  # ... the assistant turn is not
    rendered = tok.decode(nxt[len(prompt) :])
    assert "<think>" not in rendered and '{"name": "python", "arguments": {"code": "print(2 + 2)"}}' in rendered
