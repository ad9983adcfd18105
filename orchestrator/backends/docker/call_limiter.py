"""How many engine calls may start, and how fast: a token-bucket rate and an adaptive (AIMD) concurrency limit.

The limit starts fully open. A call that fails because the engine did not answer, or that took far longer than calls
of its kind usually take, halves it and new calls wait for room; after a call the engine did not answer, new calls
also pause (50 ms, doubling while failures go on, up to a ceiling). Every call that comes back in normal time raises
the limit by 1/limit (about one per round of calls), up to the ceiling. Only calls that started after the last cut can
cut again, so one stall that slows a whole round of calls halves the limit once, not once per call.

Callers must be on the event loop that first uses the limiter; `release` is not thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

log = logging.getLogger(__name__)

# how much one signal of overload cuts the limit
DECREASE_FACTOR = 0.5
# weight of a new latency in the running average of its kind: about the last ten calls count
LATENCY_EWMA_ALPHA = 0.1
# a slow call moves that average only a little, so a stall is seen as one for a while, yet a lasting change of pace
# becomes the new usual after some tens of calls instead of pinning the limit at one
SLOW_LATENCY_EWMA_ALPHA = 0.01
# the first pause after a call the engine did not answer; it doubles while they go on failing
FIRST_BACKOFF_S = 0.05
SLOW_ALONE_TO_LEARN = 3  # slow calls in a row, each alone in flight, that are learnt as the engine's pace


@dataclass(eq=False)
class Permit:
    """Leave to run one call; give it back with `CallLimiter.release` exactly once."""

    kind: str
    epoch: int
    alone: bool = False  # no other call was in flight, nor could start: its time is the engine's pace alone
    released: bool = False


class CallLimiter:
    """Admits calls in arrival order, under a rate limit and a concurrency limit that shrinks when calls slow down
    or fail and grows back when they are fast again."""

    def __init__(
        self,
        *,
        max_limit: int,
        rate_per_s: float,
        burst: int,
        slow_factor: float,
        slow_min_s: float,
        max_backoff_s: float,
    ) -> None:
        if max_limit < 1 or rate_per_s <= 0 or burst < 1:
            raise ValueError("max_limit and burst must be at least 1 and rate_per_s positive")
        self.max_limit = max_limit
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.slow_factor = slow_factor
        self.slow_min_s = slow_min_s
        self.max_backoff_s = max_backoff_s
        # what a status page or metrics can read
        self.limit: float = float(max_limit)
        self.in_flight = 0
        self.peak_in_flight = 0
        self.waiting = 0
        self.waited_for_limit = 0
        self.waited_for_rate = 0
        self.waited_for_backoff = 0
        self.decreases = 0
        self.typical_latency_s: dict[str, float] = {}
        self._tokens = float(burst)
        self._refilled_at: float | None = None
        self._hold_until = 0.0
        self._failures_in_a_row = 0
        self._slow_alone: dict[str, int] = {}  # per kind of call: slow calls in a row that ran alone
        self._epoch = 0
        self._turn = asyncio.Lock()  # the head of the queue waits here for room; asyncio.Lock is FIFO
        self._room = asyncio.Event()

    @property
    def permits(self) -> int:
        """How many calls may be in flight now."""
        return max(1, math.floor(self.limit))

    async def acquire(self, kind: str) -> Permit:
        """Wait for room, a rate token and the end of any backoff. A caller cancelled while waiting holds nothing."""
        self.waiting += 1
        try:
            async with self._turn:
                waited = set()
                while True:
                    if self.in_flight >= self.permits:
                        waited.add("limit")
                        self._room.clear()
                        await self._room.wait()
                        continue
                    now = asyncio.get_running_loop().time()
                    backoff = self._hold_until - now
                    token_wait = self._token_wait(now)
                    if backoff <= 0 and token_wait <= 0:
                        break
                    waited.add("backoff" if backoff > token_wait else "rate")
                    await asyncio.sleep(max(backoff, token_wait))
                self._tokens -= 1
                self.in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
                self.waited_for_limit += "limit" in waited
                self.waited_for_rate += "rate" in waited
                self.waited_for_backoff += "backoff" in waited
                return Permit(kind, self._epoch, alone=self.in_flight == 1 and self.permits == 1)
        finally:
            self.waiting -= 1

    def release(self, permit: Permit, latency_s: float | None, *, overloaded: bool = False) -> None:
        """Give a permit back, saying how long its call took (None: it never ran) and whether it failed because
        the engine did not answer (timeout, refused connection)."""
        if permit.released:
            raise RuntimeError(f"permit for {permit.kind} released twice")
        permit.released = True
        self.in_flight -= 1
        if overloaded:
            self._failures_in_a_row += 1
            pause = min(self.max_backoff_s, FIRST_BACKOFF_S * 2 ** (self._failures_in_a_row - 1))
            self._hold_until = max(self._hold_until, asyncio.get_running_loop().time() + pause)
            self._decrease(permit, f"{permit.kind} got no answer from the engine; new calls wait {pause:g}s")
        elif latency_s is not None:
            self._failures_in_a_row = 0
            typical = self.typical_latency_s.get(permit.kind)
            if typical is None:  # the first call of its kind only tells what is usual
                typical = latency_s
            if latency_s > max(self.slow_min_s, self.slow_factor * typical):
                # slow calls that ran alone, several in a row, are the engine's pace, not our load: learnt as fast as
                # any other (at 1% a call, an engine gone from 30 ms to 3 s a call kept the limit at one for some 70
                # calls of each kind, and 64 creates in lockstep made no sandbox for over five minutes); one stall
                # alone is not, or the next would go unseen
                streak = self._slow_alone[permit.kind] = self._slow_alone.get(permit.kind, 0) + 1 if permit.alone else 0
                self._decrease(permit, f"{permit.kind} took {latency_s:.2f}s (usually {typical:.2f}s)")
                alpha = LATENCY_EWMA_ALPHA if streak >= SLOW_ALONE_TO_LEARN else SLOW_LATENCY_EWMA_ALPHA
                self.typical_latency_s[permit.kind] = typical + alpha * (latency_s - typical)
            else:
                self._slow_alone.pop(permit.kind, None)
                self.limit = min(float(self.max_limit), self.limit + 1 / self.limit)
                self.typical_latency_s[permit.kind] = typical + LATENCY_EWMA_ALPHA * (latency_s - typical)
        self._room.set()

    def _decrease(self, permit: Permit, why: str) -> None:
        if permit.epoch != self._epoch:
            return  # it started before the last cut, which already answered what it tells
        self._epoch += 1
        self.decreases += 1
        self.limit = max(1.0, self.limit * DECREASE_FACTOR)
        log.info("%s: at most %d engine call(s) in flight now", why, self.permits)

    def _token_wait(self, now: float) -> float:
        """Refill the bucket; seconds until it holds a whole token."""
        if self._refilled_at is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._refilled_at) * self.rate_per_s)
        self._refilled_at = now
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) / self.rate_per_s
