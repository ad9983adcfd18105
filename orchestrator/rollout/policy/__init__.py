"""The policy client: chat messages and tools in, a Completion with token ids and logprobs out.

`base` is the seam (Policy, Completion), `client` the OpenAI-compatible HTTP client, `parsing` the response parser.
The endpoint and sampling configuration live in `orchestrator.core.policy`, the errors in `orchestrator.core.errors`.
"""

from orchestrator.rollout.policy.base import Completion, Policy, ToolCall
from orchestrator.rollout.policy.client import OpenAIPolicy
from orchestrator.rollout.policy.parsing import parse_chat_completion

__all__ = ["Completion", "OpenAIPolicy", "Policy", "ToolCall", "parse_chat_completion"]
