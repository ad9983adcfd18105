"""A unix-socket relay in front of the docker engine's socket that can be taken down and brought back: an engine
outage (a dockerd restarting) for tests and benches, on the real engine, without stopping the host's dockerd.

Down, nothing listens on its path (a connect is refused or finds no socket, as while dockerd restarts) and every
relayed connection is cut (the calls in flight fail, as a dying dockerd's do). The sandboxes themselves run on: their
envd sockets never pass through it. The relay runs its own event loop on a thread of its own: the docker SDK's calls
block their thread (a client asks the engine's version as it is made), and one made on the caller's loop would wait
forever on a relay served by that loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

RELAY_CHUNK = 1 << 16
T = TypeVar("T")


def engine_socket() -> str:
    """The local engine's unix socket path: $DOCKER_HOST's when it names one, else the default."""
    host = os.environ.get("DOCKER_HOST", "")
    return host.removeprefix("unix://") if host.startswith("unix://") else "/var/run/docker.sock"


class EngineRelay:
    """Relays connections on `path` to the engine socket `upstream` while up."""

    def __init__(self, path: Path, upstream: str | None = None) -> None:
        self.path = path
        self.upstream = upstream or engine_socket()
        self.url = f"unix://{path}"
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._listening = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-relay", daemon=True)
        self._thread.start()

    async def up(self) -> None:
        """Listen (again) on the path."""
        await self._on_relay(self._up())

    async def down(self) -> None:
        """Stop listening, remove the socket and cut every relayed connection."""
        await self._on_relay(self._down())

    async def close(self) -> None:
        """Take it down and stop its thread."""
        await self.down()
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)
        self._loop.close()

    async def _on_relay(self, coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _up(self) -> None:
        self._listening = True
        if self._server is None:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self._server = await asyncio.start_unix_server(self._relay, path=str(self.path))

    async def _down(self) -> None:
        self._listening = False  # a connection accepted before the close whose handler starts later is cut too
        if self._server is not None:
            self._server.close()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        for pipe in list(self._pipes):
            pipe.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        if not self._listening:
            writer.transport.abort()
            return
        self._pipes.add(me)
        try:
            try:
                up_reader, up_writer = await asyncio.open_unix_connection(self.upstream)
            except BaseException:  # no engine behind it, or taken down meanwhile
                writer.transport.abort()
                return
            pumps = {asyncio.create_task(_pump(reader, up_writer)), asyncio.create_task(_pump(up_reader, writer))}
            cut = True
            try:
                done, _ = await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
                cut = any(not p.cancelled() and p.exception() is not None for p in done)  # a side hung up
            except asyncio.CancelledError:
                pass  # taken down
            finally:
                for p in pumps:
                    p.cancel()
                try:
                    await asyncio.gather(*pumps, return_exceptions=True)
                    if not cut:  # both ends said all they had: what is buffered still goes out
                        for w in (writer, up_writer):
                            w.close()
                            with contextlib.suppress(OSError):
                                await w.wait_closed()
                finally:  # cut, or taken down meanwhile: nothing of the connection stays
                    for w in (writer, up_writer):
                        w.transport.abort()
        finally:
            self._pipes.discard(me)


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of file, then close the writer's side (a half-close, as HTTP hijacked streams use)."""
    while data := await reader.read(RELAY_CHUNK):
        writer.write(data)
        await writer.drain()
    if writer.can_write_eof():
        with contextlib.suppress(OSError):
            writer.write_eof()
