"""Asking again while the server is busy: a RESOURCE_EXHAUSTED that carries google.rpc.RetryInfo (BusyError on the
server: the host is full, the tenant's sessions at their cap) may succeed later; one without it (a sandbox that
never fits, limits over the caps) fails the same way each time, so it is raised at once.

    opening = await retry_busy(lambda: stub.Reset(req, timeout=30), wait_s=600)

The wait between tries is the server's RetryInfo delay or an exponential backoff from it, whichever is longer (at
most MAX_DELAY_S, jittered so that many waiting clients do not ask in step), until `wait_s` has passed; then the last
RESOURCE_EXHAUSTED is raised. Only calls that the server refuses before doing anything belong here (Reset is one).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from google.protobuf.message import DecodeError
from google.rpc import code_pb2, error_details_pb2, status_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")

STATUS_DETAILS_KEY = "grpc-status-details-bin"
MAX_DELAY_S = 15.0
# the adapters' default for Reset: a trainer's episodes outnumbering the host's sandboxes wait for one to end
BUSY_WAIT_S = 600.0


def retry_after(e: grpc.RpcError) -> float | None:
    """The seconds after which the server said the call may succeed (RESOURCE_EXHAUSTED with RetryInfo), or None
    when it did not say so."""
    code = getattr(e, "code", None)
    if code is None or code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return None
    for key, value in getattr(e, "trailing_metadata", lambda: ())() or ():
        if key != STATUS_DETAILS_KEY or not isinstance(value, bytes):
            continue
        status = status_pb2.Status()
        try:
            status.ParseFromString(value)
        except DecodeError:  # a detail we cannot read is no promise
            return None
        if status.code != code_pb2.RESOURCE_EXHAUSTED:
            return None
        for detail in status.details:
            info = error_details_pb2.RetryInfo()
            if detail.Unpack(info):
                return max(0.0, int(info.retry_delay.ToNanoseconds()) / 1e9)
    return None


class _Backoff:
    """The waits of one call's tries, until its deadline."""

    def __init__(self, wait_s: float) -> None:
        self.deadline = time.monotonic() + wait_s
        self.tries = 0

    def delay(self, e: grpc.RpcError) -> float | None:
        """How long to wait before the next try, or None: raise `e`."""
        after = retry_after(e)
        left = self.deadline - time.monotonic()
        if after is None or left <= 0:
            return None
        backoff = min(MAX_DELAY_S, max(after, 0.5) * 2 ** min(self.tries, 8))
        self.tries += 1
        delay = max(after, backoff * random.uniform(0.5, 1.0))
        if self.tries == 1:
            log.info("the server is busy (%s); asking again for up to %.0fs", _details(e), left)
        return float(min(delay, left))


def _details(e: grpc.RpcError) -> str:
    details = getattr(e, "details", None)
    return str(details()) if details is not None else str(e)


async def retry_busy(call: Callable[[], Awaitable[T]], wait_s: float) -> T:
    """`call()`'s answer, asking again while the server says it is busy, for up to `wait_s` seconds."""
    backoff = _Backoff(wait_s)
    while True:
        try:
            return await call()
        except grpc.RpcError as e:
            delay = backoff.delay(e)
            if delay is None:
                raise
        await asyncio.sleep(delay)


def retry_busy_sync(call: Callable[[], T], wait_s: float) -> T:
    """retry_busy for blocking code."""
    backoff = _Backoff(wait_s)
    while True:
        try:
            return call()
        except grpc.RpcError as e:
            delay = backoff.delay(e)
            if delay is None:
                raise
        time.sleep(delay)
