"""Running one command: its own process group, streamed output under a byte cap, a wall-clock timeout, and a kill
of everything it started when it ends, times out or is cancelled.

"Everything it started" is found three ways, as far as a process tree can be found: its process group, its
descendants in /proc, and any process whose environment carries the command's ENVD_EXEC_ID (which survives setsid
and re-parenting to init).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field

from envd.errors import InvalidRequestError, NotFoundError

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


def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) for every visible process."""
    table: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()
        table[int(name)] = (int(fields[1]), int(fields[2]))
    return table


def _carries_marker(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:
        return False


def kill_tree(pid: int, exec_id: str) -> None:
    """SIGKILL the process group of `pid`, its descendants, and every process tagged with `exec_id`."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    me = os.getpid()
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    doomed: set[int] = set()
    stack = [pid]
    while stack:
        p = stack.pop()
        for c in children.get(p, []):
            if c not in doomed:
                doomed.add(c)
                stack.append(c)
    marker = f"{EXEC_ID_VAR}={exec_id}".encode()
    doomed.update(p for p in table if p not in doomed and p != me and _carries_marker(p, marker))
    doomed.discard(me)
    for p in doomed:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)


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
    """Spawns commands for envd and remembers the running ones, for Signal."""

    base_env: Mapping[str, str]
    running: dict[int, str] = field(default_factory=dict)

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

    async def run(self, cmd: Command) -> AsyncGenerator[Event, None]:
        """Run `cmd`, yielding Started, Output chunks in arrival order, then Ended. Closing the iterator kills it."""
        if not os.path.isdir(cmd.cwd):
            raise NotFoundError(f"cwd {cmd.cwd} does not exist or is not a directory")
        exec_id = os.urandom(16).hex()
        env = {**self.base_env, **cmd.env, EXEC_ID_VAR: exec_id}
        oom_before = read_oom_kills()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            proc = await asyncio.create_subprocess_exec(
                *cmd.argv,
                stdin=asyncio.subprocess.PIPE if cmd.stdin else asyncio.subprocess.DEVNULL,
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
        tasks: list[asyncio.Task[None]] = []
        reaper = asyncio.create_task(_reap_group_on_exit(proc, exec_id))
        try:
            yield Started(pid=proc.pid)
            assert proc.stdout is not None and proc.stderr is not None
            tasks = [
                asyncio.create_task(_pump(proc.stdout, 1, budget, queue)),
                asyncio.create_task(_pump(proc.stderr, 2, budget, queue)),
            ]
            if cmd.stdin and proc.stdin is not None:
                tasks.append(asyncio.create_task(_feed(proc.stdin, cmd.stdin)))
            deadline = t0 + cmd.timeout_s
            open_streams = 2
            while open_streams:
                try:
                    async with asyncio.timeout_at(deadline):
                        item = await queue.get()
                except TimeoutError:
                    timed_out = True
                    break
                if item is None:
                    open_streams -= 1
                else:
                    yield item
            if timed_out:
                kill_tree(proc.pid, exec_id)
            try:
                async with asyncio.timeout_at(deadline):
                    await asyncio.shield(reaper)
            except TimeoutError:
                timed_out = True
                kill_tree(proc.pid, exec_id)
                await reaper
            returncode = await proc.wait()
        finally:
            if not reaper.done():
                reaper.cancel()
                kill_tree(proc.pid, exec_id)
            for t in tasks:
                t.cancel()
            self.running.pop(proc.pid, None)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await asyncio.shield(proc.wait())
        sig = -returncode if returncode < 0 else 0
        exit_code = 128 + sig if sig else returncode
        oom = sig == signal.SIGKILL and not timed_out and oom_before >= 0 and read_oom_kills() > oom_before
        yield Ended(exit_code, sig, timed_out, budget.truncated, oom, loop.time() - t0)


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


async def _reap_group_on_exit(proc: asyncio.subprocess.Process, exec_id: str) -> None:
    # When the command itself ends, what it left running in the background is killed, which also closes the pipes.
    await _exited(proc)
    kill_tree(proc.pid, exec_id)


async def _feed(pipe: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        pipe.write(data)
        await pipe.drain()
    pipe.close()
