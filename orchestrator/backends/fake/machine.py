"""The inside of a fake sandbox: commands answered by a handler, scripted rules or an echo, and an in-memory
filesystem, behind the same Transport interface envd's client implements.

No command ever runs: not in the sandbox (there is none), and never on the host. Exec validates its request as envd
does, waits the configured latency (bounded by the command's timeout, as envd kills a command at its deadline),
then answers:

1. the `exec_handler`, when one is configured (tests): it gets a FakeExec and returns an ExecResult;
2. else the first rule whose regular expression matches the command line: its stdout, stderr and exit code;
3. else an echo, exit 0: a plain `echo ARGS` (no other shell syntax) prints its arguments as a shell would; any other
   command's stdout is its stdin, or its command line and a newline when it has no stdin.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import re
import shlex
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

from orchestrator.backends.config import ExecHandler, ExecRule
from orchestrator.backends.fake.fs import MemoryFS
from orchestrator.core.errors import InvalidRequestError, SandboxDiedError, SandboxFileNotFoundError
from orchestrator.core.sandbox import (
    Command,
    ExecEnded,
    ExecEvent,
    ExecOutput,
    ExecResult,
    ExecStarted,
    FileEntry,
    ResetOutcome,
    Stdin,
    Transport,
    read_stdin,
)

# envd's defaults and bounds (envd/server.py EnvdConfig)
DEFAULT_TIMEOUT_S = 600.0
MAX_TIMEOUT_S = 24 * 3600.0
DEFAULT_MAX_OUTPUT = 1 << 20
MAX_OUTPUT_LIMIT = 256 << 20
FAKE_STDIN_BYTES = 256 << 20
SIGKILL = 9


@dataclass(frozen=True)
class FakeExec:
    """One command as an exec handler sees it; `fs` is the sandbox's filesystem, to read or change."""

    argv: tuple[str, ...]
    cwd: str
    env: Mapping[str, str]
    stdin: bytes
    timeout: float
    fs: MemoryFS = field(repr=False)
    sandbox_name: str = ""

    @property
    def command_line(self) -> str:
        """The command as text: a shell command as given, an argv joined with shell quoting."""
        if len(self.argv) == 3 and self.argv[:2] == ("/bin/sh", "-c"):
            return self.argv[2]
        return shlex.join(self.argv)


@dataclass(frozen=True)
class _Rules:
    """Compiled once per backend; shared by every sandbox."""

    compiled: tuple[tuple[re.Pattern[str], ExecRule], ...]

    @classmethod
    def of(cls, rules: tuple[ExecRule, ...]) -> _Rules:
        return cls(tuple((re.compile(r.match), r) for r in rules))

    def first(self, command_line: str) -> ExecRule | None:
        return next((rule for pattern, rule in self.compiled if pattern.search(command_line)), None)


@dataclass(frozen=True)
class Behaviour:
    """How every sandbox of one backend answers: shared, so a sandbox holds only a reference."""

    exec_latency_s: float = 0.0
    rules: _Rules = _Rules(())
    handler: ExecHandler | None = None


def _argv(cmd: Command) -> tuple[str, ...]:
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidRequestError("shell command is empty")
        return ("/bin/sh", "-c", cmd)
    argv = tuple(cmd)
    if not argv or not argv[0]:
        raise InvalidRequestError("argv is empty: give the program and its arguments")
    return argv


def _bounds(env: Mapping[str, str] | None, timeout: float | None, max_output: int | None) -> tuple[float, int]:
    t = timeout or 0.0
    if t < 0 or t > MAX_TIMEOUT_S or math.isnan(t):
        raise InvalidRequestError(f"timeout_s must be between 0 and {MAX_TIMEOUT_S:g}, got {t}")
    m = max_output or 0
    if m < 0 or m > MAX_OUTPUT_LIMIT:
        raise InvalidRequestError(f"max_output_bytes must be between 0 and {MAX_OUTPUT_LIMIT}, got {m}")
    for key in env or {}:
        if not key or "=" in key or "\0" in key:
            raise InvalidRequestError(f"invalid environment variable name {key!r}")
    return t or DEFAULT_TIMEOUT_S, m or DEFAULT_MAX_OUTPUT


