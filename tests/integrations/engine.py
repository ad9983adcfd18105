"""A trainer's inference engine played by the model server double: token ids in, the double's sampled ids out.

verl's `server_manager.generate(prompt_ids=...)` and `integrations.episode`'s `generate` are an engine that samples
from token ids. Here each call is a real `/v1/completions` request with a token-id prompt to the double in qwen3
mode (ScriptedServer), so the ids are the double's own samples (a `<think>` block, tool-call JSON spaced unlike
json.dumps, pieces split unlike the canonical tokenization) and the prompts the adapter builds are checked by the
double itself (its turn is read from the prompt, its answer follows the Qwen-like template's markers). What it
sampled is in `ScriptedServer.samples`, the log the tests compare the adapters' arrays with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from integrations.episode import Generated
from orchestrator.testing.scripted_policy import ScriptedServer


@dataclass
class DoubleEngine:
    """Generate by POSTing token ids to the double; every request body is kept (`requests`)."""

    server: ScriptedServer
    http: httpx.AsyncClient
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def generate(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> Generated:
        """One sample for `prompt_ids`; `request_id` is the double's `user` (a rollout-id shaped "x:task:0")."""
        body = {
            "model": self.server.script.model,
            "prompt": list(prompt_ids),
            "max_tokens": max_tokens,
            "logprobs": 0,
            "return_token_ids": True,
            "skip_special_tokens": False,
            "user": request_id,
        }
        self.requests.append(body)
        r = await self.http.post(f"{self.server.url}/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
        if choice["prompt_token_ids"] != list(prompt_ids):
            raise AssertionError("the double echoed another prompt than the one sent")
        return Generated(list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]))
