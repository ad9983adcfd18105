"""The engine call limiter on its own, with plain coroutines standing in for engine calls."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from orchestrator.backends.docker.call_limiter import FIRST_BACKOFF_S, CallLimiter

FAST, SLOW = 0.01, 2.0


def limiter(
    max_limit: int = 16, rate_per_s: float = 10_000, burst: int = 10_000, max_backoff_s: float = 5.0
) -> CallLimiter:
    return CallLimiter(
        max_limit=max_limit,
        rate_per_s=rate_per_s,
        burst=burst,
        slow_factor=3.0,
        slow_min_s=0.5,
        max_backoff_s=max_backoff_s,
    )


async def one_call(
    lim: CallLimiter, latency_s: float | None, kind: str = "create", *, overloaded: bool = False
) -> None:
    permit = await lim.acquire(kind)
    lim.release(permit, latency_s, overloaded=overloaded)


async def until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    """Wait until the limiter's state says so."""
    async with asyncio.timeout(timeout_s):
        while not condition():  # noqa: ASYNC110 - the limiter's counters have no event to wait on
            await asyncio.sleep(0.001)


async def test_permits_never_exceed_the_limit_even_while_it_shrinks() -> None:
    lim = limiter(max_limit=4, max_backoff_s=0)
    over: list[tuple[int, int]] = []
    rng = random.Random(7)

    async def worker(i: int) -> None:
        permit = await lim.acquire("create")
        if lim.in_flight > lim.permits:
            over.append((lim.in_flight, lim.permits))
        await asyncio.sleep(rng.random() / 100)
        # every fifth call finds the engine silent, which cuts the limit while others are in flight
        lim.release(permit, FAST, overloaded=i % 5 == 0)

    await asyncio.gather(*(worker(i) for i in range(60)))
    assert over == []
    assert lim.peak_in_flight == 4 and lim.waited_for_limit > 0
    assert lim.decreases > 0
    assert (lim.in_flight, lim.waiting) == (0, 0)


async def test_slow_calls_cut_the_limit_once_per_round_and_fast_calls_grow_it_back() -> None:
    lim = limiter(max_limit=16)
    for _ in range(5):
        await one_call(lim, FAST)
    assert lim.limit == 16

    # a whole round of calls that started together comes back slow: one cut, not eight
    permits = [await lim.acquire("create") for _ in range(8)]
    for p in permits:
        lim.release(p, SLOW)
    assert (lim.limit, lim.decreases) == (8, 1)
    # a call that started after the cut and is still slow cuts again
    await one_call(lim, SLOW)
    assert (lim.limit, lim.decreases) == (4, 2)

    growth = [lim.limit]
    while lim.limit < 16 and len(growth) < 1000:
        await one_call(lim, FAST)
        growth.append(lim.limit)
    assert lim.limit == 16 and growth == sorted(growth)
    assert 12 < len(growth) < 200, "additive increase: about one permit per round of calls"
    assert lim.decreases == 2


async def test_what_counts_as_slow() -> None:
    lim = limiter()
    # the first call of a kind only sets what is usual for it
    await one_call(lim, SLOW, kind="remove")
    # another kind is judged against its own history
    await one_call(lim, FAST, kind="inspect")
    await one_call(lim, 0.3, kind="inspect")  # thirty times the usual, but quick: jitter, not a stall
    await one_call(lim, SLOW, kind="remove")
    assert lim.decreases == 0
    await one_call(lim, 5 * SLOW, kind="remove")
    assert lim.decreases == 1
    assert set(lim.typical_latency_s) == {"remove", "inspect"}


async def test_engine_failures_cut_the_limit_and_hold_new_calls_back_longer_each_time() -> None:
    lim = limiter(max_limit=16)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    for _ in range(5):
        await one_call(lim, None, overloaded=True)
    # the limit halves each time, down to one; the four later calls each waited out the pause before them
    assert (lim.limit, lim.decreases, lim.waited_for_backoff) == (1, 5, 4)
    assert loop.time() - t0 >= 0.9 * FIRST_BACKOFF_S * (1 + 2 + 4 + 8)
    t1 = loop.time()
    await one_call(lim, FAST)
    assert loop.time() - t1 >= 0.9 * FIRST_BACKOFF_S * 16
    # an answer resets the pause and lets the limit grow
    assert lim.limit > 1 and lim.waited_for_backoff == 5
    await one_call(lim, None, overloaded=True)
    t2 = loop.time()
    await one_call(lim, FAST)
    assert lim.waited_for_backoff == 6
    assert loop.time() - t2 >= 0.9 * FIRST_BACKOFF_S


