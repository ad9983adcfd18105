"""The Python trainer SDK: submit a job, iterate over scored rollouts (acked for you, resumed after a disconnect).

    async with EnvfleetClient("127.0.0.1:50051") as client:
        job_id = await client.submit(JobSpec(env="python-tool", group_size=8, policy=PolicyEndpoint(base_url=URL)))
        async for rollout in client.rollouts(job_id):
            train_on(rollout.tokens, rollout.reward)

`SyncEnvfleetClient` offers the same calls without asyncio (the stubs below are the async client's alone). With
`token=` every call carries it as a bearer token; with `tls=ClientTLS(...)` the channel uses TLS (and a client
certificate, for mTLS). `session_stub` and `sandbox_stub` reach the SessionService and the SandboxService.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from orchestrator.client.auth import ClientTLS, aio_channel
from orchestrator.client.convert import ROLLOUT_STATUS_FROM_PB, job_spec_to_pb, job_status_from_pb, rollout_from_pb
from orchestrator.core.models import JobSpec, JobStatus, Rollout
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 << 20
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
# An ack is idempotent (up_to is cumulative), so one that ran past its deadline on a busy server is sent again too
ACK_RETRYABLE = RETRYABLE | {grpc.StatusCode.DEADLINE_EXCEEDED}
RETRY_S = 0.5  # between tries while the server cannot be reached
MAX_ACKED_JOBS = 1024  # jobs whose highest ack a client remembers (a trainer with a job a step, for weeks)
ACK_GAP_S = 0.1  # while rollouts come quicker than this, one auto-ack per gap acks all consumed meanwhile


@dataclass(frozen=True)
class GroupResult:
    """A whole group: its samples and their group-normalized advantages (None for failed samples)."""

    group_id: str
    task_id: str
    rollouts: list[Rollout]
    advantages: list[float | None]
    failed: int


class EnvfleetClient:
    """Async client of one orchestrator."""

    def __init__(
        self,
        target: str,
        *,
        timeout_s: float = 30.0,
        reconnect_s: float = 60.0,
        token: str | None = None,
        tls: ClientTLS | None = None,
        insecure: bool = False,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self._channel = aio_channel(target, token=token, tls=tls, insecure=insecure)
        self.rollout_stub = pb_grpc.RolloutServiceStub(self._channel)
        self.env_stub = pb_grpc.EnvironmentServiceStub(self._channel)
        self.session_stub = pb_grpc.SessionServiceStub(self._channel)
        self.sandbox_stub = pb_grpc.SandboxServiceStub(self._channel)
        # per job, the highest up_to acked through this client: a reader without auto_ack forgets the keys up to it
        # (none of them comes again) and resumes after it
        # (the MAX_ACKED_JOBS acked last)
        self._acked: collections.OrderedDict[str, int] = collections.OrderedDict()

    async def __aenter__(self) -> EnvfleetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def submit(self, spec: JobSpec) -> str:
        """Submit a job; returns its id."""
        r = await self.rollout_stub.SubmitJob(job_spec_to_pb(spec), timeout=self.timeout_s)
        return str(r.job_id)

    async def get_job(self, job_id: str) -> JobStatus:
        """The job's state and counts (state is a JobState, by_status is keyed by RolloutStatus)."""
        r = await self.rollout_stub.GetJob(pb.GetJobRequest(job_id=job_id), timeout=self.timeout_s)
        return job_status_from_pb(r)

    async def cancel_job(self, job_id: str) -> JobStatus:
        """Cancel the job; answers once it has stopped (see the proto's CancelJob)."""
        r = await self.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=job_id), timeout=self.timeout_s)
        return job_status_from_pb(r)

    async def update_policy(
        self, job_id: str, version: str, base_url: str = "", api_key: str | None = None
    ) -> JobStatus:
        """Rollouts started from now on use this policy version (and endpoint, when given). `api_key` None keeps the
        job's key, which the server sends only to the origin it was given for: a base_url on another origin needs its
        own key here ("" for none)."""
        req = pb.UpdatePolicyRequest(job_id=job_id, version=version, base_url=base_url, api_key=api_key)
        return job_status_from_pb(await self.rollout_stub.UpdatePolicy(req, timeout=self.timeout_s))

    async def list_jobs(self) -> list[JobStatus]:
        """The caller's jobs, oldest first."""
        r = await self.rollout_stub.ListJobs(pb.ListJobsRequest(), timeout=self.timeout_s)
        return [job_status_from_pb(j) for j in r.jobs]

    async def list_envs(self) -> list[pb.EnvironmentInfo]:
        r = await self.env_stub.List(pb.ListEnvironmentsRequest(), timeout=self.timeout_s)
        return list(r.environments)

    async def describe_env(self, name: str) -> pb.EnvironmentInfo:
        r: pb.EnvironmentInfo = await self.env_stub.Describe(
            pb.DescribeEnvironmentRequest(name=name), timeout=self.timeout_s
        )
        return r

    async def ack(self, job_id: str, up_to: int = 0, ids: Sequence[str] = ()) -> int:
        """Ack everything up to a seq, and/or rollouts by id."""
        r = await self.rollout_stub.Ack(
            pb.AckRequest(job_id=job_id, up_to=up_to, ids=list(ids)), timeout=self.timeout_s
        )
        if up_to > self._acked.get(job_id, 0):
            self._acked[job_id] = up_to
            self._acked.move_to_end(job_id)
            if len(self._acked) > MAX_ACKED_JOBS:
                self._acked.popitem(last=False)
        return int(r.acked)

    async def _ack_through_outages(self, job_id: str, up_to: int) -> None:
        """An auto-ack, tried again for up to reconnect_s while the server cannot be reached, as the stream is (a
        server restarting made the iterator raise after its caller had consumed the batch)."""
        outage = _Outage(self.reconnect_s, ACK_RETRYABLE)
        while True:
            try:
                await self.ack(job_id, up_to=up_to)
                return
            except grpc.aio.AioRpcError as e:
                await outage.wait_out(e, f"ack of job {job_id}")

    async def _batches(
        self, job_id: str, resume_after: int, max_in_flight: int, max_batch: int
    ) -> AsyncGenerator[pb.RolloutBatch, int | None]:
        """Stream batches; after a dropped connection, reconnect and resume after the last seq consumed (sent in)."""
        cursor = resume_after
        outage = _Outage(self.reconnect_s)
        while True:
            req = pb.StreamRolloutsRequest(
                job_id=job_id, resume_after=cursor, max_in_flight=max_in_flight, max_batch=max_batch
            )
            call = self.rollout_stub.StreamRollouts(req)
            opened = asyncio.get_running_loop().time()
            try:
                async for batch in call:
                    outage.over()
                    consumed = yield batch
                    if consumed is not None:
                        cursor = max(cursor, consumed)
                return
            except grpc.aio.AioRpcError as e:
                outage.over_if_up(opened)
                await outage.wait_out(e, f"stream of job {job_id} (resuming after seq {cursor})")
            finally:
                # a reader that stops early (a break, an error of its own) ends the call: the channel keeps a call
                # alive until it ends, and the server's stream, which holds one of the tenant's few, went on for good
                call.cancel()

    async def rollouts(
        self,
        job_id: str,
        *,
        resume_after: int = 0,
        max_in_flight: int = 256,
        max_batch: int = 64,
        auto_ack: bool = True,
    ) -> AsyncGenerator[Rollout]:
        """Every rollout of the job, once (duplicates after a reconnect are dropped by id).

        With auto_ack, a batch of rollouts is acked once you ask for the one after its last, i.e. after you have
        consumed it; the acks go behind you (at most one per ACK_GAP_S while rollouts come quicker), and when the
        iterator ends, or is closed (aclose), they are through. If the stream fails, or your task is cancelled,
        what was not acked yet is delivered again to the next reader (the at-least-once rule).
        """

        def unpack(batch: pb.RolloutBatch) -> list[tuple[str, int, Rollout]]:
            return [(r.id, r.seq, r) for r in map(rollout_from_pb, _members(batch))]

        async with self._items(job_id, unpack, resume_after, max_in_flight, max_batch, auto_ack) as items:
            async for r in items:
                yield r

    async def rollout_messages(
        self,
        job_id: str,
        *,
        resume_after: int = 0,
        max_in_flight: int = 256,
        max_batch: int = 64,
        auto_ack: bool = True,
    ) -> AsyncGenerator[pb.Rollout]:
        """rollouts(), as the wire's protobuf messages (envfleet.v1.Rollout): for a trainer that turns them into
        tensors itself, no model is built per rollout (a quarter of the CPU per rollout at the trainer). Token ids
        and logprobs are the same values; the same dedup, acks and resumption."""

        def unpack(batch: pb.RolloutBatch) -> list[tuple[str, int, pb.Rollout]]:
            return [(r.id, r.seq, r) for r in _members(batch)]

        async with self._items(job_id, unpack, resume_after, max_in_flight, max_batch, auto_ack) as items:
            async for r in items:
                yield r

    async def groups(
        self, job_id: str, *, resume_after: int = 0, max_in_flight: int = 256, auto_ack: bool = True
    ) -> AsyncGenerator[GroupResult]:
        """Whole groups, for jobs submitted with deliver_groups=True (a group that comes in parts is joined)."""
        parts: list[pb.Group] = []  # of a group that comes in parts (Group.more), so far

        def unpack(batch: pb.RolloutBatch) -> list[tuple[str, int, GroupResult]]:
            if batch.rollouts:  # else nothing would be acked, and the stream would stop at max_in_flight for good
                raise ValueError(f"job {job_id} was not submitted with deliver_groups=True: read it with rollouts()")
            out = []
            for g in batch.groups:
                if parts and (g.group_id != parts[0].group_id or _starts_before(g, parts[-1])):
                    parts.clear()  # sent again from its first part, on the stream a reconnect opened
                if g.more or parts:
                    parts.append(g)
                    if g.more:
                        continue  # nothing to yield or ack until the last part
                members = [m for p in parts for m in p.rollouts] if parts else list(g.rollouts)
                parts.clear()
                result = group_result(g, members)
                out.append((g.group_id, max((r.seq for r in result.rollouts), default=0), result))
            return out

        async with self._items(job_id, unpack, resume_after, max_in_flight, 64, auto_ack) as items:
            async for g in items:
                yield g

    def _items(
        self,
        job_id: str,
        unpack: Callable[[pb.RolloutBatch], list[tuple[str, int, T]]],
        resume_after: int,
        max_in_flight: int,
        max_batch: int,
        auto_ack: bool,
    ) -> contextlib.aclosing[AsyncGenerator[T]]:
        """The stream's items as `unpack` makes them (see _consume), to be read inside `async with`: closed with the
        caller's generator, not left to the collector, since closing it sends the acks of what was consumed."""
        batches = self._batches(job_id, resume_after, max_in_flight, max_batch)
        return contextlib.aclosing(self._consume(job_id, batches, auto_ack, unpack, max_in_flight))

    async def _consume(
        self,
        job_id: str,
        batches: AsyncGenerator[pb.RolloutBatch, int | None],
        auto_ack: bool,
        unpack: Callable[[pb.RolloutBatch], list[tuple[str, int, T]]],
        max_in_flight: int,
    ) -> AsyncGenerator[T]:
        """Yield each batch's items (key, seq, item) whose key is new; with auto_ack, a batch is acked once its items
        were consumed (the next is asked for), behind the consumer (see _Acker); the iterator ends, or is closed,
        only once every such ack is through."""
        seen = _Seen()
        consumed: int | None = None
        acker = _Acker(self, job_id, max_in_flight) if auto_ack else None
        try:
            while True:
                if acker is None and (through := self._acked.get(job_id, 0)) > (consumed or 0):
                    # the reader acks by itself (ack up_to): none up to it comes again, and a reconnect resumes after
                    # it; without this the keys of a job read so grew to all of its rollouts
                    consumed = through
                if (batch := await _next_batch(batches, consumed, acker)) is None:
                    break
                if consumed is not None:
                    seen.forget_through(consumed)  # sent in: a reconnect resumes after it, so none of those comes again
                consumed = None
                entries = unpack(batch)
                for key, seq, item in entries:
                    if seen.add(key, seq):
                        yield item
                last = max((seq for _, seq, _ in entries), default=0)
                if batch.groups and batch.groups[-1].more:
                    last = 0  # acked with its group's last part (an ack inside a group acks none of it)
                if acker is not None and last:
                    acker.consumed(last, len(batch.rollouts) + sum(len(g.rollouts) for g in batch.groups))
                    consumed = last  # a reconnect resumes after it: its ack is on its way
            if acker is not None:
                await acker.flush()
        except GeneratorExit:  # the caller stopped reading: what it consumed is acked before the stream closes
            if acker is not None:
                await acker.flush()
            raise
        except BaseException:  # the stream failed, or the caller was cancelled: what is unacked will come again
            if acker is not None:
                acker.cancel()
            raise
        finally:
            await batches.aclose()


