"""The built-in tools an environment can offer the policy: bash, python, read_file, write_file, str_replace, submit.

A tool runs in the sandbox and returns the observation text. What goes wrong inside the task (a missing file, a
bad argument) is an observation for the policy; what goes wrong with the sandbox (SandboxError) propagates, so the
rollout becomes INFRA_ERROR instead of a wrong answer.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator.core.errors import InvalidRequestError, SandboxFileError
from orchestrator.core.sandbox import ExecResult, Sandbox

MAX_OBSERVATION = 16 << 10
MAX_FILE_READ = 64 << 10
# the largest file str_replace edits: it reads the file whole and writes it back, so a read cut at envd's limit
# would write back a file cut short and say "edited"
MAX_EDIT_BYTES = 8 << 20


class ToolArgumentError(InvalidRequestError):
    """The policy called a tool with arguments that do not fit its schema."""


@dataclass(frozen=True)
class ToolResult:
    """The observation, and for `submit` the submitted answer; for a command, its exit code and timeout."""

    output: str
    submitted: bool = False
    answer: str | None = None
    exit_code: int | None = None
    timed_out: bool = False


ToolFn = Callable[[Sandbox, Mapping[str, Any], float], Awaitable[ToolResult]]


@dataclass(frozen=True)
class Tool:
    """A tool: its OpenAI function schema and what it does."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    run: ToolFn

    def schema(self) -> dict[str, Any]:
        """The OpenAI `tools` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


def _params(**props: tuple[str, str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()},
        "required": list(props),
    }


def _str_arg(args: Mapping[str, Any], key: str) -> str:
    value = args.get(key)
    if not isinstance(value, str):
        raise ToolArgumentError(f"argument {key!r} must be a string")
    return value


def _clip(text: str, limit: int = MAX_OBSERVATION) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... {len(text) - limit} more characters cut]"


def format_exec(r: ExecResult) -> str:
    """An exec result as the policy sees it."""
    out = r.stdout.decode(errors="replace") + r.stderr.decode(errors="replace")
    notes = []
    if r.timed_out:
        notes.append("timed out and was killed")
    if r.truncated:
        notes.append("output was truncated")
    if r.oom_killed:
        notes.append("killed: out of memory")
    if r.exit_code != 0 or notes:
        notes.insert(0, f"exit code {r.exit_code}")
    return _clip(out + (f"\n[{'; '.join(notes)}]" if notes else ""))


async def _bash(sandbox: Sandbox, args: Mapping[str, Any], timeout: float) -> ToolResult:
    r = await sandbox.exec(["bash", "-c", _str_arg(args, "command")], timeout=timeout, max_output=MAX_OBSERVATION * 2)
    return ToolResult(format_exec(r), exit_code=r.exit_code, timed_out=r.timed_out)


async def _python(sandbox: Sandbox, args: Mapping[str, Any], timeout: float) -> ToolResult:
    code = _str_arg(args, "code")
    r = await sandbox.exec(["python3", "-"], stdin=code.encode(), timeout=timeout, max_output=MAX_OBSERVATION * 2)
    return ToolResult(format_exec(r), exit_code=r.exit_code, timed_out=r.timed_out)


async def _read_file(sandbox: Sandbox, args: Mapping[str, Any], timeout: float) -> ToolResult:
    # a byte past the cap says whether there is more: a file cut at exactly the cap read as a whole one before
    data = await sandbox.read_file(_str_arg(args, "path"), max_bytes=MAX_FILE_READ + 1)
    text = data[:MAX_FILE_READ].decode(errors="replace")
    return ToolResult(text + f"\n[... cut at {MAX_FILE_READ} bytes]" if len(data) > MAX_FILE_READ else text)


async def _write_file(sandbox: Sandbox, args: Mapping[str, Any], timeout: float) -> ToolResult:
    path, content = _str_arg(args, "path"), _str_arg(args, "content")
    await sandbox.write_file(path, content.encode())
    return ToolResult(f"wrote {len(content.encode())} bytes to {path}")


async def _str_replace(sandbox: Sandbox, args: Mapping[str, Any], timeout: float) -> ToolResult:
    path, old, new = _str_arg(args, "path"), _str_arg(args, "old_str"), _str_arg(args, "new_str")
    data = await sandbox.read_file(path, max_bytes=MAX_EDIT_BYTES + 1)
    if len(data) > MAX_EDIT_BYTES:
        return ToolResult(f"error: {path} is over {MAX_EDIT_BYTES >> 20} MiB; str_replace edits smaller (use bash)")
    text = data.decode()
    count = text.count(old) if old else 0
    if count != 1:
        return ToolResult(f"error: old_str occurs {count} times in {path}; it must occur exactly once")
    await sandbox.write_file(path, text.replace(old, new, 1).encode())
    return ToolResult(f"edited {path}")


async def _submit(sandbox: Sandbox, args: Mapping[str, Any], timeout: float) -> ToolResult:
    answer = args.get("answer", "")
    return ToolResult("submitted", submitted=True, answer=answer if isinstance(answer, str) else json.dumps(answer))


BUILTIN_TOOLS: dict[str, Tool] = {
    t.name: t
    for t in (
        Tool("bash", "Run a bash command in the sandbox.", _params(command=("string", "the command")), _bash),
        Tool(
            "python",
            "Run Python 3 code in the sandbox; print what you need.",
            _params(code=("string", "code")),
            _python,
        ),
        Tool("read_file", "Read a text file.", _params(path=("string", "file path")), _read_file),
        Tool(
            "write_file",
            "Create or overwrite a text file.",
            _params(path=("string", "file path"), content=("string", "the whole new content")),
            _write_file,
        ),
        Tool(
            "str_replace",
            "Replace the one occurrence of old_str in a file with new_str.",
            _params(path=("string", "file path"), old_str=("string", "exact text"), new_str=("string", "new text")),
            _str_replace,
        ),
        Tool(
            "submit",
            "Submit your final answer and end the episode.",
            {"type": "object", "properties": {"answer": {"type": "string"}}, "required": []},
            _submit,
        ),
    )
}


def get_tools(names: tuple[str, ...]) -> list[Tool]:
    """The built-in tools by name; an unknown name is an error that lists the known ones."""
    unknown = [n for n in names if n not in BUILTIN_TOOLS]
    if unknown:
        raise InvalidRequestError(f"unknown tool(s) {unknown}; built-in tools are {sorted(BUILTIN_TOOLS)}")
    return [BUILTIN_TOOLS[n] for n in names]


async def call_tool(tool: Tool, sandbox: Sandbox, raw_arguments: str, timeout: float) -> ToolResult:
    """Parse the policy's JSON arguments and run the tool; task-level problems become the observation."""
    try:
        args = json.loads(raw_arguments) if raw_arguments.strip() else {}
    except json.JSONDecodeError as e:
        return ToolResult(f"error: arguments are not valid JSON ({e.msg} at position {e.pos})")
    except (ValueError, RecursionError):
        # nested deeper than the interpreter's stack, or an integer of thousands of digits: each escaped as an
        # infrastructure failure (masked and retried) for text the policy wrote
        return ToolResult("error: arguments are not JSON this tool reads (nested too deeply, or a number too long)")
    if not isinstance(args, dict):
        return ToolResult("error: arguments must be a JSON object")
    try:
        return await tool.run(sandbox, args, timeout)
    except (ToolArgumentError, SandboxFileError, InvalidRequestError, UnicodeDecodeError) as e:
        return ToolResult(f"error: {e}")
    except UnicodeEncodeError:
        # a lone surrogate's escape in the arguments (JSON lets one through): no command, path or file content can
        # carry it (UTF-8 has none), and a command holding one failed to reach envd, an infrastructure failure a
        # policy could cause at will. submit takes one (its answer is graded as it came).
        return ToolResult("error: the arguments hold a lone surrogate escape (\\ud800-\\udfff), which is no character")
