"""uvicorn embedded in a running event loop, for the HTTP edges an envfleet process serves beside gRPC (the OpenEnv
facade) and for the scripted policy: no signal handlers (library code installs none; the CLI handles SIGTERM and
SIGINT), an event once listening, and a socket bound by us."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

LISTEN_BACKLOG = 1024


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn.Server inside a running loop: captures no signals, sets `listening` once it serves."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.listening = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Capture nothing."""
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup, then say so."""
        await super().startup(sockets=sockets)
        self.listening.set()


def bind_listener(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """A listening, non-blocking TCP socket on host:port ("" = every interface; port 0 = a free one).

    Bound here, not by uvicorn: the port is known before serving starts, and a bind error raises OSError instead of
    uvicorn's sys.exit."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock
