"""A fake inference engine for the session-driven adapters: token ids in, scripted token ids out, every sample logged.

Each episode (request id) answers a python call in its first turn, written with spacing unlike json.dumps and a
think block, as Qwen3 samples it, and submits the task's answer in its second. The ids are the Qwen-like tokenizer's
encoding of that text, so decoding and re-encoding would not be guaranteed to give them back: the adapter must keep
them as sampled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

PYTHON_TURN = (
    "<think>\nLet me think about this step by step.\n</think>\n\n"
    '<tool_call>\n{"name":"python",  "arguments": {"code": %s}}\n</tool_call><|im_end|>'
)
SUBMIT_TURN = (
    "<think>\nThe tool returned the result.\n</think>\n\n"
    '<tool_call>\n{"name": "submit","arguments":{"answer": %s}}\n</tool_call><|im_end|>'
)


@dataclass
class Sample:
    """One generate call: what it was given and what it sampled."""

    request_id: str
    prompt_ids: list[int]
    ids: list[int]
    logprobs: list[float]


@dataclass
class ScriptedEngine:
    """Answers by request id: turn 0 runs `code`, turn 1 submits `answers[task]` (the task is the id's middle)."""

    tokenizer: Any
    answers: dict[str, str]
    code: str = "print(6 * 7)"
    samples: list[Sample] = field(default_factory=list)

    def sample(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> Sample:
        """The next turn of this request's episode, cut at max_tokens."""
        turn = sum(s.request_id == request_id for s in self.samples)
        task = request_id.split(":")[1]
        text = PYTHON_TURN % json.dumps(self.code) if turn == 0 else SUBMIT_TURN % json.dumps(self.answers[task])
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))[:max_tokens]
        logprobs = [-0.01 * (1 + (i + turn) % 7) for i in range(len(ids))]
        s = Sample(request_id, list(prompt_ids), ids, logprobs)
        self.samples.append(s)
        return s