def group_result(g: pb.Group, members: Sequence[pb.Rollout]) -> GroupResult:
    """A whole group (its members, from its parts) as the SDK hands it out. A status this client does not know is
    not scored (rollout_from_pb): it has no advantage, and counts as failed where the server, which knows it, counted
    it scored (gave it an advantage)."""
    rollouts = [rollout_from_pb(m) for m in members]
    unknown = [m.HasField("advantage") and m.status not in ROLLOUT_STATUS_FROM_PB for m in members]
    advantages = [
        None if gone or not m.HasField("advantage") else m.advantage for m, gone in zip(members, unknown, strict=True)
    ]
    return GroupResult(g.group_id, g.task_id, rollouts, advantages, g.failed + sum(unknown))


async def _next_batch(
    batches: AsyncGenerator[pb.RolloutBatch, int | None], consumed: int | None, acker: _Acker | None
) -> pb.RolloutBatch | None:
    """The stream's next batch (None at its end). While an auto-ack is in flight, its failure is raised as soon as it
    fails, not at the next batch: a window full of rollouts consumed and not acked gets no next batch."""

    async def ask() -> pb.RolloutBatch | None:
        try:
            return await batches.asend(consumed)
        except StopAsyncIteration:
            return None

    acks = acker.in_flight if acker is not None else None
    if acks is None:
        return await ask()
    batch = asyncio.ensure_future(ask())
    try:
        done, _ = await asyncio.wait((batch, acks), return_when=asyncio.FIRST_COMPLETED)
        if batch not in done:
            acks.result()  # a failed ack raises here; one that went through leaves the batch to wait for
        return await batch
    finally:
        if not batch.done():
            batch.cancel()
            await asyncio.wait((batch,))
            if not batch.cancelled():
                batch.exception()  # the stream's own error, if it ended with one: seen, not logged as never retrieved


