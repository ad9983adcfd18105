"""Execs a few at a time: a burst of process starts runs in turn instead of all at once.

Hundreds of rollouts that started together ask for their execs together. Started at once, the processes share the
cores and each ends when nearly all have, so every rollout waits the whole burst out; admitted a few at a time, the
burst takes the same CPU and a rollout waits on average half of it (and the policy calls of the rollouts already
served get the cores in between).

An exec holds its place until it ends or until it has run HOLD_FACTOR times as long as execs here take (a moving
average), whichever comes first, between HOLD_MIN_S and `max_hold_s`. A long command (a test suite, a sleep) never
holds the others back longer than that; and on a slower host, where every exec takes longer, the hold grows with
them, so the places do not cap the host's rate of process starts below what its cores make (a fixed 50 ms did: 8
places allow 160 starts a second, fewer than a loaded 2-core host makes). The price: where most execs are long
commands, the hold grows to `max_hold_s`, and a burst of them starts `slots` per `max_hold_s`.

Turns go round the tenants waiting (first come first served within each): a place that frees goes to the next tenant
in the round, not to the oldest exec. A tenant whose rollouts queue hundreds of long commands (each holding its place
`max_hold_s`) would otherwise put a neighbour's `echo` behind all of them, seconds of wait a rollout; in turn, the
neighbour waits, beside the execs holding the places, at most one exec of each other tenant waiting.

A streamed exec (a raw sandbox's ExecStream) takes its turn the same way, and holds its place until its stream ends or
its hold is up; not admitted, streams would let a tenant start its processes all at once while everyone else's took
turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

HOLD_MIN_S = 0.02
HOLD_FACTOR = 4.0
AVERAGE_WEIGHT = 0.1  # of each exec's time in the moving average


class ExecAdmission:
    """At most `slots` execs starting at once; each holds its place at most `max_hold_s`."""

    def __init__(self, slots: int, max_hold_s: float) -> None:
        self.max_hold_s = max_hold_s
        self.typical_s = HOLD_MIN_S / HOLD_FACTOR
        self._free = slots
        # per tenant, its execs waiting in order; the dict's order is the round (a tenant served goes to its end)
        self._waiting: dict[str, deque[asyncio.Future[None]]] = {}

    @property
    def hold_s(self) -> float:
        """How long the next exec may hold its place."""
        return min(self.max_hold_s, max(HOLD_MIN_S, HOLD_FACTOR * self.typical_s))

    async def run(self, start: Callable[[], Awaitable[T]], tenant: str = "") -> T:
        """Await what `start()` makes once admitted, in `tenant`'s turn (a caller cancelled while it waits made
        nothing)."""
        async with self.place(tenant) as hold:
            t0 = time.monotonic()
            try:
                return await start()
            finally:
                # every exec counts, a long one as twice the hold it had: a host that slows down moves the average
                # up within a few dozen execs, and one long command moves it little
                took = min(time.monotonic() - t0, 2 * hold)
                self.typical_s += AVERAGE_WEIGHT * (took - self.typical_s)

    @contextlib.asynccontextmanager
    async def place(self, tenant: str = "") -> AsyncIterator[float]:
        """Hold a place, once admitted in `tenant`'s turn, while the body runs and at most the hold it yields. A
        streamed exec holds its place so; its length does not move the average (a stream lasts as long as its
        reader wants)."""
        await self._acquire(tenant)
        hold, held = self.hold_s, True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self._release()

        timer = asyncio.get_running_loop().call_later(hold, release)
        try:
            yield hold
        finally:
            timer.cancel()
            release()

    async def _acquire(self, tenant: str) -> None:
        if self._free and not self._waiting:
            self._free -= 1
            return
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._release()  # the place came with the cancellation: hand it on
            else:
                queue = self._waiting.get(tenant)
                if queue is not None and turn in queue:
                    queue.remove(turn)
                    if not queue:
                        del self._waiting[tenant]
            raise

    def _release(self) -> None:
        """Give the place to the next tenant in the round, or free it."""
        while self._waiting:
            tenant = next(iter(self._waiting))
            queue = self._waiting.pop(tenant)
            turn = queue.popleft()
            if queue:
                self._waiting[tenant] = queue  # to the end of the round
            if not turn.done():
                turn.set_result(None)
                return
        self._free += 1
