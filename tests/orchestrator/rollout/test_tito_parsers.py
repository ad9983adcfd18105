"""Tool-call parsers: hermes, qwen3_coder and llama3_json read well-formed calls, and garbled ones become calls whose
running gives the policy a tool error observation, never an exception."""

from __future__ import annotations

import json
from importlib.metadata import entry_points

import pytest

from orchestrator.core.errors import InvalidRequestError
from orchestrator.rollout.tito import ENTRY_POINT_GROUP, ToolCall, get_parser, parser_names

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "python",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "limit": {"type": "integer"},
                    "exact": {"type": "boolean"},
                    "weights": {"type": "array"},
                },
            },
        },
    },
]


def _args(call: ToolCall) -> object:
    return json.loads(call.arguments)


def test_builtins_are_entry_points_and_listed() -> None:
    assert {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} >= {"hermes", "qwen3_coder", "llama3_json"}
    assert parser_names()[:3] == sorted(["hermes", "llama3_json", "qwen3_coder"])


def test_an_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(InvalidRequestError, match=r"'hermez' is unknown; known: hermes, .*did you mean 'hermes'"):
        get_parser("hermez")


def test_hermes_reads_calls_with_spacing_unlike_json_dumps() -> None:
    text = (
        "<think>\nI should run it.\n</think>\n\nLet me check."
        '\n<tool_call>\n{"name":"python",  "arguments": {"code": "print(1 + 1)"}}\n</tool_call>'
        '\n<tool_call>\n{"name": "search", "arguments": {"query": "x", "limit": 3}}\n</tool_call>'
    )
    content, calls = get_parser("hermes").parse(text)
    assert content == "<think>\nI should run it.\n</think>\n\nLet me check."
    assert [c.id for c in calls] == ["call_0", "call_1"]
    assert [c.name for c in calls] == ["python", "search"]
    assert _args(calls[0]) == {"code": "print(1 + 1)"} and _args(calls[1]) == {"query": "x", "limit": 3}


def test_hermes_without_calls_is_all_content() -> None:
    assert get_parser("hermes").parse("  The answer is 4.\n") == ("The answer is 4.", [])


@pytest.mark.parametrize(
    ("body", "name"),
    [
        ('{"name": "python", "arguments": {"code": "print(1)"}', "python"),  # a brace short
        ("not json at all", ""),
        ('{"arguments": {"code": "1"}}', ""),  # no name
        ('["python", {"code": "1"}]', ""),  # not an object
    ],
)
def test_hermes_garbled_call_stays_a_call_with_what_could_be_read(body: str, name: str) -> None:
    content, calls = get_parser("hermes").parse(f"ok\n<tool_call>\n{body}\n</tool_call>")
    assert content == "ok"
    assert len(calls) == 1 and calls[0].name == name and calls[0].arguments == body


def test_hermes_unclosed_call_at_the_end_is_a_garbled_call() -> None:
    _, calls = get_parser("hermes").parse('<tool_call>\n{"name": "python", "arguments": {"co')
    assert calls == [ToolCall("call_0", "python", '{"name": "python", "arguments": {"co')]


def test_hermes_arguments_that_are_a_string_stay_that_string() -> None:
    _, calls = get_parser("hermes").parse(
        '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}</tool_call>'
    )
    assert calls[0].arguments == '{"code": "1"}'


def test_qwen3_coder_reads_xml_calls_typed_by_the_schema() -> None:
    text = (
        "I will search.\n<tool_call>\n<function=search>\n<parameter=query>\nhello world\n</parameter>\n"
        "<parameter=limit>\n5\n</parameter>\n<parameter=exact>\nTrue\n</parameter>\n"
        "<parameter=weights>\n[1, 2.5]\n</parameter>\n</function>\n</tool_call>"
        "\n<tool_call>\n<function=python>\n<parameter=code>\nfor i in range(3):\n    print(i)\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    content, calls = get_parser("qwen3_coder").parse(text, TOOLS)
    assert content == "I will search."
    assert [c.name for c in calls] == ["search", "python"]
    assert _args(calls[0]) == {"query": "hello world", "limit": 5, "exact": True, "weights": [1, 2.5]}
    assert _args(calls[1]) == {"code": "for i in range(3):\n    print(i)"}


def test_qwen3_coder_without_a_schema_keeps_strings() -> None:
    _, calls = get_parser("qwen3_coder").parse(
        "<tool_call><function=search><parameter=limit>5</parameter></function></tool_call>"
    )
    assert _args(calls[0]) == {"limit": "5"}


def test_qwen3_coder_a_value_the_schema_cannot_take_stays_text() -> None:
    _, calls = get_parser("qwen3_coder").parse(
        "<tool_call><function=search><parameter=limit>many</parameter></function></tool_call>", TOOLS
    )
    assert _args(calls[0]) == {"limit": "many"}


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("<tool_call>\nsearch for x\n</tool_call>", ""),  # no <function=...>
        ("<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\n", "python"),  # cut off, unclosed
    ],
)
def test_qwen3_coder_garbled_calls(text: str, name: str) -> None:
    _, calls = get_parser("qwen3_coder").parse(text, TOOLS)
    assert len(calls) == 1 and calls[0].name == name


def test_qwen3_coder_unclosed_parameter_runs_to_the_next() -> None:
    _, calls = get_parser("qwen3_coder").parse(
        "<tool_call><function=search><parameter=query>a<parameter=limit>2</parameter></function></tool_call>", TOOLS
    )
    assert _args(calls[0]) == {"query": "a", "limit": 2}


def test_llama3_json_reads_one_or_several_calls() -> None:
    p = get_parser("llama3_json")
    content, calls = p.parse('{"name": "python", "parameters": {"code": "print(2)"}}')
    assert content == "" and calls == [ToolCall("call_0", "python", '{"code": "print(2)"}')]
    _, calls = p.parse(
        '<|python_tag|>{"name": "search", "parameters": {"query": "a"}}; {"name": "python", "arguments": {"code": "1"}}'
    )
    assert [(c.name, _args(c)) for c in calls] == [("search", {"query": "a"}), ("python", {"code": "1"})]


@pytest.mark.parametrize("text", ["The answer is 4.", '{"answer": 4}', "{not json, no call here}"])
def test_llama3_json_prose_and_json_answers_are_content(text: str) -> None:
    assert get_parser("llama3_json").parse(text) == (text, [])


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ('{"name": "python", "parameters": {"code": "print(', "python"),
        ("<|python_tag|>python.call(code='1')", ""),
    ],
)
def test_llama3_json_garbled_calls(text: str, name: str) -> None:
    content, calls = get_parser("llama3_json").parse(text)
    assert content == "" and len(calls) == 1 and calls[0].name == name


def test_a_parser_never_raises_on_hostile_text() -> None:
    junk = ["", "<tool_call>", "</tool_call>", "<tool_call><function=", "{" * 5000, "<|python_tag|>", "\x00\ud800"]
    for name in ("hermes", "qwen3_coder", "llama3_json"):
        for text in junk:
            content, calls = get_parser(name).parse(text, TOOLS)
            assert isinstance(content, str) and all(isinstance(c, ToolCall) for c in calls)