def _starts_before(part: pb.Group, last: pb.Group) -> bool:
    """Whether `part` starts at or before the end of `last`, a part held: the group sent again from its start."""
    return bool(part.rollouts and last.rollouts and part.rollouts[0].seq <= last.rollouts[-1].seq)


def _members(batch: pb.RolloutBatch) -> list[pb.Rollout]:
    """A batch's rollouts, the groups' members after the loose ones."""
    return [*batch.rollouts, *(m for g in batch.groups for m in g.rollouts)]


class _Outage:
    """A server that cannot be reached: a call is tried again every RETRY_S until reconnect_s have passed since the
    first failure of the spell. The stream's spell ends with its next message, or once a call of it has been up for
    reconnect_s: a quiet stream (slow rollouts) that came back from one restart is not still in that outage at the
    next, minutes later."""

    def __init__(self, reconnect_s: float, retryable: set[grpc.StatusCode] = RETRYABLE) -> None:
        self._reconnect_s = reconnect_s
        self._retryable = retryable
        self._give_up: float | None = None

    async def wait_out(self, e: grpc.aio.AioRpcError, what: str) -> None:
        """Raise `e` unless its status is one to try again and the spell is young; else wait before the next try."""
        now = asyncio.get_running_loop().time()
        if self._give_up is None:
            self._give_up = now + self._reconnect_s
        if e.code() not in self._retryable or now > self._give_up:
            raise e
        log.warning("%s failed (%s); trying again", what, e.code().name)
        await asyncio.sleep(RETRY_S)

    def over(self) -> None:
        self._give_up = None

    def over_if_up(self, opened: float) -> None:
        """End the spell if the call that failed was opened (loop time) longer than reconnect_s ago."""
        if asyncio.get_running_loop().time() - opened > self._reconnect_s:
            self._give_up = None


