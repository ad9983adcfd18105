"""A reasoning model's thinking in a turn's text: `<think>...</think>` (Qwen3, QwQ, DeepSeek-R1). A server's
reasoning parser takes it out of a chat answer; token-in, token-out decodes the sampled ids whole, so the fleet takes
it out itself: it is no answer to grade, and a tool call written while thinking is not one the model made."""

from __future__ import annotations

import re

OPEN, CLOSE = "<think>", "</think>"
_THINK = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


def split_reasoning(text: str) -> tuple[str, str]:
    """(the reasoning, the rest) of a turn's text. The reasoning is a leading `<think>...</think>` block; or, when the
    prompt opened the block itself (DeepSeek-R1's template ends in `<think>`), the text up to a `</think>` that no
    `<think>` comes before; a `<think>` never closed runs to the end (the turn was cut off while thinking)."""
    opened, closed = text.find(OPEN), text.find(CLOSE)
    if opened >= 0 and not text[:opened].strip() and (closed < 0 or opened < closed):
        end = text.find(CLOSE, opened + len(OPEN))
        return (text, "") if end < 0 else (text[: end + len(CLOSE)], text[end + len(CLOSE) :])
    if closed >= 0 and (opened < 0 or closed < opened):
        return text[: closed + len(CLOSE)], text[closed + len(CLOSE) :]
    return "", text


def answer_text(content: str) -> str:
    """The final answer in a turn's content: its reasoning removed (and the whitespace around what is left); the
    content as it is when it holds none."""
    if OPEN not in content and CLOSE not in content:
        return content
    return _THINK.sub("", split_reasoning(content)[1]).strip()
