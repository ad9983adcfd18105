"""One spawned command as envd sees it: its pipes read on the event loop, its exit, its exit status.

Why not asyncio's subprocess API: per exec it builds a transport and a protocol per pipe, a StreamReader each, a
task per pipe to pump them, a child watcher callback sent through call_soon_threadsafe (a self-pipe write), and
proc.wait() waits for the pipes as well as the exit. Here the pipes are plain non-blocking fds with a reader
callback each, the exit is a pidfd on the loop (polled with waitpid where the kernel has no pidfd: gVisor), and
one future wakes the consumer, which is about half of envd's CPU per short exec.

envd reaps its children itself: the Popen object only spawns (with close_fds and a new session), and with a
pidfd the process is reaped through it (waitid P_PIDFD), after its group was killed, so neither a reused pid nor
the stray reaper can take its status.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass

READ_CHUNK = 64 << 10
# output chunks held for a consumer that is slower than the process; past this the pipes are not read, so the
# process blocks on a full pipe (backpressure) rather than envd's memory growing
MAX_PENDING = 8
# the processes a command's start gives oom_score_adj 1000 at most: itself and what it forked before envd's write
# (a fork bomb's are the pid limit's business, not this walk's)
FIRST_TO_GO_MAX = 256
# a command still inside its exec is tried again this often, this many times (a binary it may not read stays
# non-dumpable, its /proc files root's, for good: 50 ms of timers, not of the loop's time)
FIRST_TO_GO_RETRY_S = 0.001
FIRST_TO_GO_TRIES = 50
# Output goes out in turns: at once while they are few (a burst of PACE_BURST turns, then one more each PACE_EVERY_S),
# each with what the pipes sent meanwhile (at most MAX_PENDING chunks, then the pipes wait, full), the chunks of a
# stream in a row joined, in their order. A command that wrote a byte at a time was a message per byte, each a gRPC
# message of envd's and an event the host relayed to its caller, a million for one command's 1 MiB of output
# (envd/go/process.go too). A turn of chunks of PACE_SMALL bytes or more is not counted: large output goes as often as
# it comes.
PACE_EVERY_S = 0.002
PACE_BURST = 16
PACE_SMALL = 4096
# without pidfd: how often the exit is polled, first and at most
POLL_FIRST_S = 0.001
POLL_MAX_S = 0.02


@dataclass(frozen=True)
class Output:
    """A chunk of the process's stdout (stream=1) or stderr (stream=2)."""

    stream: int
    data: bytes


@dataclass
class Budget:
    """The bytes of output still to be kept; the rest is read and dropped."""

    left: int
    truncated: bool = False

    def take(self, data: bytes) -> bytes:
        if len(data) <= self.left:
            self.left -= len(data)
            return data
        self.truncated = True
        kept, self.left = data[: self.left], 0
        return kept