class _Seen:
    """The keys a stream has yielded, to drop what a reconnect sends again: those above the seq it resumes after.
    Keys come in seq order (a stream sends in seq order, and what comes again was seen), so the ones at or below it
    are forgotten from the front: with auto-ack a job of a million rollouts holds a window's keys, not a million."""

    def __init__(self) -> None:
        self._keys: set[str] = set()
        self._order: collections.deque[tuple[int, str]] = collections.deque()

    def __len__(self) -> int:
        return len(self._keys)

    def add(self, key: str, seq: int) -> bool:
        """Whether `key` is new (and now seen)."""
        if key in self._keys:
            return False
        self._keys.add(key)
        self._order.append((seq, key))
        return True

    def forget_through(self, seq: int) -> None:
        while self._order and self._order[0][0] <= seq:
            self._keys.discard(self._order.popleft()[1])


class _Acker:
    """A stream's auto-acks, sent behind the consumer rather than between its batches: one Ack in flight at a time,
    and while rollouts come quicker than one an ACK_GAP_S, one Ack per gap (up_to is cumulative: it acks everything
    consumed meanwhile). At 50 rollouts a second each batch is one rollout, and each Ack its own call and log write
    on the control plane. A window half full of consumed rollouts is acked at once, so a small max_in_flight is not
    held back by the gap. A failed ack (after reconnect_s of outage, or a status no retry helps) is raised to the
    reader when it fails, also while the reader waits for a batch (_next_batch)."""

    def __init__(self, client: EnvfleetClient, job_id: str, max_in_flight: int) -> None:
        self._client = client
        self._job_id = job_id
        self._window = max_in_flight
        self._wanted = 0  # the highest seq consumed
        self._unacked = 0  # rollouts consumed since the last ack was sent
        self._sent_at = float("-inf")
        self._task: asyncio.Task[None] | None = None
        self._due = asyncio.Event()  # set when the window is half full: the gap is skipped

    @property
    def in_flight(self) -> asyncio.Task[None] | None:
        """The task sending acks, while it runs."""
        return self._task if self._task is not None and not self._task.done() else None

    def consumed(self, seq: int, count: int) -> None:
        if self._task is not None and self._task.done():
            self._task.result()  # a failed ack surfaces here
        self._wanted = max(self._wanted, seq)
        self._unacked += count
        if 2 * self._unacked >= self._window:
            self._due.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._send(), name=f"acks of job {self._job_id}")

    async def _send(self) -> None:
        loop = asyncio.get_running_loop()
        sent = 0
        while sent < self._wanted:
            if (gap := self._sent_at + ACK_GAP_S - loop.time()) > 0 and not self._due.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(gap):
                        await self._due.wait()
            up_to, self._unacked = self._wanted, 0
            self._due.clear()
            self._sent_at = loop.time()
            await self._client._ack_through_outages(self._job_id, up_to)
            sent = up_to

    async def flush(self) -> None:
        """Send what is left now, and wait until every ack is through (raising a failed one)."""
        if self._task is not None:
            self._due.set()
            await self._task

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()


