"""Clients of the OpenEnv facade for tests: OpenEnv's own client, a raw websocket, plain HTTP, and a bounded wait."""

from __future__ import annotations

import asyncio
import http.client
import json
from typing import Any

from openenv.core.generic_client import GenericEnvClient
from websockets.asyncio.client import ClientConnection, connect

from orchestrator.server.app import Orchestrator

ENV = "python-tool"
TIMEOUT_S = 120.0


def env_client(base: str, env: str = ENV, token: str | None = None) -> GenericEnvClient:
    """OpenEnv's client of one environment of a facade at `base` (http://host:port)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return GenericEnvClient(base_url=f"{base}/envs/{env}", message_timeout_s=TIMEOUT_S, headers=headers)


def ws_connect(
    base: str,
    env: str = ENV,
    token: str | None = None,
    origin: str | None = None,
    authorization: str | None = None,
    query: str = "",
    **kw: Any,
) -> Any:
    """A raw websocket to an environment's /ws (for frames OpenEnv's client never sends); `authorization` is the
    header as written, instead of `Bearer <token>`."""
    authorization = authorization or (f"Bearer {token}" if token else None)
    headers = {"Authorization": authorization} if authorization else None
    url = base.replace("http://", "ws://") + f"/envs/{env}/ws{query}"
    return connect(url, additional_headers=headers, origin=origin, open_timeout=TIMEOUT_S, **kw)  # type: ignore[arg-type]


async def exchange(ws: ClientConnection, frame: str | bytes) -> dict[str, Any]:
    """Send one frame, read the answer."""
    await ws.send(frame)
    answer: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
    return answer


def _request(base: str, path: str, method: str, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, json.loads(body) if body else {}
    finally:
        conn.close()


async def http_get(base: str, path: str, method: str = "GET", **headers: str) -> tuple[int, dict[str, Any]]:
    """A plain HTTP request from a thread (the facade may run on this test's event loop); status and JSON body."""
    return await asyncio.to_thread(_request, base, path, method, {k.replace("_", "-"): v for k, v in headers.items()})


def facade_url(orch: Orchestrator) -> str:
    """The base URL of an orchestrator's in-process facade."""
    assert orch.openenv is not None, "serve(..., openenv={...})"
    return orch.openenv.url


def open_sessions(orch: Orchestrator, tenant: str | None = None) -> int:
    """Sessions holding a sandbox now."""
    assert orch.sessions is not None
    return orch.sessions.open_sessions(tenant)
