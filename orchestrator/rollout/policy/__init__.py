"""The policy client: chat messages and tools in, a Completion with token ids and logprobs out.

`base` is the seam (Policy, Completion, ToolCall), `client` the OpenAI-compatible HTTP client (chat mode), `parsing`
its response parser; token-in, token-out lives in orchestrator/rollout/tito/. The endpoint and sampling
configuration live in `orchestrator.core.policy`, the errors in `orchestrator.core.errors`. This package imports
only the seam, so that the tokenizer-only tito modules (which a trainer adapter imports alone) pull in no httpx.
"""

from orchestrator.rollout.policy.base import Completion, ContextFull, Policy, ToolCall

__all__ = ["Completion", "ContextFull", "Policy", "ToolCall"]