class SyncEnvfleetClient:
    """The same client for code without asyncio: a private event loop runs on a background thread. Close it (or use
    it in a `with`): its open iterators are closed first, so what they consumed is acked."""

    def __init__(self, target: str, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="envfleet-client", daemon=True)
        self._thread.start()
        self._closed = False
        self._open: set[AsyncGenerator[Any]] = set()  # iterators not closed yet
        try:
            self._client: EnvfleetClient = self._call(self._make(target, kwargs))
        except BaseException:  # a client refused (a token in clear, say) leaves no thread and loop behind
            self._stop()
            raise

    @staticmethod
    async def _make(target: str, kwargs: dict[str, Any]) -> EnvfleetClient:
        return EnvfleetClient(target, **kwargs)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the client's loop and wait for it. Interrupted while it runs (Ctrl-C, a signal handler's
        exception), it is cancelled there, so that nothing of it goes on behind the caller's back."""
        if self._closed:
            coro.close()
            raise RuntimeError("this SyncEnvfleetClient is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            # waited in short turns: Ctrl-C's SIGINT may reach any thread (gRPC's, the loop's), and a main thread
            # blocked on the future's lock for good then never ran its handler: the interrupt hung the trainer
            while True:
                try:
                    return future.result(timeout=SIGNAL_CHECK_S)
                except TimeoutError:
                    if future.done():
                        raise  # the call's own TimeoutError
                    if self._closed:
                        # closed by another thread while this call waited (a trainer's loader thread reading as its
                        # main thread shuts down): its loop stops, and this call would wait for ever
                        raise RuntimeError("this SyncEnvfleetClient was closed while the call waited") from None
        except BaseException:
            with contextlib.suppress(RuntimeError):  # the loop may be closed: nothing of the call runs any more
                future.cancel()  # a no-op once it is done
            raise

    def submit(self, spec: JobSpec) -> str:
        return self._call(self._client.submit(spec))

    def get_job(self, job_id: str) -> JobStatus:
        return self._call(self._client.get_job(job_id))

    def cancel_job(self, job_id: str) -> JobStatus:
        return self._call(self._client.cancel_job(job_id))

    def update_policy(self, job_id: str, version: str, base_url: str = "", api_key: str | None = None) -> JobStatus:
        return self._call(self._client.update_policy(job_id, version, base_url, api_key))

    def list_jobs(self) -> list[JobStatus]:
        return self._call(self._client.list_jobs())

    def list_envs(self) -> list[pb.EnvironmentInfo]:
        return self._call(self._client.list_envs())

    def describe_env(self, name: str) -> pb.EnvironmentInfo:
        return self._call(self._client.describe_env(name))

    def ack(self, job_id: str, up_to: int = 0, ids: Sequence[str] = ()) -> int:
        return self._call(self._client.ack(job_id, up_to, ids))

    def rollouts(self, job_id: str, **kwargs: Any) -> Generator[Rollout, None, None]:
        """A blocking iterator over the job's rollouts (see EnvfleetClient.rollouts)."""
        return self._blocking(self._client.rollouts(job_id, **kwargs))

    def rollout_messages(self, job_id: str, **kwargs: Any) -> Generator[pb.Rollout, None, None]:
        """A blocking iterator over the job's rollouts as protobuf messages (see EnvfleetClient.rollout_messages)."""
        return self._blocking(self._client.rollout_messages(job_id, **kwargs))

    def groups(self, job_id: str, **kwargs: Any) -> Generator[GroupResult, None, None]:
        """A blocking iterator over the job's whole groups (see EnvfleetClient.groups)."""
        return self._blocking(self._client.groups(job_id, **kwargs))

    def _blocking(self, agen: AsyncGenerator[T]) -> Generator[T, None, None]:
        # each item is awaited on the client's loop; closing the iterator closes the stream there too (once the
        # item it was waiting for, if interrupted, has stopped: a generator cannot be closed while it runs)
        self._open.add(agen)
        try:
            while True:
                try:
                    yield self._call(_anext(agen))
                except StopAsyncIteration:
                    return
        finally:
            self._open.discard(agen)
            if not self._closed:
                self._call(_close(agen))

    def close(self) -> None:
        """Close the open iterators (their consumed rollouts acked), then the channel, then the loop; again, nothing."""
        if self._closed:
            return
        try:
            for agen in list(self._open):
                if not _running(agen):  # one that another thread waits on ends with the channel
                    self._open.discard(agen)
                    with contextlib.suppress(Exception):
                        self._call(_close(agen))
            self._call(self._client.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> SyncEnvfleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CLOSE_WAIT_S = 5.0  # how long closing an iterator waits for the item it was interrupted on to stop
SIGNAL_CHECK_S = 0.2  # how often a blocking call returns to the interpreter, which runs a signal's handler then


def _running(agen: AsyncGenerator[Any]) -> bool:
    return bool(getattr(agen, "ag_running", False))  # an async generator's, not in the abstract type


async def _close(agen: AsyncGenerator[Any]) -> None:
    """Close `agen` once it is not running: a step of it that was cancelled may take a few loop turns to end."""
    async with asyncio.timeout(CLOSE_WAIT_S):
        while _running(agen):  # noqa: ASYNC110 - a generator has no event to wait on
            await asyncio.sleep(0.01)
    await agen.aclose()


async def _anext(agen: AsyncIterator[T]) -> T:
    return await agen.__anext__()
