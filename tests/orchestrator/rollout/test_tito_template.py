"""ChatTemplateTokens: the first prompt is the template's own rendering, and an observation delta appended to sampled
ids spells exactly what the template renders for the whole conversation, even though the Qwen-like template renders
its last assistant turn differently (an empty think block) from an earlier one. The module stays tokenizer-only."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("transformers")

from orchestrator.rollout.tito import ChatTemplateTokens, load_tokenizer
from orchestrator.testing.qwen_like import QWEN_LIKE_DIR
from tests.conftest import REPO

TOOLS = [
    {
        "type": "function",
        "function": {"name": "python", "parameters": {"type": "object", "properties": {"code": {"type": "string"}}}},
    }
]
FIRST = [{"role": "system", "content": "You solve puzzles."}, {"role": "user", "content": "Compute 2 + 2."}]
CALL = {"id": "c0", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(2 + 2)"}'}}


@pytest.fixture(scope="module")
def tokens() -> ChatTemplateTokens:
    return ChatTemplateTokens(load_tokenizer(QWEN_LIKE_DIR))


def _render(tokens: ChatTemplateTokens, messages: list[dict[str, Any]], gen: bool = True) -> str:
    return str(tokens.tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=gen, tokenize=False))


def test_the_first_prompt_is_the_templates_rendering(tokens: ChatTemplateTokens) -> None:
    ids = tokens.prompt_ids(FIRST, TOOLS)
    assert tokens.decode(ids) == _render(tokens, FIRST)
    assert tokens.decode(ids).endswith("<|im_start|>assistant\n")
    assert tokens.tokenizer.convert_ids_to_tokens(tokens.turn_end_id) == "<|im_end|>"


def test_the_trainers_template_variables_go_into_every_rendering() -> None:
    # verl's data.apply_chat_template_kwargs (enable_thinking=False for Qwen3) were never passed: the episode's prompt
    # and each observation were rendered with thinking on, unlike the trainer's own prompts
    tokens = ChatTemplateTokens(load_tokenizer(QWEN_LIKE_DIR), {"enable_thinking": False, "tokenize": True})
    no_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tokens.decode(tokens.prompt_ids(FIRST, TOOLS)).endswith(no_think)
    delta = tokens.observation_ids([{"role": "tool", "tool_call_id": "c0", "content": "4"}], TOOLS)
    assert tokens.decode(delta).endswith(no_think)


@pytest.mark.parametrize("results", [["4"], ["4", "line one\nline two"]])
def test_sampled_ids_plus_the_delta_spell_the_whole_conversation(
    tokens: ChatTemplateTokens, results: list[str]
) -> None:
    # the assistant answers with a tool call, sampled as the template would write it (no thinking: the template
    # keeps the text of a turn without thinking as it was), then tool results come back
    answer = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2 + 2)"}}\n</tool_call>'
    sampled = [*tokens.encode(answer), tokens.turn_end_id]
    tool_messages = [{"role": "tool", "tool_call_id": "c0", "content": r} for r in results]
    ids = tokens.prompt_ids(FIRST, TOOLS) + sampled + tokens.observation_ids(tool_messages, TOOLS)
    assistant = {"role": "assistant", "content": "", "tool_calls": [CALL]}
    assert tokens.decode(ids) == _render(tokens, [*FIRST, assistant, *tool_messages])
    assert tokens.decode(ids).count("<tool_response>") == len(results)


def test_a_user_message_delta(tokens: ChatTemplateTokens) -> None:
    delta = tokens.observation_ids([{"role": "user", "content": "Now 3 + 3?"}], TOOLS)
    assert tokens.decode(delta) == "\n<|im_start|>user\nNow 3 + 3?<|im_end|>\n<|im_start|>assistant\n"


def test_a_delta_needs_messages_and_a_template(tokens: ChatTemplateTokens) -> None:
    with pytest.raises(ValueError, match="at least one new message"):
        tokens.observation_ids([], TOOLS)

    class NoTemplate:
        chat_template = None

    with pytest.raises(ValueError, match="no chat_template"):
        ChatTemplateTokens(NoTemplate())


def test_the_package_is_tokenizer_only() -> None:
    # a trainer adapter imports it alone: no HTTP client, no gRPC, no sandbox backends, and transformers only when
    # a tokenizer is loaded
    code = (
        "import json, sys, orchestrator.rollout.tito\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('httpx', 'grpc', 'docker', 'transformers') or m.startswith('orchestrator.backends'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_a_template_whose_deltas_carry_the_tools_renders_them() -> None:
    # tools written into the last user message (as some templates do): the probe sees they matter, and a user delta
    # carries them; a template that keeps them in the system prompt (Qwen's) is rendered without them, same ids
    tokenizer = load_tokenizer(QWEN_LIKE_DIR)
    tokenizer.chat_template = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
        "{%- if m.role == 'user' and tools and loop.last %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif %}"
        "{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tokens = ChatTemplateTokens(tokenizer)
    delta = tokens.decode(tokens.observation_ids([{"role": "user", "content": "next"}], TOOLS))
    assert delta == f"\n<|im_start|>user[TOOLS]{json.dumps(TOOLS)}[/TOOLS]next<|im_end|>\n<|im_start|>assistant\n"
    assert "[TOOLS]" not in tokens.decode(tokens.observation_ids([{"role": "tool", "content": "4"}], TOOLS))


_TURNS = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"


@pytest.mark.parametrize(
    ("template", "eos", "message"),
    [
        # GLM-4's shape: a turn is its role marker and its text, closed by nothing (the model stops on the next
        # marker): the last special token of the base, the assistant's own opening marker, was taken for its end,
        # and every observation delta began with the base's "I am an assistant." (a made-up turn in the context)
        (
            f"{_TURNS}{{% endfor %}}{{% if add_generation_prompt %}}<|im_start|>assistant\n{{% endif %}}",
            "<|endoftext|>",
            "turn end found, '<|im_start|>', does not close an assistant turn",
        ),
        # the conversation's last assistant turn left open: the delta held the base's assistant text too
        (
            f"{_TURNS}{{% if not (loop.last and m.role == 'assistant') %}}<|im_end|>\n{{% endif %}}{{% endfor %}}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            None,
            "turn end found, '<|im_end|>', does not close an assistant turn",
        ),
        # Phi-3's: the eos only after a conversation rendered without the generation prompt; every rollout failed
        # at its second turn (POLICY_ERROR) instead of the tokenizer being refused
        (
            f"{_TURNS}<|im_end|>\n{{% endfor %}}{{% if add_generation_prompt %}}<|im_start|>assistant\n"
            "{% else %}{{ eos_token }}{% endif %}",
            "<|endoftext|>",
            "its observation delta cannot be found",
        ),
    ],
)
def test_a_template_whose_turns_tito_cannot_find_is_refused_at_load(
    template: str, eos: str | None, message: str
) -> None:
    tok = load_tokenizer(QWEN_LIKE_DIR)
    if eos is not None:
        tok.eos_token = eos
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = template
    with pytest.raises(ValueError, match=re.escape(message)):
        ChatTemplateTokens(tok)


def test_a_turns_text_keeps_its_special_tokens_but_the_one_it_stopped_on(tokens: ChatTemplateTokens) -> None:
    # one reading for the fleet's tito turns and the verl driver: the driver decoded with skip_special_tokens, and a
    # tool-call marker that is a special token (Llama's <|python_tag|>, Mistral's [TOOL_CALLS]) never reached its
    # parser, so the call was read as a final answer and scored
    ids = tokens.encode("a<|im_start|>b<|im_end|>")
    assert tokens.turn_text(ids, cut=False) == "a<|im_start|>b"
    assert tokens.turn_text(ids, cut=True) == "a<|im_start|>b"  # <|im_end|> is the turn's end: dropped either way
    cut_at_special = tokens.encode("a<|endoftext|>")
    assert tokens.turn_text(cut_at_special, cut=False) == "a"  # a server may stop on any special token
    assert tokens.turn_text(cut_at_special, cut=True) == "a<|endoftext|>"  # cut there: it is text it wrote
    assert tokens.turn_text(tokens.encode("x STOP y"), cut=False, stop=["STOP"]) == "x "
    assert tokens.turn_text(tokens.encode("x STOP y"), cut=True, stop=["STOP"]) == "x STOP y"
