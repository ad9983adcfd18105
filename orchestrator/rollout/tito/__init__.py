"""Token-in, token-out (tito) rollouts: the model's tokenizer and chat template as token ids, and tool-call parsers.

This package's top level is tokenizer-only (no httpx, no sandbox, no gRPC), so a trainer adapter can import it
alone:

    from orchestrator.rollout.tito import ChatTemplateTokens, get_parser

    tokens = ChatTemplateTokens(tokenizer)            # any transformers tokenizer with a chat template
    ids = tokens.prompt_ids(messages, tools)          # the first prompt, generation prompt added
    ids += sampled_ids                                # what the server sampled, exactly (mask 1)
    ids += tokens.observation_ids(tool_messages, tools)  # the delta after the assistant turn (mask 0)
    content, calls = get_parser("hermes").parse(tokens.decode(sampled_ids))

The HTTP policy that does this against `/v1/completions` is `orchestrator.rollout.tito.policy.TitoPolicy`.
"""

from orchestrator.rollout.policy.base import ToolCall
from orchestrator.rollout.tito.parsers import (
    ENTRY_POINT_GROUP,
    HermesParser,
    Llama3JsonParser,
    Qwen3CoderParser,
    ToolParser,
    get_parser,
    parser_names,
)
from orchestrator.rollout.tito.template import BASE_CONVERSATION, ChatTemplateTokens
from orchestrator.rollout.tito.tokenizer import TokenizerCache, TokenizerDirs, load_tokenizer

__all__ = [
    "BASE_CONVERSATION",
    "ENTRY_POINT_GROUP",
    "ChatTemplateTokens",
    "HermesParser",
    "Llama3JsonParser",
    "Qwen3CoderParser",
    "TokenizerCache",
    "TokenizerDirs",
    "ToolCall",
    "ToolParser",
    "get_parser",
    "load_tokenizer",
    "parser_names",
]