async def test_rate_limit_spaces_calls() -> None:
    rate, burst, n = 20.0, 3, 12
    lim = limiter(rate_per_s=rate, burst=burst)
    loop = asyncio.get_running_loop()
    # a full bucket lets a burst start at once
    for _ in range(burst):
        await one_call(lim, FAST)
    assert lim.waited_for_rate == 0
    started: list[float] = []

    async def call() -> None:
        permit = await lim.acquire("inspect")
        started.append(loop.time())
        lim.release(permit, FAST)

    t0 = loop.time()
    await asyncio.gather(*(call() for _ in range(n)))
    # the bucket holds no more than it refilled since t0 (a stalled host can only add waiting, never remove it)
    assert started[-1] - t0 >= 0.95 * (n - burst) / rate
    assert lim.waited_for_rate >= 1


async def test_a_cancelled_waiter_holds_nothing() -> None:
    lim = limiter(max_limit=1)
    holder = await lim.acquire("create")
    got: list[str] = []

    async def waiter(name: str) -> None:
        permit = await lim.acquire("create")
        got.append(name)
        await asyncio.sleep(0.01)
        lim.release(permit, FAST)

    tasks = {name: asyncio.create_task(waiter(name)) for name in ("head", "middle", "tail")}
    await until(lambda: lim.waiting == 3)
    # the head holds the queue's turn while it waits for room; a middle one waits for its turn
    tasks["head"].cancel()
    tasks["middle"].cancel()
    for name in ("head", "middle"):
        with pytest.raises(asyncio.CancelledError):
            await tasks[name]
    assert (lim.waiting, lim.in_flight) == (1, 1)
    lim.release(holder, FAST)
    await tasks["tail"]
    assert got == ["tail"]
    assert (lim.waiting, lim.in_flight) == (0, 0)


async def test_a_caller_cancelled_while_waiting_for_the_rate_holds_nothing() -> None:
    lim = limiter(rate_per_s=0.5, burst=1)
    await one_call(lim, FAST)
    task = asyncio.create_task(one_call(lim, FAST))
    await until(lambda: lim.waiting == 1)
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert (lim.waiting, lim.in_flight, lim.peak_in_flight) == (0, 0, 1)


async def test_a_permit_goes_back_once() -> None:
    lim = limiter()
    permit = await lim.acquire("start")
    lim.release(permit, None)
    with pytest.raises(RuntimeError, match="start released twice"):
        lim.release(permit, FAST)
    assert lim.in_flight == 0


async def test_an_engine_slow_for_good_is_learnt_at_one_call_in_flight() -> None:
    # a slow call moved its kind's usual latency 1% a call: an engine gone from 30 ms to 3 s a call held the limit at
    # one for some 70 calls of each kind, and 64 creates in lockstep made no sandbox for over five minutes
    lim = limiter()
    for _ in range(20):
        await one_call(lim, 0.03)
    for _ in range(30):
        await one_call(lim, 3.0)
    assert lim.permits >= 4 and lim.typical_latency_s["create"] > 1.0


async def test_one_stall_is_not_learnt_as_the_engines_pace() -> None:
    # slow calls are learnt fast only several in a row, each alone in flight when it started: learnt at 10% because
    # the limit was at one when it ended, one 60 s hang took the usual time from 0.03 s to 6 s, and a 5 s stall after
    # it went unseen; two stalls side by side at a limit of two were learnt so too
    lim = limiter()
    for _ in range(20):
        await one_call(lim, 0.03)
    lim.limit = 1.0
    await one_call(lim, 60.0)
    assert lim.typical_latency_s["create"] < 1.0
    cuts = lim.decreases
    await one_call(lim, 5.0)
    assert lim.decreases == cuts + 1
    lim = limiter()
    for _ in range(20):
        await one_call(lim, 0.03)
    lim.limit = 2.0
    first, second = await lim.acquire("create"), await lim.acquire("create")
    lim.release(first, 60.0)
    lim.release(second, 60.0)
    assert lim.typical_latency_s["create"] < 1.5
