"""Event-loop stalls, reported where they happen: a process whose loop does not turn for a while says so in its
log, with what its loop thread was doing. A blocking call shows in the stack; a loop starved of CPU (its host
overloaded) shows an idle select that came back late, or ordinary work that could not run sooner.

A ticker task stamps the time every TICK_S; a daemon thread looks every CHECK_S. Cost: ten loop wake-ups a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

TICK_S = 0.1
CHECK_S = 0.5


class StallWatch:
    """Log a warning (once per stall) when the running loop has not turned for `threshold_s`."""

    def __init__(self, name: str, threshold_s: float = 2.0) -> None:
        self.name = name
        self.threshold_s = threshold_s
        self.stalls = 0  # stalls seen so far
        self.longest_s = 0.0
        self._beat = time.monotonic()
        self._ticker: asyncio.Task[None] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop_thread = 0

    def start(self) -> None:
        """Start watching the running loop (call from inside it)."""
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="stall-watch")
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop the ticker and the watching thread."""
        self._stop.set()
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 2 * CHECK_S)

    async def _tick(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(TICK_S)

    def _watch(self) -> None:
        in_stall = False
        while not self._stop.wait(CHECK_S):
            stale = time.monotonic() - self._beat
            if stale < self.threshold_s:
                if in_stall:
                    log.warning("%s: its event loop turns again", self.name)
                in_stall = False
                continue
            self.longest_s = max(self.longest_s, stale)
            if in_stall:
                continue
            in_stall = True
            self.stalls += 1
            frame = sys._current_frames().get(self._loop_thread)
            where = "".join(traceback.format_stack(frame, limit=8)) if frame is not None else "(no frame)\n"
            log.warning("%s: its event loop has not turned for %.1fs; its thread is at:\n%s", self.name, stale, where)
