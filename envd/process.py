"""Running one command: its own process group, streamed output under a byte cap, a wall-clock timeout, and a kill
of everything it started when it ends, times out or is cancelled.

"Everything it started" is the part of envd's process subtree (envd is the sub-reaper, see envd/reaper.py) that no
other running command and no kept background process owns; the process group and the ENVD_EXEC_ID marker tell
concurrent commands apart. Output is read until the command exits or times out and what it started is killed,
then only briefly: a process that still holds the pipes cannot hold the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field

from envd.errors import InvalidRequestError, NotFoundError
from envd.reaper import kill_subtree, proc_table, reap_adopted, under

EXEC_ID_VAR = "ENVD_EXEC_ID"
READ_CHUNK = 64 << 10


@dataclass(frozen=True)
class Command:
    """One process to run, already validated."""

    argv: list[str]
    cwd: str
    env: Mapping[str, str]
    stdin: bytes
    timeout_s: float
    max_output_bytes: int
    keep_background: bool = False
    # more stdin after `stdin`, read as the process takes it (StartStream); None: stdin ends after `stdin`
    stdin_stream: AsyncIterator[bytes] | None = None


@dataclass(frozen=True)
class Started:
    """The process exists, with this pid."""

    pid: int


@dataclass(frozen=True)
class Output:
    """A chunk of the process's stdout (stream=1) or stderr (stream=2)."""

    stream: int
    data: bytes


@dataclass(frozen=True)
class Ended:
    """The process and everything it started are gone."""

    exit_code: int
    signal: int
    timed_out: bool
    truncated: bool
    oom_killed: bool
    duration_s: float


Event = Started | Output | Ended


