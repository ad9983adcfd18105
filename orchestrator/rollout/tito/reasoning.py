"""A reasoning model's thinking in a turn's text: a leading `<think>...</think>` block (Qwen3, QwQ). A server's
reasoning parser takes it out of a chat answer; token-in, token-out decodes the sampled ids whole, so the fleet takes
it out itself: it is no answer to grade, and a tool call written while thinking is not one the model made.

Only a block the turn opens counts: a `</think>` with no `<think>` before it is text (a tool call's code that splits
on the tag, an answer that names it), never the end of a thinking the prompt might have opened."""

from __future__ import annotations

from orchestrator.rollout.policy.base import ToolCall
from orchestrator.rollout.tito.parsers import ToolParser, Tools

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str, str]:
    """(the reasoning, the rest) of a turn's text: the reasoning is a `<think>...</think>` block the text starts with
    (whitespace before it allowed); a `<think>` never closed runs to the end (the turn was cut off while thinking).
    ("", text) when the text starts with none."""
    opened = text.find(OPEN)
    if opened < 0 or text[:opened].strip():
        return "", text
    end = text.find(CLOSE, opened + len(OPEN))
    return (text, "") if end < 0 else (text[: end + len(CLOSE)], text[end + len(CLOSE) :])


def answer_text(content: str) -> str:
    """The final answer in a turn's content: its leading thinking removed (and the whitespace around what is left);
    the content as it is when it starts with none."""
    reasoning, rest = split_reasoning(content)
    return rest.strip() if reasoning else content


def parse_turn(parser: ToolParser, text: str, tools: Tools = None) -> tuple[str, list[ToolCall]]:
    """`parser.parse` of what follows the turn's thinking (a call written while thinking is none), the thinking kept
    at the head of the content."""
    reasoning, said = split_reasoning(text)
    content, calls = parser.parse(said, tools)
    return reasoning + content, calls
