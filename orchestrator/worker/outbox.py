"""What one side of the worker wire has to send, handed out in batches: gRPC's work per message, not per byte,
dominates the wire's cost, so results and assignments that are ready together travel together.

Idle, a message goes out at once. Busy (the last batch left less than `linger_s` ago), the sender waits up to
`linger_s` for a batch to fill, so that a steady flow becomes few large messages at a latency cost of at most
`linger_s`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
M = TypeVar("M")

LINGER_S = 0.002
MAX_BATCH = 256


class Outbox(Generic[T]):
    """A FIFO of items to send, read a batch at a time by one sender; `close()` ends it."""

    def __init__(self, *, linger_s: float = LINGER_S, max_batch: int = MAX_BATCH) -> None:
        self.linger_s = linger_s
        self.max_batch = max_batch
        self._items: collections.deque[T] = collections.deque()
        self._ready = asyncio.Event()  # something to send
        self._full = asyncio.Event()  # a whole batch to send
        self._closed = False
        self._last_batch = float("-inf")

    def put(self, item: T) -> None:
        """Queue one item (never blocks: what is queued is bounded by the rollouts in flight)."""
        self._items.append(item)
        self._ready.set()
        if len(self._items) >= self.max_batch:
            self._full.set()

    def close(self) -> None:
        """End the outbox: `get` returns what is left, then an empty batch."""
        self._closed = True
        self._ready.set()
        self._full.set()

    def __len__(self) -> int:
        return len(self._items)

    async def get(self) -> list[T]:
        """The next batch, in order, at most `max_batch` items; empty once closed and drained."""
        while not self._items and not self._closed:
            self._ready.clear()
            await self._ready.wait()
        busy = time.monotonic() - self._last_batch < self.linger_s
        if busy and not self._closed and len(self._items) < self.max_batch:
            self._full.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.linger_s):
                    await self._full.wait()
        n = min(len(self._items), self.max_batch)
        batch = [self._items.popleft() for _ in range(n)]
        if not self._items:
            self._ready.clear()
        self._last_batch = time.monotonic()
        return batch


def by_size(items: list[T], size: Callable[[T], int], max_bytes: int) -> Iterator[list[T]]:
    """`items` cut into runs of at most `max_bytes` in all (a larger item alone), so that a batch of large rollouts
    stays under the wire's message cap."""
    run: list[T] = []
    total = 0
    for item in items:
        n = size(item)
        if run and total + n > max_bytes:
            yield run
            run, total = [], 0
        run.append(item)
        total += n
    if run:
        yield run


def as_messages(
    batch: list[T | M], kind: type[T], wrap: Callable[[list[T]], M], size: Callable[[T], int], max_bytes: int
) -> list[M]:
    """A batch from an outbox as messages, in order: items of `kind` next to each other travel together, in
    `wrap`ped runs of at most `max_bytes`; every other item is a message already."""
    out: list[M] = []
    run: list[T] = []
    for item in batch:
        if isinstance(item, kind):
            run.append(item)
            continue
        out += [wrap(chunk) for chunk in by_size(run, size, max_bytes)]
        run = []
        out.append(item)  # type: ignore[arg-type]  # not a T, so an M
    out += [wrap(chunk) for chunk in by_size(run, size, max_bytes)]
    return out