def read_oom_kills() -> int:
    """How many times the OOM killer fired in this cgroup (v2 memory.events or v1 memory.oom_control); -1 if unknown."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            continue
    return -1


def _carries_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


@dataclass
class _Budget:
    left: int
    truncated: bool = False

    def take(self, data: bytes) -> bytes:
        if len(data) <= self.left:
            self.left -= len(data)
            return data
        self.truncated = True
        kept, self.left = data[: self.left], 0
        return kept


@dataclass
class ProcessRunner:
    """Spawns commands for envd and remembers the running ones (for Signal) and the kept background processes."""

    base_env: Mapping[str, str]
    # where orphans of its commands go: envd alone when it is their sub-reaper, envd and init (PID 1) where the kernel
    # has no sub-reapers (gVisor); empty: envd
    adopters: tuple[int, ...] = ()
    running: dict[int, str] = field(default_factory=dict)
    # background processes a keep_background command left: pid -> start time (a reused pid is not kept)
    kept: dict[int, int] = field(default_factory=dict)

    def signal(self, pid: int, signum: int) -> None:
        """Send `signum` to the process group of a running command."""
        if pid not in self.running:
            raise NotFoundError(f"no running process with pid {pid} was started by envd")
        try:
            signal.Signals(signum)
        except ValueError:
            raise InvalidRequestError(f"{signum} is not a signal number") from None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signum)

    def forget_all(self) -> None:
        """After a Reset killed every process: nothing is running or kept any more."""
        self.running.clear()
        self.kept.clear()

    def _others(self, pid: int) -> set[int]:
        """The roots of the subtrees that are not `pid`'s: other running commands, their orphans, kept processes."""
        roots = set(self.running) - {pid}
        if not roots and not self.kept:
            return roots  # the common case: one command at a time, nothing kept, no scan needed
        table = proc_table()
        adopters = set(self.adopters or (os.getpid(),))
        self.kept = {p: t for p, t in self.kept.items() if p in table and table[p].start == t}
        roots |= set(self.kept)
        markers = [f"{EXEC_ID_VAR}={x}".encode() for p, x in self.running.items() if p != pid]
        for p, info in table.items():
            if info.ppid not in adopters or p in roots or p == pid or p == os.getpid():
                continue
            if info.pgid in roots or any(_carries_marker(p, m) for m in markers):
                roots.add(p)  # an orphan of another running command, still in its group or carrying its marker
        return roots

    def kill_started(self, pid: int) -> list[int]:
        """Kill what the command `pid` started (and `pid`): envd's subtree but for what others own."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        return kill_subtree(self._others(pid), set(self.running), self.adopters)

    def keep_started(self, pid: int) -> None:
        """Remember what the command `pid` left running, so later commands' ends leave it alone."""
        table = proc_table()
        for p in under(table, self.adopters or (os.getpid(),), self._others(pid)):
            self.kept[p] = table[p].start

    async def run(self, cmd: Command) -> AsyncGenerator[Event, None]:
        """Run `cmd`, yielding Started, Output chunks in arrival order, then Ended. Closing the iterator kills it."""
        if not os.path.isdir(cmd.cwd):
            raise NotFoundError(f"cwd {cmd.cwd} does not exist or is not a directory")
        exec_id = os.urandom(16).hex()
        env = {**self.base_env, **cmd.env, EXEC_ID_VAR: exec_id}
        oom_before = read_oom_kills()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        if self.kept:  # what a kept process leaves when it dies is envd's to reap
            reap_adopted(self.running)
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd.argv,
                stdin=asyncio.subprocess.PIPE if cmd.stdin or cmd.stdin_stream else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=cmd.cwd,
                env=env,
                start_new_session=True,
            )
        except (FileNotFoundError, PermissionError) as e:
            code = 127 if isinstance(e, FileNotFoundError) else 126
            yield Started(pid=0)
            yield Output(2, f"envd: cannot execute {cmd.argv[0]!r}: {e.strerror}\n".encode())
            yield Ended(code, 0, False, False, False, loop.time() - t0)
            return
        self.running[proc.pid] = exec_id
        budget = _Budget(cmd.max_output_bytes)
        queue: asyncio.Queue[Output | None] = asyncio.Queue(maxsize=8)
        timed_out = False
        finished = False
        tasks: list[asyncio.Task[None]] = []
        exited = asyncio.create_task(_exited(proc))
        try:
            yield Started(pid=proc.pid)
            assert proc.stdout is not None and proc.stderr is not None
            tasks = [
                asyncio.create_task(_pump(proc.stdout, 1, budget, queue)),
                asyncio.create_task(_pump(proc.stderr, 2, budget, queue)),
            ]
            if (cmd.stdin or cmd.stdin_stream) and proc.stdin is not None:
                tasks.append(asyncio.create_task(_feed(proc.stdin, cmd.stdin, cmd.stdin_stream)))
            deadline = t0 + cmd.timeout_s
            streams = _Streams(queue)
            # 1. forward output until the command exits or its time is up
            async for item in streams.until(exited, deadline):
                yield item
            try:  # the pipes may close before the exit shows
                async with asyncio.timeout_at(deadline):
                    await asyncio.shield(exited)
            except TimeoutError:
                timed_out = True
            # 2. kill what it started (or keep it), then read what is left in the pipes, briefly
            # on the loop, not in a thread: a fork bomb leaves no pid for a new thread, and this is what frees them
            if timed_out or not cmd.keep_background:
                self.kill_started(proc.pid)
            else:
                self.keep_started(proc.pid)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(EXIT_WAIT_S):
                    await asyncio.shield(exited)
            grace = KEEP_DRAIN_S if cmd.keep_background and not timed_out else DRAIN_S
            async for item in streams.until(None, loop.time() + grace):
                yield item
            returncode = await _returncode(proc)
            finished = True
        finally:
            for t in tasks:
                t.cancel()
            if not finished:  # cancelled or failed: what it started goes, whatever it asked
                self.kill_started(proc.pid)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(EXIT_WAIT_S):
                        await asyncio.shield(exited)
            exited.cancel()
            transport = getattr(proc, "_transport", None)
            if transport is not None:
                transport.close()  # the pipes' read ends: a process still holding the write ends gets EPIPE
            if proc.returncode is not None:
                self.running.pop(proc.pid, None)
            else:  # asyncio still has to reap it; the stray reaper must not
                loop.call_later(EXIT_WAIT_S, self.running.pop, proc.pid, None)
        sig = -returncode if returncode < 0 else 0
        exit_code = 128 + sig if sig else returncode
        oom = sig == signal.SIGKILL and not timed_out and oom_before >= 0 and read_oom_kills() > oom_before
        yield Ended(exit_code, sig, timed_out, budget.truncated, oom, loop.time() - t0)


