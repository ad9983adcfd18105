"""`create_server(config)`: the orchestrator process's parts wired together, serving gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server
from pydantic import BaseModel, ConfigDict, Field, model_validator

from orchestrator.backends.config import BackendConfig, DockerBackendConfig
from orchestrator.backends.pool import PoolConfig, SandboxPool
from orchestrator.core.errors import ConfigError
from orchestrator.core.metrics import DEFAULT_METRICS_PORT, Metrics
from orchestrator.core.models import DEFAULT_JOB_RETENTION_S, JobSpec
from orchestrator.core.net import NO_SHARED_PORT, host_port, listen
from orchestrator.core.private_dirs import make_private_dir, sweep_private_dirs
from orchestrator.core.processes import proc_start_time
from orchestrator.core.sandbox import SandboxBackend
from orchestrator.core.stalls import StallWatch
from orchestrator.core.tracing import Tracer, TracingConfig, make_tracer
from orchestrator.openenv.config import OpenEnvConfig
from orchestrator.rollout.runner import RolloutRunner
from orchestrator.rollout.tito.tokenizer import TokenizerCache, TokenizerDirs
from orchestrator.server.convert_sessions import MAX_STEP_REQUEST_BYTES
from orchestrator.server.errors import ErrorInterceptor
from orchestrator.server.replies import unread_replies
from orchestrator.server.security import (
    Authenticator,
    AuthInterceptor,
    PolicyURLs,
    ReplayGate,
    SecurityConfig,
    TenantCallsInterceptor,
    WorkerTLSConfig,
    check_transport,
    check_worker_transport,
    server_credentials,
)
from orchestrator.server.services import EnvironmentService, RolloutService
from orchestrator.server.trainer_services import SandboxService, SessionService
from orchestrator.server.worker_plane import WorkerPlane, worker_identity
from orchestrator.service.archives import ArchiveStore, load_kinds
from orchestrator.service.caps import CapsConfig
from orchestrator.service.executor import Executor, LocalExecutor
from orchestrator.service.fleet import start_fleet
from orchestrator.service.jobs import JobManager
from orchestrator.service.registration import Registrar, SpecStore
from orchestrator.service.registry import Registry
from orchestrator.service.sandboxes import SandboxManager, SandboxServiceConfig
from orchestrator.service.scheduler import Capacity
from orchestrator.service.sessions import SessionConfig, SessionManager
from orchestrator.service.store import ResultStore
from orchestrator.viewer.http import ViewerServer, start_live_viewer
from orchestrator.worker.metrics import fleet_registry
from orchestrator.worker.ray_fleet import RayConfig
from protos import orchestrator_pb2, orchestrator_pb2_grpc

if TYPE_CHECKING:
    from orchestrator.openenv.serving import OpenEnvFacade

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
# how often a client may ping, a quiet connection included (the SDK pings every 30 s: client/auth.py KEEPALIVE_MS);
# more often, gRPC answers with GOAWAY ("too many pings")
CLIENT_PING_MIN_MS = 10_000
STOP_STAGE_S = 60.0  # the longest any one stage of a shutdown may take, plus for the pool:
REMOVE_BUDGET_S = 0.5  # per idle sandbox (the engine removes about 10 a second here)


class OrchestratorConfig(BaseModel):
    """How an orchestrator serves."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(50051, ge=0, le=65535, description="0 picks a free port")
    data_dir: Path = Path(".envfleet")
    result_log_sync: Literal["full", "normal"] = Field(
        "full",
        description="full: a rollout is on disk (fsync) before it is streamed, so a host that loses power loses none a "
        "trainer has seen; normal: it survives a crash of the process but not of the host, for 10-15% more rollouts/s "
        "at the fleet bench's top rate",
    )
    result_log_acked: Literal["keep", "slim"] = Field(
        "keep",
        description="keep: an acked rollout stays whole in the result log for the job's retention (the viewer and "
        "exports show its episode); slim: it keeps its record (status, reward, metrics, timing) without its turns and "
        "tokens, nearly all of its bytes, for a job that runs for weeks",
    )
    max_in_flight: int = Field(64, ge=1, le=100_000, description="rollouts in flight on this host")
    job_retention_s: float | None = Field(
        DEFAULT_JOB_RETENTION_S,
        ge=0,
        description="a finished job and its rollouts are removed from memory and the result log this long after its "
        "end (kept while a stream of it is open); None: kept for good, and the log grows without end",
    )
    backend: BackendConfig = Field(
        default_factory=lambda: DockerBackendConfig(owner="envfleet-orchestrator"),
        description="where sandboxes run: docker, or fake",
    )
    reflection: bool | None = Field(None, description="server reflection; None: on without TLS, off with TLS")
    pool: PoolConfig = PoolConfig()
    capacity: Capacity = Field(default_factory=Capacity)
    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus endpoint; None: off")
    # the metrics page has no authentication (tenants' job counts, queue depths): loopback unless the operator says
    metrics_host: str = Field("127.0.0.1", description="where the unauthenticated metrics endpoint listens")
    security: SecurityConfig = SecurityConfig()
    sessions: SessionConfig = SessionConfig()
    sandboxes: SandboxServiceConfig = SandboxServiceConfig()
    caps: CapsConfig = Field(CapsConfig(), description="per request and per tenant caps (RESOURCE_EXHAUSTED)")
    # gRPC receives and parses a whole request message (~1.5x its size in memory) before any handler or cap sees it:
    # the one bound on what an in-flight request costs before it can be refused
    max_message_bytes: int = Field(
        MAX_MESSAGE_BYTES, ge=4 << 20, le=MAX_MESSAGE_BYTES, description="largest request (and response) message"
    )
    client_keepalive_s: float = Field(
        60.0,
        ge=0.5,
        le=7200,
        description="how often the server pings a client's connection that is quiet; one whose host went away "
        "without a word (a crash, a partition) is cut off when its answer is that late, so its streams' slots and "
        "its jobs' retention come back (without it, after the kernel's two hours)",
    )
    workers: int = Field(
        0, ge=0, le=1024, description="rollout worker processes on this host; 0: rollouts run in this process"
    )
    worker_listen: str | None = Field(
        None, description="also accept workers over TCP here (HOST:PORT), e.g. Ray actors on other nodes"
    )
    worker_tls: WorkerTLSConfig = Field(
        WorkerTLSConfig(), description="TLS of worker_listen: the server's certificate, mTLS of workers, Ray's trust"
    )
    worker_heartbeat_timeout_s: float = Field(10.0, gt=0, le=600, description="a silent worker is lost after this")
    worker_token_file: Path | None = Field(
        None,
        description="the workers' token (a 0600 file of this user's); None: kept in data_dir/worker_token when "
        "worker_listen is set, so that remote workers rejoin a restarted control plane",
    )
    ray: RayConfig | None = Field(None, description="place workers as actors on a Ray cluster's sandbox hosts")
    ui_port: int | None = Field(None, ge=0, le=65535, description="the trajectory viewer's HTTP port; None: off")
    ui_host: str = Field("127.0.0.1", description="where the viewer listens (plain HTTP: loopback unless insecure)")
    environments: list[str] = Field(
        default_factory=list, description="module:ClassName environments to serve beside the entry points"
    )
    openenv: OpenEnvConfig | None = Field(None, description="serve sessions over OpenEnv too (the openenv extra)")
    tracing: TracingConfig = Field(
        TracingConfig(), description="OpenTelemetry traces of every rollout, from here and every worker; off by default"
    )
    tokenizer_dirs: list[Path] = Field(
        default_factory=list,
        description="directories whose folders are the tokenizers a job may name (policy.tokenizer) for tito mode",
    )

    @model_validator(mode="after")
    def _tokenizer_dirs_exist(self) -> OrchestratorConfig:
        missing = [str(d) for d in self.tokenizer_dirs if not d.is_dir()]
        if missing:
            raise ValueError(f"tokenizer_dirs: not a directory: {', '.join(missing)}")
        return self

    @model_validator(mode="after")
    def _answers_fit_messages(self) -> OrchestratorConfig:
        if self.sandboxes.max_output + (1 << 20) > self.max_message_bytes:
            raise ValueError(
                f"sandboxes.max_output ({self.sandboxes.max_output}) must leave 1 MiB under max_message_bytes "
                f"({self.max_message_bytes}): a file read or a download must fit in one answer"
            )
        return self

    @model_validator(mode="after")
    def _ray_needs_tcp(self) -> OrchestratorConfig:
        if self.ray is not None and not self.worker_listen:
            raise ValueError("ray: Ray workers dial the control plane over TCP; set worker_listen (HOST:PORT)")
        return self

    @model_validator(mode="after")
    def _worker_tls_fits(self) -> OrchestratorConfig:
        wt = self.worker_tls
        if wt.configured and not self.worker_listen:
            raise ValueError("worker_tls: only workers over TCP speak TLS; set worker_listen (--worker-listen)")
        if wt.configured and self.security.tls is None:
            raise ValueError(
                "worker_tls: the worker listener serves the API server's certificate; give security.tls "
                "(--tls-cert/--tls-key)"
            )
        if self.ray is None and (wt.ca_file or wt.cert_file):
            raise ValueError(
                "worker_tls: ca_file, cert_file and key_file are what Ray workers are handed (--worker-tls-ca/-cert/"
                "-key need --ray-address); the worker listener itself serves --tls-cert/--tls-key"
            )
        if self.ray is not None and wt.client_ca_file and not wt.cert_file:
            raise ValueError(
                "worker_tls: with mTLS of workers (client_ca_file) Ray workers need a certificate to present; give "
                "cert_file and key_file (--worker-tls-cert/--worker-tls-key)"
            )
        return self