def _plain_echo(command_line: str) -> bytes | None:
    """What `echo ARGS` prints, when the command is only that (no expansion, no operator, no option)."""
    if not command_line.startswith("echo ") or any(c in command_line for c in "$`\\\n"):
        return None
    lexer = shlex.shlex(command_line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    try:
        words = list(lexer)
    except ValueError:  # unbalanced quotes
        return None
    if any(w and set(w) <= set(";&|<>()") for w in words) or (len(words) > 1 and words[1].startswith("-")):
        return None
    return (" ".join(words[1:]) + "\n").encode()


class FakeMachine(Transport):
    """A fake sandbox's inside. `alive` turns False when the sandbox is killed; every call then fails as envd's
    would on a dead container."""

    def __init__(self, name: str, fs: MemoryFS, behaviour: Behaviour) -> None:
        self.name = name
        self.fs = fs
        self._behaviour = behaviour
        self._pids = 1  # envd's init is pid 1
        self.alive = True

    def _check(self) -> None:
        if not self.alive:
            raise SandboxDiedError(f"sandbox {self.name} is gone (killed; exit code 137)")

    async def exec_stream(
        self,
        cmd: Command,
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        stdin: Stdin = b"",
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> AsyncIterator[ExecEvent]:
        self._check()
        # an in-memory machine: streamed stdin is gathered, up to what one fake command takes
        data = await read_stdin(stdin, FAKE_STDIN_BYTES, "the fake backend")
        argv = _argv(cmd)
        limit_s, budget = _bounds(env, timeout, max_output)
        where = self.fs.resolve(cwd or self.fs.workspace)
        if not self.fs.is_dir(where):
            raise SandboxFileNotFoundError(f"cwd {where} does not exist or is not a directory")
        request = FakeExec(argv, where, dict(env or {}), data, limit_s, self.fs, self.name)
        self._pids += 1
        yield ExecStarted(self._pids)
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(limit_s):
                result = await self._answer(request)
        except TimeoutError:
            # killed at its deadline, like envd kills the process group
            yield ExecEnded(128 + SIGKILL, SIGKILL, True, False, False, time.monotonic() - t0)
            return
        self._check()  # killed while it ran
        truncated = result.truncated
        for stream, data in (("stdout", result.stdout), ("stderr", result.stderr)):
            if len(data) > budget:
                data, truncated = data[:budget], True
            budget -= len(data)
            if data:
                yield ExecOutput("stdout" if stream == "stdout" else "stderr", data)
        yield ExecEnded(
            result.exit_code, result.signal, result.timed_out, truncated, result.oom_killed, time.monotonic() - t0
        )

    async def _answer(self, request: FakeExec) -> ExecResult:
        b = self._behaviour
        if b.exec_latency_s:
            await asyncio.sleep(b.exec_latency_s)
        if b.handler is not None:
            outcome = b.handler(request)
            result = await outcome if inspect.isawaitable(outcome) else outcome
            if not isinstance(result, ExecResult):
                raise TypeError(f"the fake backend's exec_handler returned {type(result).__name__}, not ExecResult")
            return result
        rule = b.rules.first(request.command_line)
        if rule is not None:
            if rule.latency_s:
                await asyncio.sleep(rule.latency_s)
            return ExecResult(rule.exit_code, rule.stdout.encode(), rule.stderr.encode())
        echoed = _plain_echo(request.command_line)
        if echoed is not None:
            return ExecResult(0, echoed, b"")
        return ExecResult(0, request.stdin or (request.command_line + "\n").encode(), b"")

    async def read_file(self, path: str, max_bytes: int = 0) -> bytes:
        self._check()
        return self.fs.read(path, max_bytes)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644, make_parents: bool = True) -> None:
        self._check()
        self.fs.write(path, data, mode, make_parents)

    async def list_dir(self, path: str) -> list[FileEntry]:
        self._check()
        return self.fs.list(path)

    async def upload(self, tar: bytes, dest_dir: str) -> int:
        self._check()
        return self.fs.upload(tar, dest_dir)

    async def download(self, path: str) -> bytes:
        self._check()
        return self.fs.download(path)

    async def health(self, timeout: float) -> bool:
        return self.alive

    async def reset(self, workspace_seed: str) -> ResetOutcome:
        if not self.alive:
            return ResetOutcome(False, "the sandbox is gone")
        try:
            self.fs.reset(workspace_seed)
        except InvalidRequestError as e:
            return ResetOutcome(False, f"reset failed: {e}")
        return ResetOutcome(True)

    async def close(self) -> None:
        """Nothing to release: no connection, no process."""