def _set_once(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def first_to_go(pid: int, tries: int = 0) -> None:
    """The command, and what it starts later, go before envd when the sandbox runs out of memory (envd/go/child.go,
    firstToGo): oom_score_adj 1000 adds the whole limit to their score. A process may lower its own back to 0, so
    this is the default order, not a wall.

    Written once the command has exec'd (Popen returns then), so what it forked before the write inherited envd's 0:
    a shell's workers started in its first milliseconds while envd waited for a core, enough of them to fill the
    limit, and envd (the largest at 0) was the one killed. Its descendants found then are given 1000 too, each
    written before its children are listed: one forked after the write inherits 1000, one forked before is listed.
    """
    todo, seen = [pid], 0
    while todo and seen < FIRST_TO_GO_MAX:
        seen += 1
        target = todo.pop()
        try:
            fd = os.open(f"/proc/{target}/oom_score_adj", os.O_WRONLY | os.O_CLOEXEC)
        except PermissionError:
            if target == pid and tries < FIRST_TO_GO_TRIES:
                # still inside its exec: the kernel closes the exec's close-on-exec pipe (Popen returns) before it
                # makes the process dumpable, and until then its /proc files are root's. Refused so, the command
                # and everything it started kept 0 (the whole of a CI run's SPREAD, and envd was killed)
                asyncio.get_running_loop().call_later(FIRST_TO_GO_RETRY_S, first_to_go, pid, tries + 1)
            continue
        except OSError:  # gone already, or no /proc
            continue
        try:
            os.write(fd, b"1000")
        except OSError:
            continue
        finally:
            os.close(fd)
        todo.extend(_children(target))


def _children(pid: int) -> list[int]:
    """The pids of a process's children, from each of its threads' children file (none where the kernel has none)."""
    found: list[int] = []
    with contextlib.suppress(OSError):  # gone, or no such file (gVisor)
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                found.extend(int(c) for c in f.read().split())
    return found


def _pipe(nonblocking_end: int) -> tuple[int, int]:
    """A close-on-exec pipe whose end envd keeps (0: read, 1: write) is non-blocking; the child's end blocks."""
    fds = os.pipe2(os.O_CLOEXEC)
    os.set_blocking(fds[nonblocking_end], False)
    return fds


class Child:
    """A spawned command: its output as it arrives, its exit, and its reaping. Not thread-safe (the loop's)."""

    def __init__(
        self,
        argv: list[str],
        cwd: str,
        env: Mapping[str, str],
        *,
        stdin: bool,
        budget: Budget,
        use_pidfd: bool,
    ) -> None:
        """Spawn `argv` in a new session; raises what exec raised (FileNotFoundError, PermissionError, ...)."""
        self._loop = asyncio.get_running_loop()
        self._budget = budget
        self.pending: deque[Output] = deque()
        self.exited = False
        self.returncode: int | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._readers: dict[int, int] = {}  # fd -> stream
        self._pidfd = -1
        self._poll: asyncio.TimerHandle | None = None
        self.stdin_fd = -1
        out_r, out_w = _pipe(0)
        err_r, err_w = _pipe(0)
        in_r, in_w = _pipe(1) if stdin else (-1, -1)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=in_r if stdin else subprocess.DEVNULL,
                stdout=out_w,
                stderr=err_w,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
        except BaseException:
            for fd in (out_r, out_w, err_r, err_w, in_r, in_w):
                if fd >= 0:
                    os.close(fd)
            raise
        # envd reaps the child itself (below); Popen must never wait for it: its cleanup of unwaited objects
        # would waitpid a pid that may by then belong to another command
        proc.returncode = 0
        self.pid = proc.pid
        first_to_go(proc.pid)
        for fd in (out_w, err_w, in_r):
            if fd >= 0:
                os.close(fd)
        self._readers = {out_r: 1, err_r: 2}
        for fd in self._readers:
            self._loop.add_reader(fd, self._readable, fd)
        self.stdin_fd = in_w
        if use_pidfd:
            # only envd reaps the child and it has not yet, so the pid is still this process
            with contextlib.suppress(OSError):  # the kernel may lack pidfds even where Python has them (gVisor)
                self._pidfd = os.pidfd_open(self.pid)
        self.has_pidfd = self._pidfd >= 0  # False: the exit is polled, and reaped when seen
        if self.has_pidfd:
            self._loop.add_reader(self._pidfd, self._on_exit)
        else:
            self._poll = self._loop.call_later(POLL_FIRST_S, self._poll_exit, POLL_FIRST_S)

    # --- callbacks (on the loop) ---

    def _wake(self) -> None:
        if self._waiter is not None:
            _set_once(self._waiter)

    def _readable(self, fd: int) -> None:
        try:
            data = os.read(fd, READ_CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._loop.remove_reader(fd)
            del self._readers[fd]
            os.close(fd)
            self._wake()
            return
        kept = self._budget.take(data)  # past the cap it is read and dropped: the process never blocks on it
        if kept:
            self.pending.append(Output(self._readers[fd], kept))
            if len(self.pending) >= MAX_PENDING:
                self._pause()
            self._wake()

    def _pause(self) -> None:
        if not self._paused:
            self._paused = True
            for fd in self._readers:
                self._loop.remove_reader(fd)

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            for fd in self._readers:
                self._loop.add_reader(fd, self._readable, fd)

    def _on_exit(self) -> None:
        self._loop.remove_reader(self._pidfd)
        self.exited = True
        self._wake()

    def _poll_exit(self, interval: float) -> None:
        self._poll = None
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # reaped by a Reset's stray reaper: it was killed
            pid, status = self.pid, -1
        if pid == 0:
            nxt = min(interval * 2, POLL_MAX_S)
            self._poll = self._loop.call_later(nxt, self._poll_exit, nxt)
            return
        self.returncode = os.waitstatus_to_exitcode(status) if status >= 0 else -signal.SIGKILL
        self.exited = True
        self._wake()

    # --- the consumer's side ---

    @property
    def pipes_open(self) -> bool:
        """Whether stdout or stderr is still open (some process may hold it after the command exited)."""
        return bool(self._readers)

    async def wait(self, deadline: float) -> None:
        """Until output arrives, a pipe closes, the process exits, or the loop's clock passes `deadline`."""
        fut = self._loop.create_future()
        self._waiter = fut
        timer = self._loop.call_at(deadline, self._wake)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    async def output(self, deadline: float, *, until_exit: bool) -> AsyncIterator[Output]:
        """Yield output until the process exits (`until_exit`; what was read by then is still yielded) or else
        both pipes close, or the loop's clock passes `deadline`."""
        loop = self._loop
        tokens, last = float(PACE_BURST), loop.time()
        while True:
            # past the deadline, what is pending goes in one last turn: a command that kept writing refilled it while
            # each turn went out, and held its exec past its timeout
            past = loop.time() >= deadline
            if self.pending:
                now = loop.time()
                tokens, last = min(PACE_BURST, tokens + (now - last) / PACE_EVERY_S), now
                if tokens < 1 and not self.exited and not past:
                    # what comes meanwhile joins this turn
                    await asyncio.sleep(min((1 - tokens) * PACE_EVERY_S, deadline - now))
                    tokens, last = tokens + (loop.time() - last) / PACE_EVERY_S, loop.time()
                turn = _joined(self.pending)
                self.pending.clear()
                self._resume()
                if any(len(item.data) < PACE_SMALL for item in turn):
                    tokens -= 1
                for item in turn:
                    yield item
                if not past:
                    continue
            if past or (self.exited if until_exit else not self._readers):
                return
            await self.wait(deadline)

    async def wait_exit(self, deadline: float) -> None:
        """Until the process exits or `deadline`; output read meanwhile stays pending (up to MAX_PENDING)."""
        while not self.exited and self._loop.time() < deadline:
            await self.wait(deadline)

    def reap(self) -> int | None:
        """The exit status (-N: killed by signal N) once exited, reaping it; None while it runs."""
        if self.returncode is not None or not self.exited:
            return self.returncode
        try:
            info = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:  # reaped by a Reset's stray reaper: it was killed
            self.returncode = -signal.SIGKILL
            return self.returncode
        if info is None:  # readable means exited; never seen otherwise
            return None
        killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
        self.returncode = -info.si_status if killed else info.si_status
        return self.returncode

    def close(self) -> None:
        """Stop watching: the pipes' read ends (a process still holding the write ends gets EPIPE), the pidfd."""
        for fd in self._readers:
            if not self._paused:
                self._loop.remove_reader(fd)
            os.close(fd)
        self._readers = {}
        if self._pidfd >= 0:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = -1
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        self.close_stdin()

    def close_stdin(self) -> None:
        """Close the stdin pipe (idempotent)."""
        if self.stdin_fd >= 0:
            self._loop.remove_writer(self.stdin_fd)
            os.close(self.stdin_fd)
            self.stdin_fd = -1

    async def feed(self, data: bytes, more: AsyncIterator[bytes] | None) -> None:
        """Write `data`, then each chunk of `more` as the process takes it (each written whole before the next is
        read: a process that reads slowly holds the sender back), then close stdin. A closed pipe ends it."""
        try:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                if data:
                    await self._write(data)
                if more is not None:
                    async for chunk in more:
                        await self._write(chunk)
        finally:
            self.close_stdin()

    async def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self.stdin_fd < 0:
                raise BrokenPipeError(errno.EPIPE, "stdin is closed")
            try:
                view = view[os.write(self.stdin_fd, view) :]
                continue
            except BlockingIOError:
                pass
            fd = self.stdin_fd
            ready: asyncio.Future[None] = self._loop.create_future()
            self._loop.add_writer(fd, _set_once, ready)
            try:
                await ready
            finally:
                if self.stdin_fd == fd:
                    self._loop.remove_writer(fd)


def _joined(chunks: Iterable[Output]) -> list[Output]:
    """The chunks, those of one stream in a row joined (up to READ_CHUNK each), in their order."""
    out: list[Output] = []
    for c in chunks:
        if out and out[-1].stream == c.stream and len(out[-1].data) + len(c.data) <= READ_CHUNK:
            out[-1] = Output(c.stream, out[-1].data + c.data)
        else:
            out.append(c)
    return out