class Orchestrator:
    """A running orchestrator: its gRPC server, jobs, store and sandbox backend."""

    def __init__(
        self,
        config: OrchestratorConfig,
        server: grpc.aio.Server,
        port: int,
        jobs: JobManager,
        backend: SandboxBackend,
        store: ResultStore,
        health_servicer: health.aio.HealthServicer,
        tracer: Tracer,
    ) -> None:
        self.config = config
        self.server = server
        self.port = port
        self.jobs = jobs
        self.backend = backend
        self.store = store
        self._health = health_servicer
        self.tracer = tracer
        self.pool: SandboxPool | None = None
        self.metrics: Metrics | None = None
        self.metrics_port: int | None = None
        self._metrics_server: Any = None
        self.sessions: SessionManager | None = None
        self.sandboxes: SandboxManager | None = None
        self.registrar: Registrar | None = None
        self.workers: WorkerPlane | None = None
        self.ui: ViewerServer | None = None
        self.openenv: OpenEnvFacade | None = None
        self._private_dir: Path | None = None  # the gRPC socket of the in-process OpenEnv facade
        self._serving = ""  # its instance id in the data directory's serving file (write_serving)
        self._data_lock: int | None = None  # the data directory's lock (lock_data_dir), held until the stop's end
        self.stalls = StallWatch("control plane")

    @property
    def address(self) -> str:
        return host_port(self.config.host, self.port)

    async def wait(self) -> None:
        await self.server.wait_for_termination()

    async def stop(self, grace: float = 5.0) -> None:
        """Stop serving, cancel running rollouts (destroying their sandboxes), close the store.

        Every stage is bounded: one that overruns is logged and left behind, and the backend's close, which always
        runs, removes every container this instance still owns."""
        try:
            forget_serving(self.config.data_dir, self._serving)
            if self.openenv is not None:  # first: its websockets close their sessions through the gRPC server
                await _bounded("the OpenEnv facade", self.openenv.close(), STOP_STAGE_S)
            await _bounded("the health service", self._health.enter_graceful_shutdown(), STOP_STAGE_S)
            await _bounded("the gRPC server", self.server.stop(grace), grace + STOP_STAGE_S)
            if self.ui is not None:
                await _bounded("the viewer", asyncio.to_thread(self.ui.close), STOP_STAGE_S)
            if self.sessions is not None:
                await _bounded("the sessions", self.sessions.close_all(), STOP_STAGE_S)
            if self.sandboxes is not None:
                await _bounded("the sandbox service", self.sandboxes.close_all(), STOP_STAGE_S)
            if self.workers is not None:
                self.workers.hub.stopping()  # sets a flag
            await _bounded("the jobs", self.jobs.close(), STOP_STAGE_S)
            if self.workers is not None:
                await _bounded("the workers", self.workers.stop(), STOP_STAGE_S + 10)
                await _bounded("the sweep of lost workers' sandboxes", _swept(self.backend), STOP_STAGE_S)
            if self.pool is not None:
                drain_s = STOP_STAGE_S + self.pool.idle_total * REMOVE_BUDGET_S  # it destroys every idle sandbox
                await _bounded("the warm pool", self.pool.close(), drain_s)
            if self._metrics_server is not None:
                await _bounded("the metrics server", asyncio.to_thread(self._metrics_server.shutdown), STOP_STAGE_S)
        finally:  # whatever failed above: the result log, the data directory and the containers are let go
            try:
                # the log and the data directory first: the containers' removal waits on the engine, one call of up
                # to api_timeout_s at a time while it does not answer, and held the next server off the data
                # directory meanwhile (this instance's containers are no other server's to sweep)
                try:
                    await self.store.close()
                finally:
                    if self._data_lock is not None:  # after the log's close: the next server may open it now
                        os.close(self._data_lock)
                        self._data_lock = None
                await self.backend.close()
            finally:
                await self.stalls.stop()
                if self._private_dir is not None:
                    shutil.rmtree(self._private_dir, ignore_errors=True)
                await _bounded("the trace export", asyncio.to_thread(self.tracer.shutdown), STOP_STAGE_S)


