"""Replies a client has not read yet. A unary reply waits in this process until its client reads it, and a client
that never does (an HTTP/2 window of 0) keeps it here after its handler has returned, uncounted by anything that
counts calls. What such a reply holds is handed to the RPC's end."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TypeVar

import grpc
from google.protobuf.message import Message

from orchestrator.core.errors import BusyError
from orchestrator.service.caps import CapsConfig

Release = Callable[[], None]
R = TypeVar("R", bound=Message)


def at_end(context: grpc.aio.ServicerContext) -> Callable[[Release], None]:
    """Hands a release to the RPC's end: called once its reply is sent or the call is over (a client that never reads
    its reply keeps it waiting, and keeps what it holds); at once if the RPC is over already."""
    releases: list[Release] = []
    ended = False

    def end(_: object) -> None:
        nonlocal ended
        ended = True
        for release in releases:
            release()

    def hand(release: Release) -> None:
        if ended:
            release()
        else:
            releases.append(release)

    context.add_done_callback(end)
    return hand


class UnreadReplies:
    """The bytes of list replies (EnvironmentService.List, ListJobs, SandboxService.List) each tenant's clients have
    not read yet: past the cap a list call is refused busy. 100 such calls of 1.7 MiB each, from a client that never
    read them, held 534 MiB of the control plane."""

    def __init__(self, cap: int, cap_name: str) -> None:
        self.cap = cap
        self.cap_name = cap_name
        self._held: collections.Counter[str] = collections.Counter()

    def held(self, tenant: str) -> int:
        """Bytes of `tenant`'s replies not read yet."""
        return self._held[tenant]

    def hold(self, tenant: str, reply: R, context: grpc.aio.ServicerContext) -> R:
        """`reply`, its size counted for `tenant` until its RPC ends; BusyError past the cap."""
        size = int(reply.ByteSize())
        # one reply always goes (one past the cap alone could never be answered); past it, those that do not fit
        if self._held[tenant] and self._held[tenant] + size > self.cap:
            raise BusyError(
                f"{self._held[tenant]} bytes of list replies to your calls are not read yet and this one is {size}; "
                f"{self.cap_name} is {self.cap} per tenant (read them, or end those calls)"
            )
        self._held[tenant] += size

        def release() -> None:
            self._held[tenant] -= size
            if not self._held[tenant]:
                del self._held[tenant]

        at_end(context)(release)
        return reply


def unread_replies(cap: int = CapsConfig().read_bytes_per_tenant) -> UnreadReplies:
    """The list replies' budget (caps.read_bytes_per_tenant, counted apart from file replies)."""
    return UnreadReplies(cap, "caps.read_bytes_per_tenant (list replies)")
