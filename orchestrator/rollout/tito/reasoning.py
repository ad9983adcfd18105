"""A reasoning model's thinking in a turn's text: a leading `<think>...</think>` block (Qwen3, QwQ). A server's
reasoning parser takes it out of a chat answer; token-in, token-out decodes the sampled ids whole, so the fleet takes
it out itself: it is no answer to grade, and a tool call written while thinking is not one the model made.

Only a block the turn opens counts, or one its prompt opened: DeepSeek-R1's and Qwen3-Thinking-2507's templates end the
generation prompt with `<think>\n`, so the model starts inside the thinking and writes only its `</think>`. Anywhere
else a `</think>` with no `<think>` before it is text (a tool call's code that splits on the tag, an answer that names
it)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from orchestrator.rollout.policy.base import ToolCall
from orchestrator.rollout.tito.parsers import ToolParser, Tools

OPEN, CLOSE = "<think>", "</think>"
PROMPT_TAIL = 8  # tokens: a generation prompt's `<think>\n` is two or three, and a user's text ends a turn before it


def split_reasoning(text: str) -> tuple[str, str]:
    """(the reasoning, the rest) of a turn's text: the reasoning is a `<think>...</think>` block the text starts with
    (whitespace before it allowed); a `<think>` never closed runs to the end (the turn was cut off while thinking).
    ("", text) when the text starts with none."""
    opened = text.find(OPEN)
    if opened < 0 or text[:opened].strip():
        return "", text
    end = text.find(CLOSE, opened + len(OPEN))
    return (text, "") if end < 0 else (text[: end + len(CLOSE)], text[end + len(CLOSE) :])


def prompt_opens_thinking(decode: Callable[[Sequence[int]], str], prompt_ids: Sequence[int]) -> bool:
    """Whether a prompt of token ids ends with a `<think>` it opened for the turn to come (its last few tokens,
    decoded with `decode`): the turn then starts inside the thinking."""
    return decode(prompt_ids[-PROMPT_TAIL:]).rstrip().endswith(OPEN)


def answer_text(content: str) -> str:
    """The final answer in a turn's content: its leading thinking removed (and the whitespace around what is left);
    the content as it is when it starts with none."""
    reasoning, rest = split_reasoning(content)
    return rest.strip() if reasoning else content


def parse_turn(
    parser: ToolParser, text: str, tools: Tools = None, *, opened: bool = False
) -> tuple[str, list[ToolCall]]:
    """`parser.parse` of what follows the turn's thinking (a call written while thinking is none), the thinking kept
    at the head of the content. `opened`: the prompt opened the thinking (`prompt_opens_thinking`); its `<think>`
    goes at the head of the content, which then reads as the conversation holds it."""
    if opened:
        text = OPEN + text
    reasoning, said = split_reasoning(text)
    content, calls = parser.parse(said, tools)
    return reasoning + content, calls
