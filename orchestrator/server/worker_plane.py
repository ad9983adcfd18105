"""The control plane's worker side, wired: the hub, the worker wire's gRPC server (a unix socket in a private
directory, and TCP when remote workers join: TLS whenever the server has a certificate, mTLS with
`worker_tls.client_ca_file`), and this host's supervised worker processes."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from orchestrator.backends.config import DockerBackendConfig
from orchestrator.client.auth import ClientTLS
from orchestrator.core.environment import ImageSource
from orchestrator.core.net import NO_SHARED_PORT, listen
from orchestrator.core.private_dirs import make_private_dir
from orchestrator.server.security import server_credentials
from orchestrator.service.archives import ArchiveCatalog
from orchestrator.worker.config import WorkerConfig
from orchestrator.worker.hub import WorkerHub
from orchestrator.worker.identity import FleetIdentity, fresh_identity, load_identity
from orchestrator.worker.ray_fleet import RayWorkers
from orchestrator.worker.results import MAX_WIRE_BYTES
from orchestrator.worker.servicer import WorkerServicer
from orchestrator.worker.spawn import LocalWorkers
from protos import worker_pb2_grpc as wpb_grpc

if TYPE_CHECKING:
    from orchestrator.server.app import OrchestratorConfig

log = logging.getLogger(__name__)

SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_WIRE_BYTES),
    ("grpc.max_send_message_length", MAX_WIRE_BYTES),
    # workers ping every 10 s; allow it without data in flight
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    NO_SHARED_PORT,
]


async def worker_identity(config: OrchestratorConfig) -> FleetIdentity:
    """The fleet's id and worker token. Remote workers may outlive this process and redial the next one, so with
    `worker_listen` (or an operator's token file) both are kept in the data dir; local workers die with this
    process, so theirs is fresh. ConfigError names a token file that is unsafe."""
    if config.worker_listen or config.worker_token_file:
        return await asyncio.to_thread(load_identity, config.data_dir, config.worker_token_file)
    return fresh_identity()


def _host_share(config: OrchestratorConfig, workers: int) -> dict[str, Any]:
    """What each of `workers` processes on one host gets of the host's budgets: its warm pool's idle sandboxes, its
    group snapshots' memory and, on Docker, its execs at once."""
    share: dict[str, Any] = {"pool": config.pool.shared_by(workers), "host_share": workers}
    if isinstance(config.backend, DockerBackendConfig):
        share["backend"] = config.backend.shared_by(workers)
    return share


class WorkerPlane:
    """Rollout workers of one control plane. Remote workers (Ray actors) need `tcp_address` and `token`."""

    def __init__(
        self, hub: WorkerHub, server: grpc.aio.Server, socket_dir: Path, token: str, local: LocalWorkers | None
    ) -> None:
        self.hub = hub
        self.token = token
        self.local = local
        self.ray: RayWorkers | None = None
        self.tcp_address: str | None = None
        self._server = server
        self._socket_dir = socket_dir

    @property
    def unix_target(self) -> str:
        """Where workers of this host connect."""
        return f"unix:{self._socket_dir / 'workers.sock'}"

    @classmethod
    async def start(
        cls,
        config: OrchestratorConfig,
        images: ImageSource,
        archives: ArchiveCatalog | None = None,
        identity: FleetIdentity | None = None,
    ) -> WorkerPlane:
        """Serve the worker wire and start `config.workers` local worker processes; `archives` says which
        environments the workers get as uploaded archives, `identity` the fleet's (worker_identity)."""
        tls = config.worker_tls.listener(config.security.tls) if config.worker_listen else None
        credentials = server_credentials(tls) if tls else None  # files are read before anything starts
        ray_tls: ClientTLS | None = None
        if tls is not None and config.ray is not None:
            ray_tls = config.worker_tls.for_workers()
            if ray_tls.root_certificates is None:
                log.warning("Ray workers verify this control plane by the system's roots; --worker-tls-ca names a CA")
        hub = WorkerHub(images, heartbeat_timeout_s=config.worker_heartbeat_timeout_s, archives=archives)
        identity = identity or await worker_identity(config)
        token = identity.token
        server = grpc.aio.server(options=SERVER_OPTIONS)
        wpb_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(hub, token), server)
        # a fresh 0700 directory: no other host account can reach the socket, and no one can plant one; marked as
        # ours, so that the next start removes it if this process is killed (create_server sweeps)
        socket_dir = await asyncio.to_thread(make_private_dir, "workers")
        plane = cls(hub, server, socket_dir, token, None)
        try:
            server.add_insecure_port(plane.unix_target)
            if config.worker_listen:
                host = config.worker_listen.rsplit(":", 1)[0]
                # TLS unless loopback, or the operator passed insecure (create_server checked)
                port = listen(server, config.worker_listen, credentials, "--worker-listen")
                plane.tcp_address = f"{host}:{port}"
            await server.start()
        except BaseException:
            shutil.rmtree(socket_dir, ignore_errors=True)
            raise
        worker_config = WorkerConfig(
            backend=config.backend,
            pool=config.pool,
            environments=config.environments,
            tracing=config.tracing,
            tokenizer_dirs=config.tokenizer_dirs,
        )
        if config.workers:
            slots = -(-config.max_in_flight // config.workers)
            local_config = worker_config.model_copy(update={"slots": slots, **_host_share(config, config.workers)})
            local = plane.local = LocalWorkers(config.workers, plane.unix_target, token, local_config)
            hub.local_pids = lambda: local.pids
            hub.on_local_lost = local.lost
            local.start()
        if config.ray is not None and plane.tcp_address is not None:
            plane.ray = RayWorkers(
                config.ray,
                plane.tcp_address,
                token,
                worker_config.model_copy(
                    update={**_host_share(config, config.ray.per_node), "orphan_after_s": config.ray.orphan_after_s}
                ),
                identity.fleet_id,
                tls=ray_tls,
                insecure=config.security.insecure,
                connected=lambda: [w.worker_id for w in hub.workers()],
            )
            try:
                await plane.ray.start()
            except BaseException:
                await plane.stop()
                raise
        log.info(
            "rollout workers connect at %s%s; %d local worker process(es)",
            plane.unix_target,
            f" and {plane.tcp_address} ({'mTLS' if tls and tls.client_ca_file else 'TLS' if tls else 'plaintext'})"
            if plane.tcp_address
            else "",
            config.workers,
        )
        return plane

    async def stop(self) -> None:
        """Stop the workers (they destroy their sandboxes), then the worker wire."""
        try:
            await self.hub.close()
            # side by side: each may wait a minute for its workers to destroy their sandboxes, and the shutdown
            # stage holds one such wait; one after the other, a slow local stop left the Ray actors running
            await asyncio.gather(*(fleet.stop() for fleet in (self.local, self.ray) if fleet is not None))
            await self._server.stop(1)
        finally:
            # also when a stage overran and this was cancelled; a socket and a marker: no work for a thread
            shutil.rmtree(self._socket_dir, ignore_errors=True)
