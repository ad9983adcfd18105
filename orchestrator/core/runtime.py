"""The Python runtime of a long-lived envfleet process (the control plane, a rollout worker).

The cyclic garbage collector's default thresholds (a young collection every 700 net allocations of tracked objects)
suit short scripts. A process that makes tasks, futures and messages for every rollout crosses 700 several times
a rollout: on the fleet bench the collections' walks took a quarter of the control plane's CPU, and a worker's CPU
per rollout fell by a quarter once tuned. `tune_gc` freezes what start-up made (modules, config, servers: never
garbage, so never walked again) and collects the young generation every 50,000 allocations instead; what is garbage
is still collected, a little later. Measured side by side with bench/fleet_bench.py (README, "Many cores and many
hosts").
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")

GC_THRESHOLDS = (50_000, 20, 20)


async def run_to_end(work: Awaitable[T]) -> T:
    """`work`'s result; run to its end even when the caller is cancelled meanwhile (the caller gets its cancel at
    once, the work goes on), its outcome, a failure too, then marked seen (never logged as not retrieved)."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(_seen)
    return await asyncio.shield(task)


async def to_the_end(task: asyncio.Future[T]) -> T:
    """Await `task` to its end even if the caller is cancelled meanwhile, once or again and again: a cleanup cut
    short leaks what it was removing. The caller's cancel is raised once the task is done."""
    cancel: asyncio.CancelledError | None = None
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError as e:
            cancel = e
    if cancel is not None:
        _seen(task)  # its own failure goes with the cancel: not logged as never retrieved at collection
        raise cancel
    return task.result()


def _seen(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def tune_gc() -> None:
    """Freeze the objects made so far and raise the collector's thresholds; call once start-up is done."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# glibc's M_ARENA_MAX (malloc.h). Each thread that allocates gets an arena of its own, up to 8 per core, and memory
# freed into one is not reused by the others: gRPC's threads passing 1 MiB messages through grew a server's peak RSS
# by 104 to 678 MiB over the same 800 MiB of streamed stdin (tests/security/test_buffers.py, 11 runs, 2 of them past
# its 400 MiB bound), by 103-321 MiB in 8 runs with two arenas set here (120-233 with MALLOC_ARENA_MAX=2).
M_ARENA_MAX = -8
MALLOC_ARENAS = 2


def limit_malloc_arenas() -> None:
    """Cap glibc's malloc arenas for the threads this process starts from now on (a no-op off glibc)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_ARENA_MAX, MALLOC_ARENAS)
