"""A deterministic byte-level tokenizer for the scripted policy server, so tests can check exact token ids.

Byte b is token b + 16; tokens 1..5 are the role and end markers. A conversation renders as, per message,
[role] + body + [<|end|>], then [<|assistant|>] as the generation prompt. The completion of an assistant message is
its body + [<|end|>], so prompt_ids(history + [reply] + more) always starts with prompt_ids(history) +
completion_ids(reply): the prefix property a trainer relies on to stitch turns into one token sequence.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

SYSTEM = 1
USER = 2
ASSISTANT = 3
TOOL = 4
END = 5
BYTE_OFFSET = 16

SPECIAL_TOKENS: dict[int, str] = {
    SYSTEM: "<|system|>",
    USER: "<|user|>",
    ASSISTANT: "<|assistant|>",
    TOOL: "<|tool|>",
    END: "<|end|>",
}
ROLE_TOKENS: dict[str, int] = {
    "system": SYSTEM,
    "developer": SYSTEM,
    "user": USER,
    "assistant": ASSISTANT,
    "tool": TOOL,
}


def encode(text: str) -> list[int]:
    """UTF-8 bytes of text, each shifted by BYTE_OFFSET; a lone surrogate (a hostile script's) as the three bytes
    UTF-8 would give it, so that the double can send one."""
    return [b + BYTE_OFFSET for b in text.encode(errors="surrogatepass")]


def decode(ids: Sequence[int]) -> str:
    """The text of byte tokens (special tokens rendered by name); invalid UTF-8 is replaced."""
    out = bytearray()
    for t in ids:
        out.extend(token_bytes(t))
    return out.decode(errors="replace")


def token_bytes(token_id: int) -> list[int]:
    """The bytes one token stands for (a special token: the UTF-8 of its name)."""
    if token_id in SPECIAL_TOKENS:
        return list(SPECIAL_TOKENS[token_id].encode())
    b = token_id - BYTE_OFFSET
    if not 0 <= b <= 255:
        raise ValueError(f"token id {token_id} is not in the toy vocabulary")
    return [b]


def token_text(token_id: int) -> str:
    """One token as text, vLLM style: the character, or 'bytes:\\xNN' for a byte that is not ASCII."""
    if token_id in SPECIAL_TOKENS:
        return SPECIAL_TOKENS[token_id]
    (b,) = token_bytes(token_id)
    return chr(b) if b < 0x80 else f"bytes:\\x{b:02x}"


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: only the text parts count
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    raise ValueError(f"message content must be a string, a list of parts or null, not {type(content).__name__}")


def _canonical_tool_calls(tool_calls: Any) -> list[dict[str, Any]]:
    # Only the fields a model produces, so extra keys a server or client adds (index, ...) never change the tokens.
    if not isinstance(tool_calls, list):
        raise ValueError("tool_calls must be a list")
    out: list[dict[str, Any]] = []
    for tc in tool_calls:
        if not isinstance(tc, Mapping) or not isinstance(tc.get("function"), Mapping):
            raise ValueError("each tool call must be an object with a 'function' object")
        fn = tc["function"]
        out.append(
            {
                "id": tc.get("id", ""),
                "type": tc.get("type", "function"),
                "function": {"name": fn.get("name", ""), "arguments": fn.get("arguments", "")},
            }
        )
    return out


def render_message_body(msg: Mapping[str, Any]) -> str:
    """The text of one message: its content, then its tool calls as canonical JSON (same message, same text)."""
    body = _content_text(msg.get("content"))
    tool_calls = msg.get("tool_calls")
    if tool_calls:
        body += json.dumps(_canonical_tool_calls(tool_calls), sort_keys=True, separators=(",", ":"))
    return body


def _role_token(msg: Mapping[str, Any]) -> int:
    role = msg.get("role")
    if not isinstance(role, str) or role not in ROLE_TOKENS:
        raise ValueError(f"unknown message role {role!r}; expected one of {sorted(ROLE_TOKENS)}")
    return ROLE_TOKENS[role]


def prompt_ids(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The prompt of a conversation: [role] + body + [<|end|>] per message, then the generation prompt."""
    ids: list[int] = []
    for msg in messages:
        ids.append(_role_token(msg))
        ids += encode(render_message_body(msg))
        ids.append(END)
    ids.append(ASSISTANT)
    return ids


def completion_ids(message: Mapping[str, Any]) -> list[int]:
    """The tokens an assistant message was generated as: its body and <|end|> (the role token is in the prompt)."""
    return [*encode(render_message_body(message)), END]


def logprob(token_id: int, position: int) -> float:
    """A deterministic stand-in log-probability in [-5, 0) for a token at a position of the completion."""
    return -(((token_id * 31 + position * 17) % 97) + 1) / 20