# after its kill, how long the command's own exit may take to show; then how long the pipes are read for
EXIT_WAIT_S = 5.0
DRAIN_S = 2.0
KEEP_DRAIN_S = 0.1


class _Streams:
    """The output queue of one command, read until both pipes close, an event, or a deadline."""

    def __init__(self, queue: asyncio.Queue[Output | None]) -> None:
        self._queue = queue
        self.open = 2

    async def until(self, stop: asyncio.Future[None] | None, deadline: float) -> AsyncGenerator[Output, None]:
        """Yield output until both pipes closed, `stop` is done or the loop's clock passes `deadline`."""
        loop = asyncio.get_running_loop()
        while self.open:
            if self._queue.empty() and stop is not None and stop.done():
                return
            get = asyncio.ensure_future(self._queue.get())
            waits: set[asyncio.Future[object]] = {get}  # type: ignore[arg-type]
            if stop is not None:
                waits.add(stop)  # type: ignore[arg-type]
            done, _ = await asyncio.wait(waits, timeout=max(0.0, deadline - loop.time()), return_when="FIRST_COMPLETED")
            if get not in done:
                get.cancel()
                if stop is None or not stop.done():
                    return  # the deadline passed
                continue  # stopped: forward what was already queued, then return
            item = get.result()
            if item is None:
                self.open -= 1
            else:
                yield item


async def _returncode(proc: asyncio.subprocess.Process) -> int:
    """The exit status, once the child watcher has reaped the process (never waiting for the pipes to close)."""
    loop = asyncio.get_running_loop()
    until = loop.time() + EXIT_WAIT_S
    spins = 0
    while loop.time() < until:
        if proc.returncode is not None:
            return proc.returncode
        # the watcher's callback usually runs in this same loop turn or the next: yield before sleeping
        spins += 1
        await asyncio.sleep(0 if spins < 20 else 0.001)
    return -signal.SIGKILL  # not reaped in time: it was killed and is a zombie; report the kill


async def _pump(stream: asyncio.StreamReader, which: int, budget: _Budget, queue: asyncio.Queue[Output | None]) -> None:
    # Output past the cap is read and dropped, so the process never blocks on a full pipe and memory stays flat.
    while chunk := await stream.read(READ_CHUNK):
        kept = budget.take(chunk)
        if kept:
            await queue.put(Output(which, kept))
    await queue.put(None)


async def _exited(proc: asyncio.subprocess.Process) -> None:
    """Return once the process has exited, whether or not its pipes are still held open by others.

    asyncio's proc.wait() also waits for the pipes to close, which a background child can hold forever.
    """
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfd support: poll the watcher's returncode
        while proc.returncode is None:  # noqa: ASYNC110 - the watcher sets it without an event to wait on
            await asyncio.sleep(0.02)
        return
    try:
        done: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not done.done():
                done.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await done
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)


async def _feed(pipe: asyncio.StreamWriter, data: bytes, more: AsyncIterator[bytes] | None = None) -> None:
    # one chunk at a time, each drained before the next is read: a process that reads slowly holds the sender back
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        if data:
            pipe.write(data)
            await pipe.drain()
        if more is not None:
            async for chunk in more:
                pipe.write(chunk)
                await pipe.drain()
    pipe.close()
