"""Local worker processes: one per core by default, started by the control plane and restarted when one exits
unexpectedly. Each is `python -m orchestrator.worker`, with the worker token on its standard input."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable

from orchestrator.worker.config import WorkerConfig

log = logging.getLogger(__name__)

RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
RESTART_RESET_S = 10.0  # a worker that ran this long before it exited is started again after RESTART_MIN_S
STOP_GRACE_S = 60.0
# a worker the hub cut off for its silence (stopped, hung) that has not joined again this long after is killed: the
# supervisor starts it again, and the new process sweeps the sandboxes the silent one held (they waited out their
# lease, an hour at least, while it lived)
LOST_KILL_S = 60.0


class LocalWorkers:
    """N worker processes of this host, supervised: a crashed or killed one is started again."""

    def __init__(self, n: int, target: str, token: str, config: WorkerConfig, *, verbose: int = 0) -> None:
        self.n = n
        self._target = target
        self._token = token
        self.config = config
        self._verbose = verbose
        self._procs: dict[int, asyncio.subprocess.Process] = {}
        self._supervisors: list[asyncio.Task[None]] = []
        self._stopping = False
        self._silence_kills: set[asyncio.Task[None]] = set()
        self.restarts = 0
        self.lost_kill_s = LOST_KILL_S

    @property
    def pids(self) -> list[int]:
        """The pids of the worker processes running now."""
        return [p.pid for p in self._procs.values() if p.returncode is None]

    def lost(self, pid: int, rejoined: Callable[[int], bool]) -> None:
        """The hub cut worker `pid` off: kill it unless it has `rejoined` within `lost_kill_s` (a stopped worker,
        resumed, finds its stream gone, drops its rollouts and sandboxes, and joins again)."""
        if pid in self.pids and not self._stopping:
            task = asyncio.create_task(self._kill_unless_rejoined(pid, rejoined), name=f"kill silent worker {pid}")
            self._silence_kills.add(task)
            task.add_done_callback(self._silence_kills.discard)

    async def _kill_unless_rejoined(self, pid: int, rejoined: Callable[[int], bool]) -> None:
        await asyncio.sleep(self.lost_kill_s)
        if pid in self.pids and not rejoined(pid) and not self._stopping:
            log.error("worker pid %d has been silent since it was cut off %gs ago; killing it", pid, self.lost_kill_s)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def start(self) -> None:
        """Start every worker, each under its own supervisor."""
        for i in range(self.n):
            self._supervisors.append(asyncio.create_task(self._supervise(i), name=f"worker {i} supervisor"))

    async def _spawn(self, index: int) -> asyncio.subprocess.Process:
        # `-m` puts the current folder first on sys.path, as serve's plug-ins (`--environments module:Class` of the
        # folder serve runs in) need
        argv = [sys.executable, "-m", "orchestrator.worker", "--connect", self._target, "--name", f"w{index}"]
        argv += ["--parent-pid", str(os.getpid())]
        argv += ["--config", self.config.model_dump_json()] + ["-v"] * self._verbose
        # a session of its own: a terminal's Ctrl-C reaches its whole foreground group, and the workers in serve's
        # stopped on it while their supervisors, serve not stopping them yet, started each again; serve stops them
        # (and PDEATHSIG ends them with serve)
        proc = self._procs[index] = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, start_new_session=True
        )
        assert proc.stdin is not None
        proc.stdin.write(self._token.encode() + b"\n")
        await proc.stdin.drain()
        proc.stdin.close()
        return proc

    async def _supervise(self, index: int) -> None:
        delay = RESTART_MIN_S
        while not self._stopping:
            started = asyncio.get_running_loop().time()
            try:
                proc = await self._spawn(index)
            except OSError as e:  # no process (fds, memory, the interpreter gone): the slot is tried again, not lost
                log.error("worker %d could not be started (%s); trying again in %gs", index, e, delay)
            else:
                code = await proc.wait()
                if self._stopping:
                    return
                self.restarts += 1
                if asyncio.get_running_loop().time() - started >= RESTART_RESET_S:
                    delay = RESTART_MIN_S  # it ran a while: this exit is not one of a crash loop's
                log.warning("worker %d (pid %d) exited with %s; starting it again in %gs", index, proc.pid, code, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_MAX_S)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every worker (they destroy their sandboxes), SIGKILL those still running after `grace_s`."""
        self._stopping = True
        await self._stop_procs([p for p in self._procs.values() if p.returncode is None], grace_s)
        for task in [*self._supervisors, *self._silence_kills]:
            task.cancel()
        await asyncio.gather(*self._supervisors, *self._silence_kills, return_exceptions=True)
        # one a supervisor started while the others were being stopped
        await self._stop_procs([p for p in self._procs.values() if p.returncode is None], grace_s)

    @staticmethod
    async def _stop_procs(procs: list[asyncio.subprocess.Process], grace_s: float) -> None:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            log.error("workers did not stop within %gs; killing them (the sweep removes their sandboxes)", grace_s)
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
            await asyncio.gather(*(p.wait() for p in procs))
