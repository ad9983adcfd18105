"""A worker wire of its own for tests: a hub served on a unix socket (this host's workers) and on TCP (remote ones),
with the real servicer, and a scripted worker that answers its assignments as a test tells it (well, wrongly, late
or never)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.core.models import JobSpec, Rollout, RolloutStatus, TaskSelection, rollout_id
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.rollout.runner import WorkItem
from orchestrator.server.worker_plane import SERVER_OPTIONS
from orchestrator.service.fleet import start_fleet
from orchestrator.service.registry import Registry
from orchestrator.worker.agent import CHANNEL_OPTIONS
from orchestrator.worker.hub import WorkerHub
from orchestrator.worker.release import release
from orchestrator.worker.servicer import WorkerServicer
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tests.conftest import TEST_OWNER

TOKEN = "test-worker-token-" + "x" * 16
ENV = "python-tool"

Answer = Callable[[wpb.Assignment], Awaitable[wpb.RolloutResult | None]]


@dataclass
class Wire:
    """A hub and where workers reach it."""

    hub: WorkerHub
    unix: str
    tcp: str


@contextlib.asynccontextmanager
async def serve_hub(**hub_options: Any) -> AsyncIterator[Wire]:
    """A hub with its WorkerService on a fresh unix socket and a loopback TCP port."""
    fleet = await start_fleet(FakeBackendConfig(owner=TEST_OWNER))
    hub = WorkerHub(fleet.images, **hub_options)
    server = grpc.aio.server(options=SERVER_OPTIONS)
    wpb_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(hub, TOKEN), server)
    socket_dir = Path(tempfile.mkdtemp(prefix="ef-wire-"))  # short: a unix socket path has ~100 characters
    unix = f"unix:{socket_dir / 'w.sock'}"
    server.add_insecure_port(unix)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield Wire(hub, unix, f"127.0.0.1:{port}")
    finally:
        await hub.close()
        await server.stop(0)
        await fleet.backend.close()
        shutil.rmtree(socket_dir, ignore_errors=True)


def rollout_for(a: wpb.Assignment, **update: Any) -> Rollout:
    """A scored rollout of an assignment; `update` replaces fields without validation (to forge bad ones)."""
    good = Rollout(
        id=rollout_id(a.job_id, a.task_id, a.sample_index),
        job_id=a.job_id,
        env=f"{ENV}@1",
        task_id=a.task_id,
        group_id=f"{a.job_id}:{a.task_id}",
        sample_index=a.sample_index,
        status=RolloutStatus.OK,
        reward=1.0,
    )
    return good.model_copy(update=update)


@dataclass
class ScriptedWorker:
    """A worker process's wire, played by the test: hello, heartbeats, and `answer` for each assignment."""

    target: str
    answer: Answer
    worker_id: str = "scripted"
    protocol: wpb.Protocol = wpb.PROTOCOL_BATCHED
    # None: the hello only. For a worker the control plane refuses at its hello: grpc's aio client reports a write
    # that fails as the server's status arrives as INTERNAL "Internal error from Core" in place of that status
    # (grpc/grpc#36066), so a heartbeat sent while the refusal is on its way hides the refusal's code and message.
    heartbeat_s: float | None = 0.5
    slots: int = 64
    pid: int = 1
    instance: str = "scripted-instance"  # WorkerHello.instance: one process (a hello with its id reconnects)
    keeps_specs: bool = False  # WorkerHello.keeps_specs: its assignments carry a job's spec once (an older one's each)
    release: str = field(default_factory=release)  # WorkerHello.release: this build's, unless a test says otherwise
    host: str = "scripted-host"
    engine_outage_wait_s: float = 0.0  # WorkerHello.engine_outage_wait_s: what its rollouts may wait for its engine
    metrics: bytes = b""  # what its heartbeats carry as its Prometheus metrics
    engine_down: bool = False  # what its hello and heartbeats say of its engine (read at each)
    engine_waits: list[str] = field(default_factory=list)  # what its heartbeats say waits for its engine
    token: str = TOKEN
    assignments: list[wpb.Assignment] = field(default_factory=list)
    assign_messages: int = 0  # control messages that carried assignments
    cancelled: list[str] = field(default_factory=list)
    error: grpc.aio.AioRpcError | None = None
    _task: asyncio.Task[None] | None = None
    _outbox: asyncio.Queue[wpb.WorkerMessage] = field(default_factory=asyncio.Queue)

    def send(self, message: wpb.WorkerMessage) -> None:
        """Send a message of the test's own on the stream (after the hello)."""
        self._outbox.put_nowait(message)

    async def __aenter__(self) -> ScriptedWorker:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def ended(self) -> None:
        """Wait for the stream to end (the control plane refused or dropped this worker)."""
        assert self._task is not None
        await self._task

    async def _run(self) -> None:
        outbox = self._outbox
        hello = wpb.WorkerHello(
            worker_id=self.worker_id,
            host=self.host,
            slots=self.slots,
            pid=self.pid,
            protocol=self.protocol,
            instance=self.instance,
            keeps_specs=self.keeps_specs,
            release=self.release,
            engine_outage_wait_s=self.engine_outage_wait_s,
            engine_down=self.engine_down,
        )

        async def outbound() -> AsyncIterator[wpb.WorkerMessage]:
            yield wpb.WorkerMessage(hello=hello)
            while True:
                yield await outbox.get()

        async def heartbeats() -> None:
            assert self.heartbeat_s is not None
            while True:
                beat = wpb.Heartbeat(
                    running=0, metrics=self.metrics, engine_down=self.engine_down, engine_waits=self.engine_waits
                )
                outbox.put_nowait(wpb.WorkerMessage(heartbeat=beat))
                await asyncio.sleep(self.heartbeat_s)

        async def reply(a: wpb.Assignment) -> None:
            result = await self.answer(a)
            if result is not None:
                outbox.put_nowait(wpb.WorkerMessage(results=wpb.ResultBatch(results=[result])))

        replies: set[asyncio.Task[None]] = set()
        async with grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS) as channel:
            call = wpb_grpc.WorkerServiceStub(channel).Connect(
                outbound(), metadata=(("authorization", f"Bearer {self.token}"),)
            )
            beat = asyncio.create_task(heartbeats()) if self.heartbeat_s is not None else None
            try:
                async for message in call:
                    if message.HasField("assign"):
                        self.assign_messages += 1
                        for a in message.assign.assignments:
                            self.assignments.append(a)
                            task = asyncio.create_task(reply(a))
                            replies.add(task)
                            task.add_done_callback(replies.discard)
                    elif message.HasField("cancel"):
                        self.cancelled.append(message.cancel.assignment_id)
            except grpc.aio.AioRpcError as e:
                self.error = e
            finally:
                if beat is not None:
                    beat.cancel()
                for task in replies:
                    task.cancel()


def spec(task_ids: list[str], **update: Any) -> JobSpec:
    """A job spec of python-tool tasks on the replay policy, no infrastructure retries unless told."""
    base = JobSpec(
        env=ENV,
        tasks=TaskSelection(kind="ids", ids=task_ids),
        policy=PolicyEndpoint(base_url=REPLAY_URL),
        max_infra_retries=0,
    )
    return base.model_copy(update=update)


def items(job_id: str, n: int) -> list[WorkItem]:
    """Work items of the first `n` python-tool tasks of a job."""
    tasks = Registry.from_entry_points().get(ENV).tasks()[:n]
    return [WorkItem(job_id, t, 0, time.monotonic(), "local") for t in tasks]
