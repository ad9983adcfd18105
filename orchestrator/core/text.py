"""Text from outside (a policy server's JSON, a scorer's output) made text every part of envfleet can carry: the
json module keeps what a `\\ud800` escape says, a lone surrogate, which is no character, and which neither the
result log nor the wire can hold (UTF-8 has none), so a rollout carrying one could not be stored or sent."""

from __future__ import annotations

from typing import Any


def as_text(s: str) -> str:
    """`s` made text: a surrogate pair that came as two halves (split between two events of a stream) joined into
    its character, and a lone surrogate U+FFFD."""
    return s.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")


def texts(value: Any) -> Any:
    """JSON the json module decoded, its strings (keys too) made text (as_text), in place where it can be; without
    recursion, since the json module reads nesting as deep as the interpreter's stack allows."""
    if isinstance(value, str):
        return as_text(value)
    stack = [value]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            pairs: Any = enumerate(node)
        elif isinstance(node, dict):
            items = list(node.items())
            node.clear()
            for k, v in items:
                node[as_text(k) if isinstance(k, str) else k] = v
            pairs = list(node.items())
        else:
            continue
        for k, v in pairs:
            if isinstance(v, str):
                node[k] = as_text(v)
            elif isinstance(v, (list, dict)):
                stack.append(v)
    return value
