"""The worker's side of the worker wire: connect to the control plane, run what it assigns, send back scored
rollouts, and reconnect when the stream ends. A worker holds no durable state: when its stream ends it cancels its
running rollouts (their sandboxes are destroyed) and the control plane retries them elsewhere."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import secrets
import shutil
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from orchestrator.client.auth import ClientTLS, check_client_transport
from orchestrator.core.archives import ArchiveKind
from orchestrator.core.echo import error_text
from orchestrator.core.environment import Environment, Task, environment_digest, indexed_tasks
from orchestrator.core.files import write_atomically
from orchestrator.core.log_limit import LogLimit
from orchestrator.core.models import JobSpec
from orchestrator.core.private_dirs import make_private_dir
from orchestrator.rollout.runner import WorkItem, left_retries
from orchestrator.service.archives import load_kinds
from orchestrator.service.caps import WIDEST_ARCHIVE_LIMITS
from orchestrator.service.declarative.env import make_environment
from orchestrator.service.declarative.spec import EnvironmentSpec
from orchestrator.service.executor import LocalExecutor
from orchestrator.service.registry import Registry
from orchestrator.worker.outbox import Outbox, as_messages
from orchestrator.worker.release import release
from orchestrator.worker.results import MAX_ROLLOUT_BYTES, MAX_WIRE_BYTES, InvalidResultError, encode
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc

log = logging.getLogger(__name__)

RECONNECT_MIN_S = 0.2
RECONNECT_MAX_S = 5.0
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_WIRE_BYTES),
    ("grpc.max_send_message_length", MAX_WIRE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
MAX_RESULT_BYTES = 8 << 20  # per message (the wire caps one at 64 MiB): large rollouts travel in several
MAX_DECLARATIVE = 32  # declarative environments a worker keeps parsed beyond its running jobs


class WorkerAgent:
    """Runs a control plane's assignments on this process's executor. Over TCP, `tls` is whom it trusts (and, for
    mTLS, what it presents); it refuses to send its token in clear off loopback unless `insecure`. `engine_wait_s`:
    what its rollouts may wait for their engine (its backend's outage_wait_s), said in its hello; `engine_answering`
    whether that engine answers now (its backend's), and `engine_waits` the ids of the rollouts that wait for it (its
    runner's), said in each heartbeat."""

    def __init__(
        self,
        target: str,
        token: str,
        executor: LocalExecutor,
        registry: Registry,
        *,
        name: str = "worker",
        slots: int = 64,
        heartbeat_s: float = 1.0,
        orphan_after_s: float | None = None,
        metrics: CollectorRegistry | None = None,
        metrics_s: float = 5.0,
        kinds: Mapping[str, ArchiveKind] | None = None,
        tls: ClientTLS | None = None,
        insecure: bool = False,
        engine_wait_s: float = 0.0,
        engine_answering: Callable[[], bool] = lambda: True,
        engine_waits: Callable[[], Collection[str]] = frozenset,
        host: str | None = None,
    ) -> None:
        release()  # read once, at the start: the version read at the first hello was an upgrade's own
        check_client_transport(target, token, tls, insecure)
        self.target = target
        self._tls = tls
        self.worker_id = f"{name}-{socket.gethostname()}-{os.getpid()}"
        self.host = host or socket.gethostname()  # WorkerHello.host: where its sandboxes run (WorkerConfig.host)
        self._instance = secrets.token_hex(16)  # WorkerHello.instance: only this process reconnects as worker_id
        self._token = token
        self._executor = executor
        self._registry = registry
        self._slots = slots
        self._engine_wait_s = engine_wait_s  # WorkerHello.engine_outage_wait_s: its backend's
        self._engine_answering = engine_answering  # Heartbeat.engine_down: its backend's, read at each heartbeat
        self._engine_waits = engine_waits  # Heartbeat.engine_waits: its runner's
        self._heartbeat_s = heartbeat_s
        self._orphan_after_s = orphan_after_s
        self._metrics = metrics  # sent to the control plane every `metrics_s`, in a heartbeat
        self._metrics_s = metrics_s
        self._failures_said = LogLimit()
        # declarative environments by their spec's digest, the most recently used MAX_DECLARATIVE: kept all, a worker
        # held every version it ever ran (a trainer registering one a step: megabytes each, per worker process); a
        # running job's stays with the job (_job_envs), so one dropped here is only parsed again
        self._declarative: OrderedDict[str, Environment] = OrderedDict()
        self._kinds = dict(load_kinds() if kinds is None else kinds)
        # uploaded environments by registration (_archive_key), loaded once (a failed load is the answer until the
        # bytes come again): by digest alone, a second registration of the same bytes (another tenant's, another
        # version, validated under other rules) ran as the first
        self._archives: dict[tuple[str, str, str, str], asyncio.Task[Environment]] = {}
        self._bytes: dict[str, asyncio.Task[Path]] = {}  # by digest: the archive's bytes, kept in a file
        self._archive_dir: asyncio.Future[Path] | None = None
        self._specs: dict[str, tuple[bytes, JobSpec]] = {}  # job id -> its spec as last sent, and parsed
        # job id -> its spec and its environment's as JSON, as this stream last carried them (WorkerHello.keeps_specs)
        self._carried: dict[str, tuple[bytes, bytes]] = {}
        # job id -> its declarative environment's spec as carried, and the environment: looked up by content once a
        # job (a spec of 100,000 tasks is megabytes, its hash milliseconds), not once an assignment
        self._job_envs: dict[str, tuple[bytes, Environment]] = {}
        self.sessions = 0  # streams opened so far

    async def run_forever(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, reconnecting (with backoff) whenever the stream ends or cannot open; or, with
        `orphan_after_s`, until no session has stood that long."""
        delay = RECONNECT_MIN_S
        served = time.monotonic()  # the end of the last session that stood (its control plane took it)
        try:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    await self._session(stop)
                except grpc.aio.AioRpcError as e:  # a TLS handshake that fails lands here too, with its reason
                    # a refusal that no retry mends (a rotated token, another protocol, a hello refused) is said
                    # where an operator looks: at info, under the default level, a worker retried it unseen
                    level = logging.ERROR if e.code() in _REFUSALS else logging.INFO
                    log.log(
                        level,
                        "worker %s: stream to %s ended: %s: %s",
                        self.worker_id,
                        self.target,
                        e.code().name,
                        e.details(),
                    )
                if time.monotonic() - started > 10:
                    delay = RECONNECT_MIN_S
                    served = time.monotonic()
                if self._orphan_after_s is not None and time.monotonic() - served >= self._orphan_after_s:
                    log.error(
                        "worker %s: no session with %s for %gs; ending (orphan_after_s)",
                        self.worker_id,
                        self.target,
                        self._orphan_after_s,
                    )
                    return
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await stop.wait()
                delay = min(delay * 2, RECONNECT_MAX_S)
        finally:
            tasks = [*self._archives.values(), *self._bytes.values()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self._archive_dir is not None:
                folder = await asyncio.gather(self._archive_dir, return_exceptions=True)
                if isinstance(folder[0], Path):
                    await asyncio.to_thread(shutil.rmtree, folder[0], True)

    async def _session(self, stop: asyncio.Event) -> None:
        outbox: Outbox[wpb.WorkerMessage | wpb.RolloutResult] = Outbox()
        running: dict[str, asyncio.Task[None]] = {}
        cancelled: set[str] = set()  # assignments the control plane cancelled, whose end it waits to hear of
        hello = wpb.WorkerHello(
            worker_id=self.worker_id,
            host=self.host,
            slots=self._slots,
            pid=os.getpid(),
            protocol=wpb.PROTOCOL_BATCHED,
            acks_cancel=True,
            instance=self._instance,
            keeps_specs=True,
            release=release(),
            engine_outage_wait_s=self._engine_wait_s,
            engine_down=not self._engine_answering(),
        )
        outbox.put(wpb.WorkerMessage(hello=hello))

        async def outbound() -> AsyncIterator[wpb.WorkerMessage]:
            while batch := await outbox.get():  # empty once closed: the stream's end ends gRPC's sender too
                for message in _worker_messages(batch):
                    yield message

        async def heartbeats() -> None:
            sent = float("-inf")
            while True:
                beat = wpb.Heartbeat(running=len(running), engine_down=not self._engine_answering())
                if beat.engine_down:
                    beat.engine_waits.extend(self._engine_waits())
                if self._metrics is not None and time.monotonic() - sent >= self._metrics_s:
                    sent = time.monotonic()
                    beat.metrics = generate_latest(self._metrics)  # about 2 ms
                outbox.put(wpb.WorkerMessage(heartbeat=beat))
                await asyncio.sleep(self._heartbeat_s)

        async with self._channel() as channel:
            call = wpb_grpc.WorkerServiceStub(channel).Connect(
                outbound(), metadata=(("authorization", f"Bearer {self._token}"),)
            )
            beat = asyncio.create_task(heartbeats(), name="heartbeats")
            stopping = asyncio.create_task(stop.wait(), name="stop")
            stopping.add_done_callback(lambda _: call.cancel())
            self.sessions += 1
            try:
                async for message in call:
                    if message.HasField("assign"):
                        for a in message.assign.assignments:  # in order: an archive's bytes come first
                            if a.HasField("env_archive") and a.env_archive.archive:
                                self._start_loading(a.env_archive)  # before any later assignment of it runs
                            task = asyncio.create_task(
                                self._run(a, self._carry(a), outbox, cancelled), name=f"assignment {a.assignment_id}"
                            )
                            running[a.assignment_id] = task
                            task.add_done_callback(
                                functools.partial(_forget, running, a.assignment_id, cancelled, outbox)
                            )
                    elif message.HasField("cancel"):
                        doomed = running.get(message.cancel.assignment_id)
                        if doomed is not None and doomed.cancel():  # one that ended has sent its result
                            cancelled.add(message.cancel.assignment_id)
                    elif message.HasField("job_ended"):
                        self._specs.pop(message.job_ended.job_id, None)
                        self._carried.pop(message.job_ended.job_id, None)
                        self._job_envs.pop(message.job_ended.job_id, None)
                        self._executor.job_ended(message.job_ended.job_id)
            except asyncio.CancelledError:
                if not stop.is_set():
                    raise
            finally:
                stopping.cancel()
                beat.cancel()
                # nothing outlives the stream: the control plane retries these elsewhere
                for task in running.values():
                    task.cancel()
                await asyncio.gather(beat, *running.values(), return_exceptions=True)
                outbox.close()
                # a job that ends while this worker is away is never said to end here: its spec and snapshots go
                # now (both come back with the job's next assignment, the snapshots as a cache miss)
                self._carried.clear()  # the next stream carries each job's spec again
                self._job_envs.clear()
                for job_id in list(self._specs):
                    self._specs.pop(job_id)
                    self._executor.job_ended(job_id)

    def _channel(self) -> grpc.aio.Channel:
        if self._tls is None:  # a unix socket, loopback, or the operator's insecure
            return grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        return grpc.aio.secure_channel(self.target, self._tls.credentials(), options=CHANNEL_OPTIONS)

    def _carry(self, a: wpb.Assignment) -> tuple[bytes, bytes]:
        """The assignment's job spec and environment spec as JSON: those it carries, kept for the job's next ones, or
        those this stream carried last for its job when it carries none (read in the stream's order, as sent)."""
        spec_json = a.job_spec_json
        if not spec_json:
            return self._carried.get(a.job_id, (b"", b""))
        carried = self._carried[a.job_id] = (spec_json, a.env_spec_json)
        return carried

    async def _run(
        self,
        a: wpb.Assignment,
        carried: tuple[bytes, bytes],
        outbox: Outbox[wpb.WorkerMessage | wpb.RolloutResult],
        cancelled: set[str],
    ) -> None:
        try:
            await self._run_assignment(a, *carried, outbox)
        except asyncio.CancelledError:
            if a.assignment_id in cancelled:  # the control plane's Cancel: a run destroys its sandbox before it ends
                cancelled.discard(a.assignment_id)
                outbox.put(wpb.RolloutResult(assignment_id=a.assignment_id, cancelled=True))
            raise

    async def _run_assignment(
        self,
        a: wpb.Assignment,
        spec_json: bytes,
        env_json: bytes,
        outbox: Outbox[wpb.WorkerMessage | wpb.RolloutResult],
    ) -> None:
        try:
            spec = self._spec(a.job_id, spec_json)
            if a.HasField("env_archive"):
                env = await self._archived(a.env_archive)
            else:
                env = self._job_environment(a.job_id, spec.env, env_json)
                if a.env_digest and (own := environment_digest(env)) != a.env_digest:
                    raise LookupError(
                        f"this worker's {env.ref()} is not the control plane's (digest {own[:12]}, not "
                        f"{a.env_digest[:12]}): install the same version of its plug-in on every node"
                    )
            task = self._task(env, a.task_id)
        except Exception as e:
            outbox.put(self._failed(a, "cannot run it", e))
            return
        item = WorkItem(a.job_id, task, a.sample_index, time.monotonic() - a.queued_s, a.tenant, a.traceparent)
        if a.attempts_spent:  # the job's infrastructure retries are one budget, whichever workers spend it
            spec = spec.model_copy(update={"max_infra_retries": left_retries(spec, a.attempts_spent)})
        try:
            rollout = await self._executor.run(item, env, spec)
            result = encode(a.assignment_id, rollout)
            too_big = max(len(result.rollout_json), len(result.rollout_pb))
            if too_big > MAX_ROLLOUT_BYTES:  # the control plane refuses it, and past the wire's cap it ends the stream
                raise InvalidResultError(f"the encoded rollout is {too_big} bytes, over {MAX_ROLLOUT_BYTES}")
        except Exception as e:  # never no answer: the control plane would wait out the rollout's whole budget
            outbox.put(self._failed(a, "failed to run or encode it", e))
            return
        outbox.put(result)

    def _failed(self, a: wpb.Assignment, what: str, e: Exception) -> wpb.RolloutResult:
        """The error result of an assignment: the control plane counts it an infrastructure failure and retries."""
        # a refused spec is said by its fields alone: pydantic's own text quotes the values (an api_key among them)
        bare = isinstance(e, ValidationError)
        # a traceback a minute for each kind: a worker without a job's plug-in failed each of its assignments so
        if (more := self._failures_said.allow((what, type(e).__name__))) is not None:
            log.error(
                "worker %s %s (assignment %s)%s%s",
                self.worker_id,
                what,
                a.assignment_id,
                f": {error_text(e)}" if bare else "",
                more,
                exc_info=None if bare else e,
            )
        error = f"worker {self.worker_id} {what}: {type(e).__name__}: {error_text(e)}"[:2000]
        return wpb.RolloutResult(assignment_id=a.assignment_id, error=error)

    def _spec(self, job_id: str, spec_json: bytes) -> JobSpec:
        """The assignment's job spec, parsed once per job and spec (a policy update sends a new one)."""
        if not spec_json:  # the control plane's bug: said again with the job's next assignment (after this error)
            raise LookupError(f"no spec of job {job_id} came on this stream")
        cached = self._specs.get(job_id)
        if cached is None or cached[0] != spec_json:
            cached = self._specs[job_id] = (spec_json, JobSpec.model_validate_json(spec_json))
        return cached[1]

    def _job_environment(self, job_id: str, ref: str, spec_json: bytes) -> Environment:
        """The job's environment: `_environment`, once per declarative spec the stream carried for the job."""
        cached = self._job_envs.get(job_id)
        if cached is not None and cached[0] is spec_json:  # the bytes kept from the assignment that carried them
            return cached[1]
        env = self._environment(ref, spec_json)
        if spec_json:
            self._job_envs[job_id] = (spec_json, env)
        return env

    def _environment(self, ref: str, spec_json: bytes) -> Environment:
        if not spec_json:
            return self._registry.get(ref)
        # by its content: kept by ref, a spec of the same name@version from a control plane that came back with
        # other registrations was run and scored as the old one
        key = hashlib.sha256(spec_json).hexdigest()
        env = self._declarative.get(key)
        if env is None:
            env = self._declarative[key] = make_environment(EnvironmentSpec.model_validate_json(spec_json))
            while len(self._declarative) > MAX_DECLARATIVE:
                self._declarative.popitem(last=False)
        else:
            self._declarative.move_to_end(key)
        return env

    def _start_loading(self, m: wpb.ArchiveEnvironment) -> None:
        """An assignment that carries an archive's bytes: keep them (checked), and load its registration. Bytes that
        come again (the control plane sends them after a failure) retry whatever failed of that digest, each
        registration's load too: kept, a passing fault (a full disk, bytes damaged on the way) broke the environment
        here for good."""
        kept = self._bytes.get(m.sha256)
        if kept is None or _failed(kept) or any(_failed(t) for k, t in self._archives.items() if k[0] == m.sha256):
            self._bytes[m.sha256] = asyncio.create_task(self._keep_bytes(m), name=f"keeping {m.name}@{m.version}")
            for key in [k for k, t in self._archives.items() if k[0] == m.sha256 and _failed(t)]:
                del self._archives[key]
        self._load(m)

    def _load(self, m: wpb.ArchiveEnvironment) -> asyncio.Task[Environment]:
        key = _archive_key(m)
        loading = self._archives.get(key)
        if loading is None:
            loading = self._archives[key] = asyncio.create_task(
                self._load_archive(m), name=f"loading {m.name}@{m.version}"
            )
        return loading

    async def _keep_bytes(self, m: wpb.ArchiveEnvironment) -> Path:
        """The archive's bytes, checked against their digest, in a file of this worker's (whole or not at all)."""
        digest = hashlib.sha256(m.archive).hexdigest()
        if digest != m.sha256:
            raise ValueError(f"the archive of {m.name}@{m.version} arrived damaged (sha256 {digest}, not {m.sha256})")
        folder = await self._archives_folder() / m.sha256
        await asyncio.to_thread(folder.mkdir, exist_ok=True)
        await asyncio.to_thread(write_atomically, folder / "archive", m.archive)  # another load may read it
        return folder / "archive"

    async def _archives_folder(self) -> Path:
        if self._archive_dir is None:  # made once: loads of two archives in one batch made one each
            self._archive_dir = asyncio.ensure_future(asyncio.to_thread(make_private_dir, "worker-archives"))
        return await asyncio.shield(self._archive_dir)

    async def _load_archive(self, m: wpb.ArchiveEnvironment) -> Environment:
        """Load one registration of an uploaded environment (the control plane checked the archive already) from
        its digest's bytes, which an assignment of this registration or of another of the same bytes carried."""
        kind = self._kinds.get(m.kind)
        if kind is None:
            raise LookupError(f"this worker has no plug-in for archives of kind {m.kind!r}")
        kept = self._bytes.get(m.sha256)
        if kept is None:
            raise LookupError(f"the control plane sent no archive of {m.name}@{m.version} on this stream")
        archive = await asyncio.shield(kept)
        # a tree of its own per registration: each is its own environment (its name, version, validation)
        tree = archive.parent / ("tree-" + hashlib.sha256(repr(_archive_key(m)).encode()).hexdigest()[:16])
        await asyncio.to_thread(shutil.rmtree, tree, True)  # what a load that failed left
        try:
            tree.mkdir()
            env = await asyncio.to_thread(kind.load, archive, tree, m.name, m.version, WIDEST_ARCHIVE_LIMITS)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, tree, True))
            raise
        # validated under the rules this worker's plug-in grades by (the control plane judges by its own)
        return kind.validated(env) if m.rules == kind.rules else env

    async def _archived(self, m: wpb.ArchiveEnvironment) -> Environment:
        # a registration not seen yet loads from the bytes another registration of the same digest carried
        return await asyncio.shield(self._load(m))  # a cancelled rollout does not cancel the load others wait for

    @staticmethod
    def _task(env: Environment, task_id: str) -> Task:
        # by the environment object, not its ref: one name@version of other content (another control plane's
        # registration, an archive of other bytes) is another environment, whose tasks the old ones are not
        return indexed_tasks(env)[1][task_id]


def _archive_key(m: wpb.ArchiveEnvironment) -> tuple[str, str, str, str]:
    return (m.sha256, m.name, m.version, m.rules)


def _failed(task: asyncio.Task[Any]) -> bool:
    return task.done() and (task.cancelled() or task.exception() is not None)


_REFUSALS = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.ALREADY_EXISTS,
    }
)


def _forget(
    running: dict[str, asyncio.Task[None]],
    assignment_id: str,
    cancelled: set[str],
    outbox: Outbox[wpb.WorkerMessage | wpb.RolloutResult],
    _: asyncio.Task[None],
) -> None:
    running.pop(assignment_id, None)
    if assignment_id in cancelled:
        # cancelled before it ever ran (its _run says so itself once begun): it made no sandbox, and the control
        # plane, told nothing, waited out its cancel's deadline for each one
        cancelled.discard(assignment_id)
        outbox.put(wpb.RolloutResult(assignment_id=assignment_id, cancelled=True))


def _result_size(r: wpb.RolloutResult) -> int:
    return len(r.rollout_json) + len(r.rollout_pb) + len(r.error) + 64  # and its id


def _worker_messages(batch: list[wpb.WorkerMessage | wpb.RolloutResult]) -> list[wpb.WorkerMessage]:
    """Results next to each other travel in one message."""
    return as_messages(
        batch,
        wpb.RolloutResult,
        lambda run: wpb.WorkerMessage(results=wpb.ResultBatch(results=run)),
        _result_size,
        MAX_RESULT_BYTES,
    )
