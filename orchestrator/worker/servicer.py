"""The control plane's WorkerService: checks a worker's token and hands its stream to the hub."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator

import grpc

from orchestrator.core.echo import echo
from orchestrator.worker.config import MAX_ENGINE_WAIT_S, MAX_NAME_CHARS, MAX_SLOTS, NAME
from orchestrator.worker.hub import WorkerHub
from orchestrator.worker.release import release
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc

log = logging.getLogger(__name__)


class WorkerServicer(wpb_grpc.WorkerServiceServicer):  # type: ignore[misc]
    """Only a process holding the fleet's worker token may join: a worker receives policy credentials and sends
    back rewards."""

    def __init__(self, hub: WorkerHub, token: str) -> None:
        release()  # read once, at the start: the version read at the first hello was an upgrade's own
        self._hub = hub
        self._expected = f"Bearer {token}".encode()

    async def Connect(
        self, request_iterator: AsyncIterator[wpb.WorkerMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.ControlMessage]:
        """Authenticate, read the hello, then serve the stream until the worker is lost."""
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(str(given).encode(), self._expected):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a worker needs the fleet's worker token")
        inbound = aiter(request_iterator)
        try:
            # a peer that holds the token but never says hello (or went away unseen) does not hold a handler for good
            async with asyncio.timeout(self._hub.heartbeat_timeout_s):
                first = await anext(inbound, None)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"a worker must say hello within {self._hub.heartbeat_timeout_s:g}s of connecting",
            )
        if first is None or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a worker's first message must be its hello")
        assert first is not None
        if first.hello.protocol != wpb.PROTOCOL_BATCHED:
            theirs = first.hello.protocol
            name = wpb.Protocol.Name(theirs) if theirs in wpb.Protocol.values() else str(theirs)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the worker speaks protocol {name}, this control plane PROTOCOL_BATCHED: "
                "run the same envfleet release on both",
            )
        hello = first.hello
        if hello.release != release():
            build = f"build {echo(hello.release)}" if hello.release else "a build from before builds were compared"
            # said here too: a local worker respawned after an in-place upgrade is refused over and over
            log.warning("worker %s refused: it runs %s, this control plane %s", echo(hello.worker_id), build, release())
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"the worker runs {build}, this control plane build {release()}: run the same envfleet release on "
                "both (a worker of another build refuses the job specs it is sent, or sends rollouts this side "
                "refuses)",
            )
        if not 1 <= hello.slots <= MAX_SLOTS:
            # its slots are the fleet's room: a hello of 2**31 slots took every rollout and undid the wait for room
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a worker's slots must be between 1 and {MAX_SLOTS}, got {hello.slots}",
            )
        if not 0 <= hello.engine_outage_wait_s <= MAX_ENGINE_WAIT_S:  # NaN is neither: refused too
            # the budget of each of its assignments counts it in: a remote worker of 1e300 s was never found stuck
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"a worker's engine_outage_wait_s must be between 0 and {MAX_ENGINE_WAIT_S:g}, got "
                f"{hello.engine_outage_wait_s!r}",
            )
        for what, value in (("worker_id", hello.worker_id), ("host", hello.host), ("instance", hello.instance)):
            # the id and host label every sample of the fleet's metrics: a 1 MiB host made a scrape of 300 MiB
            if not NAME.fullmatch(value) and not (what == "instance" and not value):
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a worker's {what} is 1 to {MAX_NAME_CHARS} of the characters A-Z a-z 0-9 . _ : @ -, got "
                    f"{len(value)} characters: {value[:40]!r}",
                )
        # a worker over the unix socket is a process of this host, in the control plane's own 0700 directory
        trusted = context.peer().startswith("unix:")
        if (not trusted and self._hub.is_trusted(hello.worker_id)) or self._hub.taken(hello):
            # a hello with a connected worker's id would drop it (its rollouts retried), and the two would then take
            # the id from each other for good: only the same process (its instance) reconnects, and never a remote
            # one as a local worker
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS,
                f"worker id {hello.worker_id!r} is a connected worker's; another worker needs its own",
            )
        async for message in self._hub.attach(hello, inbound, trusted=trusted):
            yield message
