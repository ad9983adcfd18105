"""A reasoning model's thinking is no answer: token-in, token-out decodes the sampled ids whole, `<think>...</think>`
included, and the answer a grader read held the thinking (a right plain-text answer scored 0)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.rollout.tito.parsers import get_parser
from orchestrator.rollout.tito.reasoning import answer_text, parse_turn, prompt_opens_thinking, split_reasoning
from orchestrator.service.registry import Registry
from orchestrator.testing.qwen_like import QWEN_LIKE_DIR, thinking_in_prompt
from orchestrator.testing.scripted_policy import Script, Step, start_scripted_server
from tests.orchestrator.servers import FAKE, serve

pytest.importorskip("transformers")

CALL = '<tool_call>\n{"name": "submit", "arguments": {"answer": "1"}}\n</tool_call>'


@pytest.mark.parametrize(
    ("text", "reasoning", "rest"),
    [
        ("<think>\nhmm\n</think>\n\n42", "<think>\nhmm\n</think>", "\n\n42"),
        ("<think>\n\n</think>\n\n42", "<think>\n\n</think>", "\n\n42"),  # Qwen3 with thinking off
        ("  <think>a</think>b", "  <think>a</think>", "b"),
        ("<think>cut off while think", "<think>cut off while think", ""),
        ("42", "", "42"),
        ("the answer is <think>x</think> 42", "", "the answer is <think>x</think> 42"),
        # a closing tag the turn did not open is text: a call whose code splits on it, not thinking to drop
        (
            '<tool_call>{"code": "s.split(\'</think>\')"}</tool_call>',
            "",
            '<tool_call>{"code": "s.split(\'</think>\')"}</tool_call>',
        ),
    ],
)
def test_split_reasoning(text: str, reasoning: str, rest: str) -> None:
    assert split_reasoning(text) == (reasoning, rest)


def test_answer_text() -> None:
    assert answer_text("<think>\nhmm\n</think>\n\n 42 ") == "42"
    assert answer_text(" 42 ") == " 42 "  # no reasoning: as it is
    assert answer_text("<think>x</think>Use `<think>` tags: 42") == "Use `<think>` tags: 42"  # the answer may name them
    assert answer_text("<think>cut off") == ""
    # a call written while thinking is none: the parser reads what follows the thinking
    said = split_reasoning(f"<think>maybe {CALL}</think>\n\n2")[1]
    assert get_parser("hermes").parse(said, [])[1] == []


def test_a_thinking_the_prompt_opened_runs_to_its_first_close() -> None:
    assert prompt_opens_thinking(lambda ids: "<|im_start|>assistant\n<think>\n", [1, 2, 3])
    assert not prompt_opens_thinking(lambda ids: "<|im_start|>assistant\n<think>\n\n</think>\n\n", [1])  # off
    assert not prompt_opens_thinking(lambda ids: "<|im_start|>assistant\n", [1])
    hermes = get_parser("hermes")
    # R1-style: the turn writes only the close; its thinking is no answer and a call in it is none
    content, calls = parse_turn(hermes, f"maybe {CALL}</think>\n\n42", [], opened=True)
    assert calls == [] and content.startswith(f"<think>maybe {CALL}</think>") and answer_text(content) == "42"
    assert answer_text(parse_turn(hermes, "hmm</think>\n\n42", [], opened=True)[0]) == "42"
    assert answer_text(parse_turn(hermes, "cut off while thinking", [], opened=True)[0]) == ""
    # not opened: a close with no open is text, as before
    assert parse_turn(hermes, "a </think> b", [])[0] == "a </think> b"


@pytest.mark.parametrize(
    ("token_mode", "opened"),
    # chat: the baseline (the server strips the reasoning); opened: the template ends its generation prompt with
    # `<think>\n` (DeepSeek-R1, Qwen3-Thinking-2507), so the model writes only the close (a right answer scored 0)
    [("chat", False), ("tito", False), ("tito", True)],
)
async def test_a_plain_answer_after_thinking_scores_as_in_chat_mode(
    tmp_path: Path, token_mode: str, opened: bool
) -> None:
    env = Registry.from_entry_points().get("python-tool")
    task = next(t for t in env.tasks() if t.id == "py-004")
    answer = str(task.data["answer"])
    script = Script(template="qwen3", model="qwen-like", tasks={task.id: [Step(content=answer)]})
    tokenizer = thinking_in_prompt(tmp_path / "tokenizers") if opened else QWEN_LIKE_DIR
    server = await start_scripted_server(script)
    try:
        async with (
            serve(tmp_path / "data", backend=FAKE, tokenizer_dirs=[tokenizer.parent]) as orch,
            EnvfleetClient(orch.address) as client,
        ):
            policy = PolicyEndpoint(base_url=server.url, model="qwen-like", tokenizer=tokenizer.name)
            spec = JobSpec(
                env="python-tool", tasks=TaskSelection(kind="ids", ids=[task.id]), policy=policy, token_mode=token_mode
            )
            (rollout,) = [r async for r in client.rollouts(await client.submit(spec))]
    finally:
        await server.close()
    assert (rollout.status.value, rollout.reward, rollout.tokens.status) == ("OK", 1.0, "complete")
    if token_mode == "tito":  # the turn's text keeps the thinking the tokens hold
        assert [t.text for t in rollout.turns if t.role == "assistant"][-1].startswith("<think>")
        sampled = server.samples[-1].ids
        assert rollout.tokens.completion_ids[-len(sampled) :] == sampled
        # with the prompt's <think>, the model wrote no <think> of its own
        assert ("<think>" in tokenizer_text(tokenizer, sampled)) is not opened


def tokenizer_text(path: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return str(AutoTokenizer.from_pretrained(path).decode(ids))