def _private_data_dir(path: Path) -> None:
    """The data directory, entered by this user alone: it holds every tenant's rollouts and job specs (their
    policies' API keys among them), and was made with the umask's 0755, its result log 0644, for any local user."""
    try:
        path.mkdir(mode=0o700, parents=True)  # a new one is this user's from the start (its parents: the umask's)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot make the data directory {path} (--data-dir): {e.strerror}") from None
    if not path.is_dir():
        raise ConfigError(f"the data directory {path} (--data-dir) is not a directory")
    if stat.S_IMODE(path.stat().st_mode) & 0o077:
        log.warning("data directory %s was open to other users; it is 0700 now", path)
        path.chmod(0o700)


DATA_LOCK_FILE = "lock"


def lock_data_dir(path: Path) -> int:
    """Hold the data directory for this server alone (an flock the kernel drops when the process dies, however it
    dies): two servers on one directory both resumed its unfinished jobs, ran each rollout twice and wrote one result
    log. Returns the lock's descriptor; ConfigError naming the holder when another server has it."""
    fd = os.open(path / DATA_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):  # ENOLCK, EOPNOTSUPP: NFS without locks, some FUSE
            os.close(fd)
            raise ConfigError(
                f"data directory {path} cannot be locked ({e.strerror}): it must be on a file system with flock "
                "(a local disk); put it there"
            ) from None
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise ConfigError(
            f"data directory {path} is in use by another envfleet server (pid {holder or 'unknown'}); stop it, or "
            "give this one a data directory of its own (--data-dir)"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


async def _swept(backend: SandboxBackend) -> None:
    await backend.sweep()


async def _bounded(what: str, stage: Awaitable[None], limit_s: float) -> None:
    """One stage of the stop, within `limit_s`; one that overruns or fails is logged and the stop goes on (a sweep
    that raised on an engine answering 500 skipped every later stage: the pool, the backend's close that removes
    this instance's containers, the store's close)."""
    try:
        async with asyncio.timeout(limit_s):
            await stage
    except TimeoutError:
        log.error("shutdown: %s did not stop within %gs; going on (the backend removes what is left)", what, limit_s)
    except Exception:
        log.exception("shutdown: %s failed; going on (the backend removes what is left)", what)


async def create_server(
    config: OrchestratorConfig, registry: Registry | None = None, *, tracer: Tracer | None = None
) -> Orchestrator:
    """Open the store, sweep and start the backend, resume unfinished jobs, and serve. `tracer` replaces the one
    `config.tracing` makes, for this process only (tests pass an in-memory exporter)."""
    # configuration problems are refused before anything is opened
    check_transport(config.host, config.security)
    if config.ui_port is not None:  # the viewer speaks plain HTTP: its host is checked as a server without TLS
        check_transport(config.ui_host, config.security.model_copy(update={"tls": None}))
    if config.openenv is not None:  # plain HTTP too
        check_transport(config.openenv.host, config.security.model_copy(update={"tls": None}))
    if config.worker_listen:
        listener = config.worker_tls.listener(config.security.tls)
        check_worker_transport(config.worker_listen, listener, config.security.insecure)
    auth = Authenticator.from_config(config.security)
    tracer = tracer or make_tracer(config.tracing, "envfleet")
    tls = config.security.tls
    credentials = server_credentials(tls) if tls else None
    # what killed control planes and workers of this host left in the temp directory (their sockets, archives)
    await asyncio.to_thread(sweep_private_dirs)
    _private_data_dir(config.data_dir)
    data_lock = lock_data_dir(config.data_dir)
    with_workers = config.workers or config.worker_listen or config.ray
    # what has started so far is stopped again if a later step fails (a port taken, a store that will not open):
    # local workers and Ray actors outlived a failed start, and the backend's sweeper and pool ran on
    undo = contextlib.AsyncExitStack()
    undo.callback(os.close, data_lock)
    try:
        identity = await worker_identity(config) if with_workers else None
        store = await ResultStore.open(
            config.data_dir / "results.sqlite3", synchronous=config.result_log_sync, acked=config.result_log_acked
        )
        undo.push_async_callback(store.close)
        fleet = await start_fleet(config.backend)
        backend, images = fleet.backend, fleet.images
        undo.push_async_callback(backend.close)
        registry = registry or Registry.from_entry_points()
        for reference in config.environments:
            registry.load(reference)
        registrar = Registrar(
            registry,
            backend,
            fleet.build_spec_image,
            SpecStore(config.data_dir / "environments"),
            caps=config.caps.sandbox,
            archives=ArchiveStore(config.data_dir / "environments" / "archives"),
            archive_caps=config.caps.archive,
            kinds=load_kinds(),
            spec_bytes_per_tenant=config.caps.spec_bytes_per_tenant,
            check_s=config.caps.registration_check_s,
            environments_per_tenant=config.caps.environments_per_tenant,
        )
        await registrar.load()
        metrics = Metrics()
        pool = SandboxPool(backend, config.pool, metrics)
        pool.start()
        undo.push_async_callback(pool.close)
        workers: WorkerPlane | None = None
        executor: Executor
        if with_workers:
            workers = await WorkerPlane.start(config, images, registrar.catalog, identity)
            undo.push_async_callback(workers.stop)
            executor = workers.hub
        else:
            executor = LocalExecutor(RolloutRunner(pool, images, tracer), TokenizerCache(config.tokenizer_dirs))
        policy_urls, tokenizers = PolicyURLs(config.security.policy_urls), TokenizerDirs(config.tokenizer_dirs)

        def admit(spec: JobSpec) -> None:  # what SubmitJob checks besides the request's form: for resumed jobs
            policy_urls.check(spec.policy.base_url)
            if spec.token_mode == "tito":
                tokenizers.resolve(spec.policy.tokenizer)

        jobs = await JobManager.start(
            store,
            registry,
            executor,
            config.max_in_flight,
            metrics=metrics,
            capacity=config.capacity,
            caps=config.caps,
            tracer=tracer,
            retention_s=config.job_retention_s,
            admit=admit,
            held_envs=registrar.unloaded,
        )
        undo.push_async_callback(jobs.close)
        jobs.scheduler.tenant_shares = auth.enabled  # a server without tokens has one user, who may take the host
        # read when scraped
        metrics.queue_waiting_for_images.set_function(lambda: jobs.scheduler.waiting_for_images)
        metrics.result_log_bytes.set_function(store.size_bytes)
        metrics.sandboxes_held.set_function(lambda: jobs.scheduler.reserved)
        if workers is not None:
            hub = workers.hub
            # read on the metrics server's thread: plain reads, never an iteration of what the event loop changes
            metrics.export_workers(lambda: hub.connected, lambda: hub.slots, lambda: hub.waiting, lambda: hub.lost)
        fleet.export_metrics(metrics)
        server = grpc.aio.server(
            interceptors=[
                AuthInterceptor(auth),
                ErrorInterceptor({"/envfleet.v1.SessionService/Step": MAX_STEP_REQUEST_BYTES}),
                TenantCallsInterceptor(auth, config.caps.calls_per_tenant),  # inside: its refusal becomes a status
            ],
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.max_send_message_length", config.max_message_bytes),
                # no bandwidth probing: it grows a stream's receive window toward tens of MiB on loopback, and a
                # client-streaming call (ExecStream stdin, Upload) then holds that much here before a handler reads
                # it. 8 ExecStreams of 100 MiB grew the server by 93-771 MiB with it (two clean-clone runs failed the
                # 400 MiB bound of tests/security/test_buffers.py), 56-77 MiB without; stdin throughput 10-20% lower
                # (README)
                ("grpc.http2.bdp_probe", 0),
                NO_SHARED_PORT,
                # a client whose host is gone answers no ping: its connection is cut, and its streams end
                ("grpc.keepalive_time_ms", int(config.client_keepalive_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(min(config.client_keepalive_s, 20.0) * 1000)),
                ("grpc.http2.ping_timeout_ms", int(min(config.client_keepalive_s, 20.0) * 1000)),  # newer cores
                # a stream quiet for long is pinged all along (by default the second ping without data in between
                # waits five minutes, and a third never goes)
                ("grpc.http2.max_pings_without_data", 0),
                ("grpc.http2.min_time_between_pings_ms", int(config.client_keepalive_s * 1000)),
                # and the SDK pings too (client/auth.py CHANNEL_OPTIONS), an idle stream included: allowed
                ("grpc.keepalive_permit_without_calls", 1),
                # (GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS is this name; "min_recv_ping_interval..." is
                # no option, and with it gRPC's default held: a ping every 5 minutes, the third too soon a GOAWAY)
                ("grpc.http2.min_ping_interval_without_data_ms", CLIENT_PING_MIN_MS),
            ],
        )
        # sessions and raw sandboxes share the host's capacity with rollouts: they reserve it through the scheduler
        sessions = SessionManager.start(
            config.sessions, registry, pool, images, caps=config.caps.sandbox, admission=jobs.scheduler
        )
        undo.push_async_callback(sessions.close_all)
        sandboxes = SandboxManager.start(
            config.sandboxes, registry, backend, images, fleet.image_present, caps=config.caps, admission=jobs.scheduler
        )
        undo.push_async_callback(sandboxes.close_all)
        unread = unread_replies(config.caps.read_bytes_per_tenant)  # one budget for the three list calls
        orchestrator_pb2_grpc.add_EnvironmentServiceServicer_to_server(
            EnvironmentService(registry, registrar, auth, unread), server
        )
        orchestrator_pb2_grpc.add_RolloutServiceServicer_to_server(
            RolloutService(
                jobs,
                auth,
                policy_urls,
                tokenizers,
                ReplayGate(config.security.replay_reference, auth, registrar.registered_by),
                unread,
            ),
            server,
        )
        orchestrator_pb2_grpc.add_SessionServiceServicer_to_server(SessionService(sessions, auth), server)
        orchestrator_pb2_grpc.add_SandboxServiceServicer_to_server(SandboxService(sandboxes, auth, unread), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if config.reflection if config.reflection is not None else tls is None:
            names = [s.full_name for s in orchestrator_pb2.DESCRIPTOR.services_by_name.values()]
            reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        address = host_port(config.host, config.port)
        port = listen(server, address, credentials, "--host, --port")
        private_dir = None
        if config.openenv is not None:
            # the facade calls this server as a client, with its callers' tokens (the interceptor checks them), over a
            # unix socket in a private folder: no TLS to set up for a call that never leaves the process's host
            private_dir = await asyncio.to_thread(make_private_dir, "openenv")
            undo.callback(shutil.rmtree, private_dir, ignore_errors=True)
            server.add_insecure_port(f"unix:{private_dir / 'grpc.sock'}")
        await server.start()
        undo.push_async_callback(server.stop, 0)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    except BaseException:
        await undo.aclose()
        raise
    undo.pop_all()
    log.info(
        "orchestrator serving on %s:%d (%s, %s; data in %s)",
        config.host,
        port,
        "TLS" + (" with client certificates" if tls and tls.client_ca_file else "") if tls else "plaintext",
        "bearer tokens" if auth.enabled else "no auth (local tenant)",
        config.data_dir,
    )
    orch = Orchestrator(config, server, port, jobs, backend, store, health_servicer, tracer)
    orch._private_dir, orch._data_lock = private_dir, data_lock
    orch.stalls.start()

    pending: set[asyncio.Task[None]] = set()
    # the health check says SERVING only while the server can do work: the docker engine answers, and the scheduler's
    # loop runs (once it died no rollout started, and a health check that still said SERVING kept the process up)
    serving = {"engine": True, "scheduler": True}

    def healthy(part: str, ok: bool) -> None:
        serving[part] = ok
        up = all(serving.values())
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        task = asyncio.get_running_loop().create_task(health_servicer.set("", status))
        pending.add(task)
        task.add_done_callback(pending.discard)

    fleet.watch_health(functools.partial(healthy, "engine"))
    jobs.scheduler.on_failure(functools.partial(healthy, "scheduler", False))
    orch.pool, orch.metrics = pool, metrics
    orch.sessions, orch.sandboxes, orch.registrar = sessions, sandboxes, registrar
    orch.workers = workers
    # past this point the undo stack is spent: the servers below that fail to start (a metrics or viewer host this
    # machine lacks) stop everything that did, or the gRPC server, workers and sandboxes ran on behind the error
    try:
        if config.metrics_port is not None:
            # with rollout workers, theirs too (sandboxes, pools, engine calls), from their heartbeats
            served = (
                metrics.registry if workers is None else fleet_registry(metrics.registry, workers.hub.metric_snapshots)
            )
            try:
                orch._metrics_server, _ = start_http_server(
                    config.metrics_port, addr=config.metrics_host, registry=served
                )
            except OSError as e:
                if config.metrics_port != DEFAULT_METRICS_PORT:  # the operator's port: a scrape of it reads another
                    raise ConfigError(
                        f"cannot serve metrics on {host_port(config.metrics_host, config.metrics_port)} "
                        f"(--metrics-port): {e.strerror or e}"
                    ) from None
                # the default taken (another orchestrator on this host): serve metrics elsewhere, and say where
                log.warning("metrics port %d unavailable (%s); using a free port", config.metrics_port, e)
                orch._metrics_server, _ = start_http_server(0, addr=config.metrics_host, registry=served)
            orch.metrics_port = orch._metrics_server.server_port
            log.info("metrics on http://%s:%d/metrics (unauthenticated)", config.metrics_host, orch.metrics_port)
        if config.ui_port is not None:
            header_tenant = lambda h: auth.tenant_of_metadata([("authorization", h)] if h else [])  # noqa: E731
            try:
                orch.ui = start_live_viewer(
                    jobs, store.path, config.ui_host, config.ui_port, header_tenant, auth.enabled
                )
            except OSError as e:  # the operator's port (the viewer has no default): bookmarks name it
                raise ConfigError(
                    f"cannot serve the viewer on {host_port(config.ui_host, config.ui_port)} (--ui-port): "
                    f"{e.strerror or e}"
                ) from None
            log.info("trajectory viewer on %s", orch.ui.url)
        if config.openenv is not None and private_dir is not None:
            from orchestrator.openenv.serving import start_facade  # the optional extra, loaded only here

            orch.openenv = await start_facade(config.openenv, f"unix:{private_dir / 'grpc.sock'}")
    except BaseException:
        await orch.stop(grace=0)
        raise
    orch._serving = write_serving(config.data_dir, config.host, port, tls.cert_file if tls else None)
    return orch


SERVING_FILE = "serving.json"


def write_serving(data_dir: Path, host: str, port: int, cert: Path | None) -> str:
    """Where this server listens, in its data directory, for the container's health probe (cli/healthcheck.py): the
    port and TLS may come from a flag, a variable or the config file, and the probe read the variables alone, so a
    server configured by its file or its flags was reported unhealthy. Replaced whole (a rename); returns the
    server's instance id in it (every container's server is pid 1: the pid names no one server)."""
    instance = secrets.token_hex(8)
    info = {
        "host": host,
        "port": port,
        "tls_cert": str(cert.resolve()) if cert else None,
        "pid": os.getpid(),
        # with the pid, names this process across pid reuse: a container's server is pid 1 at every start
        "started": proc_start_time(os.getpid()),
    }
    tmp = data_dir / f".{SERVING_FILE}.{instance}"
    try:
        tmp.write_text(json.dumps({**info, "instance": instance}))
        tmp.replace(data_dir / SERVING_FILE)
    except OSError as e:  # the probe then goes by the variables, or by an older server's file whose pid is gone
        log.warning("could not write %s: %s", data_dir / SERVING_FILE, e)
    return instance


def forget_serving(data_dir: Path, instance: str) -> None:
    """Remove this server's serving file (a server stopping is no longer where the probe should look)."""
    path = data_dir / SERVING_FILE
    with contextlib.suppress(OSError, ValueError, AttributeError):
        if instance and json.loads(path.read_text()).get("instance") == instance:
            path.unlink()
