"""`start_facade(config, target)`: the OpenEnv facade served by uvicorn on the running event loop, in front of the
orchestrator at `target` (its own process's socket for `envfleet serve --openenv-port`, a remote one for
`envfleet openenv --server`). Either way the facade is a gRPC client of the orchestrator, with the callers' tokens."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import grpc
import uvicorn

from orchestrator.client.auth import ClientTLS, aio_channel, bearer_metadata, check_client_transport
from orchestrator.core.errors import ConfigError
from orchestrator.core.net import is_loopback
from orchestrator.openenv.app import FacadeApp
from orchestrator.openenv.config import OpenEnvConfig
from orchestrator.openenv.environment import Backend
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 1024
START_TIMEOUT_S = 30.0
GRACEFUL_S = 10  # open websockets get this long to close (and close their sessions) on shutdown
PROBE_TIMEOUT_S = 30.0


class _Uvicorn(uvicorn.Server):
    """uvicorn embedded in a running loop: library code installs no signal handlers; an event once listening."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Capture nothing: the CLI handles SIGTERM and SIGINT."""
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, then say so."""
        await super().startup(sockets=sockets)
        self.listening.set()


def _bind(host: str, port: int) -> socket.socket:
    # bound here, not by uvicorn: a bind error raises OSError instead of uvicorn's sys.exit, and port 0 is known
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def _auth_enabled(envs: pb_grpc.EnvironmentServiceStub, target: str, token: str | None) -> bool:
    """Whether the orchestrator wants tokens (a call without one answers UNAUTHENTICATED); and `token` is good."""
    enabled = False
    for metadata in ((), *((bearer_metadata(token),) if token else ())):
        try:
            await envs.List(pb.ListEnvironmentsRequest(), timeout=PROBE_TIMEOUT_S, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAUTHENTICATED and not metadata:
                enabled = True
                continue
            what = "refused the token" if metadata else "cannot be reached"
            raise ConfigError(f"the orchestrator at {target} {what}: {e.code().name}: {e.details()}") from None
    return enabled


class OpenEnvFacade:
    """A running facade; `close()` ends its websockets (closing their sessions), then its channel."""

    def __init__(
        self,
        app: FacadeApp,
        server: _Uvicorn,
        task: asyncio.Task[None],
        channel: grpc.aio.Channel,
        host: str,
        port: int,
    ) -> None:
        self.app = app
        self._server = server
        self._task = task
        self._channel = channel
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        """Its base URL (an environment's OpenEnv base URL is this plus /envs/<name>)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(self.host, self.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def close(self) -> None:
        """Stop listening, close every websocket (and so its session), then the channel."""
        self._server.should_exit = True
        await self._task
        await self._channel.close()


async def start_facade(
    config: OpenEnvConfig,
    target: str,
    *,
    tls: ClientTLS | None = None,
    insecure: bool = False,
    token: str | None = None,
) -> OpenEnvFacade:
    """Serve OpenEnv on config.host:config.port in front of the orchestrator at `target` (call it on the loop that
    should serve). With `token`, a caller that sends none acts with it, so the facade must listen on loopback.
    ConfigError when the orchestrator cannot be reached or refuses the token, or tokens would cross in clear."""
    if token and not is_loopback(config.host):
        raise ConfigError(
            f"refusing to serve OpenEnv on {config.host!r} with a token of its own: every caller that can reach it "
            "would act as that token's tenant; listen on 127.0.0.1"
        )
    try:
        check_client_transport(target, "the callers' tokens", tls, insecure)
    except ValueError as e:
        raise ConfigError(f"{e} (--tls-ca CA.pem, or --insecure)") from None
    channel = aio_channel(target, tls=tls, insecure=insecure)
    try:
        envs = pb_grpc.EnvironmentServiceStub(channel)
        auth_enabled = await _auth_enabled(envs, target, token)
        backend = Backend(pb_grpc.SessionServiceStub(channel), config.call_timeout_s)
        app = FacadeApp(config, backend, envs, auth_enabled, token)
        try:
            sock = _bind(config.host, config.port)
        except OSError as e:
            raise ConfigError(f"OpenEnv: cannot listen on {config.host}:{config.port}: {e.strerror}") from None
        server = _Uvicorn(
            uvicorn.Config(
                app,
                ws="auto",
                ws_max_size=config.max_message_bytes,  # a bigger frame closes the socket (1009) before it is read
                lifespan="off",
                log_config=None,  # logging is the embedding program's business
                access_log=False,
                server_header=False,
                backlog=LISTEN_BACKLOG,
                timeout_graceful_shutdown=GRACEFUL_S,
            )
        )
        task = asyncio.create_task(server.serve(sockets=[sock]), name=f"openenv-facade:{config.port}")
        listening = asyncio.ensure_future(server.listening.wait())
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                await asyncio.wait({task, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            listening.cancel()
        if task.done():
            sock.close()
            task.result()
            raise ConfigError("the OpenEnv facade stopped while starting")
    except BaseException:
        await channel.close()
        raise
    facade = OpenEnvFacade(app, server, task, channel, config.host, int(sock.getsockname()[1]))
    log.info(
        "OpenEnv on %s/envs/<env> (%s) in front of %s",
        facade.url,
        "callers' bearer tokens" if app.callers_need_tokens else "no token from callers: loopback names only",
        target,
    )
    return facade
