"""The tools an environment offers the policy: the built-in bash, python, read_file, write_file, str_replace and
submit, by name, and an environment's own, as Tool objects.

A tool runs in the sandbox and returns the observation text. What goes wrong inside the task (a missing file, a
bad argument) is an observation for the policy; what goes wrong with the sandbox (SandboxError) propagates, so the
rollout becomes INFRA_ERROR instead of a wrong answer. An environment's own tool gets only arguments that fit its
JSON schema (others are an observation, the policy's mistake), and whatever else it raises, or a result other than a
ToolResult, is the environment's failure (ENV_ERROR).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.core.echo import echo
from orchestrator.core.errors import (
    EnvironmentBroken,
    InvalidRequestError,
    PolicyError,
    SandboxError,
    SandboxFileError,
)
from orchestrator.core.sandbox import ExecResult, Sandbox
from orchestrator.core.text import as_text

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


@dataclass(frozen=True, eq=False)
class Tool:
    """A tool: its OpenAI function schema and what it does. An environment's own tool is one of these in its `tools`:
    a name (letters, digits, _ and -, up to 64), a description, `parameters` (a JSON schema of type object) and `run`,
    an `async def run(sandbox, arguments, timeout_s) -> ToolResult` that gets arguments which fit the schema."""

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


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
MAX_ARGUMENT_ERROR = 300  # characters of a schema error the policy is shown (it may quote the policy's own text)


def get_tools(tools: Sequence[str | Tool]) -> list[Tool]:
    """The tools of an environment's `tools`: built-in ones by name, its own as Tool objects (checked once, and run
    behind their schema). InvalidRequestError says what is wrong: an unknown name (listing the built-in ones), a
    malformed tool, a name given twice."""
    unknown = [t for t in tools if isinstance(t, str) and t not in BUILTIN_TOOLS]
    if unknown:
        raise InvalidRequestError(f"unknown tool(s) {unknown}; built-in tools are {sorted(BUILTIN_TOOLS)}")
    out: list[Tool] = []
    for t in tools:
        if isinstance(t, str):
            out.append(BUILTIN_TOOLS[t])
        elif isinstance(t, Tool):
            out.append(_own(t))
        else:
            raise InvalidRequestError(f"tool {echo(t)} is neither a built-in tool's name nor a Tool")
    names = [t.name for t in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise InvalidRequestError(f"tool(s) {twice} named more than once")
    return out


def tool_names(tools: Sequence[str | Tool]) -> list[str]:
    """The names of an environment's `tools` (built-in names and its own Tools')."""
    return [t if isinstance(t, str) else t.name for t in tools]


# what an environment's own tool may raise as the built-in ones do: the sandbox's failure, or what call_tool makes
# an observation of; anything else is the environment's (ENV_ERROR)
_PASSED_ON = (
    SandboxError,
    PolicyError,
    InvalidRequestError,
    SandboxFileError,
    UnicodeDecodeError,
    UnicodeEncodeError,  # a lone surrogate's escape in the arguments (call_tool's observation, as for built-ins)
    asyncio.CancelledError,
)
_OWN: weakref.WeakKeyDictionary[Tool, Tool] = weakref.WeakKeyDictionary()  # an environment's Tool, behind its schema
_GUARDED: weakref.WeakSet[Tool] = weakref.WeakSet()  # the tools _own made (given again, they are as they are)
# arguments past this many bytes (as JSON) are checked off the event loop: a schema's check can be slow (uniqueItems
# over objects is quadratic: 100 KB of arguments took 50 s), and on the loop it held every rollout of the process
CHECK_INLINE_BYTES = 16 << 10


def _own(tool: Tool) -> Tool:
    if tool in _GUARDED:
        return tool
    known = _OWN.get(tool)
    if known is not None:
        return known
    import jsonschema  # type: ignore[import-untyped]  # only where an environment brings its own tools
    import referencing

    name = tool.name
    if not isinstance(name, str) or not _TOOL_NAME.match(name):
        raise InvalidRequestError(f"tool name {echo(name)} must match {_TOOL_NAME.pattern}")
    if name in BUILTIN_TOOLS:
        raise InvalidRequestError(f"tool {name!r} is a built-in tool's name: offer it by name, or name yours otherwise")
    if not isinstance(tool.description, str):
        raise InvalidRequestError(f"tool {name!r}: its description must be text")
    if not isinstance(tool.parameters, Mapping) or tool.parameters.get("type") != "object":
        raise InvalidRequestError(f"tool {name!r}: its parameters must be a JSON schema of type object")
    try:  # plain JSON, as the wire and the digest take it (a MappingProxyType inside failed at every listing)
        parameters = json.loads(json.dumps(tool.parameters, default=_mapping))
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"tool {name!r}: its parameters are not JSON: {e}") from None
    try:
        jsonschema.Draft202012Validator.check_schema(parameters)
    except jsonschema.SchemaError as e:
        raise InvalidRequestError(f"tool {name!r}: its parameters are no JSON schema: {e.message}") from None
    if not inspect.iscoroutinefunction(tool.run):
        raise InvalidRequestError(f"tool {name!r}: run must be an async def (sandbox, arguments, timeout_s)")
    outside = [ref for ref in _refs(parameters) if not ref.startswith("#")]
    if outside:
        # jsonschema fetched one with urlopen, with no timeout, at every call (a file: one's text reached the policy)
        raise InvalidRequestError(f"tool {name!r}: its parameters refer outside themselves ({outside[0]!r})")
    # an empty registry: a $ref is resolved within the schema, never fetched
    validator = jsonschema.Draft202012Validator(parameters, registry=referencing.Registry())
    run = tool.run

    def first_error(args: Mapping[str, Any]) -> Any:
        return next(iter(validator.iter_errors(dict(args))), None)

    async def guarded(sandbox: Sandbox, args: Mapping[str, Any], timeout: float) -> ToolResult:
        try:
            if len(json.dumps(args)) <= CHECK_INLINE_BYTES:
                error = first_error(args)
            else:
                error = await asyncio.to_thread(first_error, args)
        except RecursionError:
            return ToolResult(f"error: the arguments of {name} are nested too deeply")
        except Exception as e:  # the schema's own fault (a $ref that resolves nowhere): the environment's
            raise EnvironmentBroken(f"tool {name!r}: its parameters could not check the arguments: {e}") from e
        if error is not None:
            message = error.message[:MAX_ARGUMENT_ERROR]
            return ToolResult(f"error: the arguments do not fit {name}'s parameters: {message}")
        try:
            result = await run(sandbox, args, timeout)
        except _PASSED_ON:
            raise  # the sandbox's failure, or what call_tool makes an observation of
        except Exception as e:
            e.add_note(f"in tool {name!r}")  # the rollout's error names it (classify_failure)
            raise EnvironmentBroken(f"tool {name!r} raised {type(e).__name__}: {e}") from e
        if not isinstance(result, ToolResult):
            raise EnvironmentBroken(f"tool {name!r} returned a {type(result).__name__}, not a ToolResult")
        if not isinstance(result.output, str) or not (result.answer is None or isinstance(result.answer, str)):
            raise EnvironmentBroken(f"tool {name!r} returned a ToolResult whose output or answer is not text")
        return dataclasses.replace(result, output=_clip(as_text(result.output)))

    checked = _OWN[tool] = dataclasses.replace(tool, parameters=parameters, run=guarded)
    _GUARDED.add(checked)
    return checked


def _mapping(value: object) -> dict[str, Any]:
    if isinstance(value, Mapping):
        return dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def _refs(schema: object) -> list[str]:
    """Every `$ref` in a JSON schema."""
    if isinstance(schema, dict):
        own = [schema["$ref"]] if isinstance(schema.get("$ref"), str) else []
        return own + [r for v in schema.values() for r in _refs(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in _refs(v)]
    return []


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
