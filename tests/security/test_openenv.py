"""The OpenEnv facade's threat model: it authenticates like the API (the orchestrator checks each caller's own
token, at the handshake and on every call), without tokens it answers loopback names and no foreign page, it never
listens off loopback unless told, it caps frames and open websockets, and it serves no route that opens a sandbox
outside a websocket's lifetime."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus

from orchestrator.core.errors import ConfigError
from orchestrator.openenv.config import OpenEnvConfig, check_facade_host
from orchestrator.openenv.serving import start_facade
from tests.conftest import until
from tests.openenv.facade import env_client, facade_url, http_get, open_sessions, ws_connect
from tests.orchestrator.servers import FAKE, serve

TOKEN_A, TOKEN_B = secrets.token_urlsafe(24), secrets.token_urlsafe(24)


def _tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(f"tokens:\n  {TOKEN_A}: team-a\n  {TOKEN_B}: team-b\n")
    return path


async def _refused(status: int, *args: object, **kw: object) -> str:
    with pytest.raises(InvalidStatus) as e:
        async with ws_connect(*args, **kw):  # type: ignore[arg-type]
            pass
    assert e.value.response.status_code == status, e.value.response
    return e.value.response.body.decode() if e.value.response.body else ""


async def test_callers_need_a_token_the_orchestrator_accepts(tmp_path: Path) -> None:
    security = {"token_file": _tokens(tmp_path)}
    async with serve(tmp_path / "data", backend=FAKE, security=security, openenv={"port": 0}) as orch:
        url = facade_url(orch)
        assert "missing bearer token" in await _refused(401, url)
        assert "invalid bearer token" in await _refused(401, url, token="x" * 32)
        with pytest.raises(ConnectionError, match="HTTP 401"):
            await env_client(url).connect()  # OpenEnv's own client, without headers
        status, body = await http_get(url, "/envs/python-tool/schema")
        assert status == 401 and "missing bearer token" in body["detail"]
        status, _ = await http_get(url, "/envs", Authorization="Bearer nonsense-nonsense-nonsense")
        assert status == 401
        assert (await http_get(url, "/health"))[0] == 200  # a probe needs no token
        assert open_sessions(orch) == 0

        async with env_client(url, token=TOKEN_A) as env:
            r = await env.reset(task_id="py-000")
            assert r.metadata["task_id"] == "py-000"
            assert open_sessions(orch, "team-a") == 1  # the session is the caller's tenant's
        await until(lambda: open_sessions(orch) == 0, "closed")


async def test_open_websockets_are_capped_per_caller(tmp_path: Path) -> None:
    security = {"token_file": _tokens(tmp_path)}
    openenv = {"port": 0, "max_connections_per_caller": 1}
    async with serve(tmp_path / "data", backend=FAKE, security=security, openenv=openenv) as orch:
        url = facade_url(orch)
        async with ws_connect(url, token=TOKEN_A):
            assert "1 websockets are open with this token" in await _refused(429, url, token=TOKEN_A)
            # the orchestrator reads these as the same token: each counted as a caller of its own, one tenant
            # could hold every websocket of the facade
            for written in (f"bearer {TOKEN_A}", f"BEARER {TOKEN_A}", f"Bearer   {TOKEN_A}", f" Bearer {TOKEN_A} "):
                assert "1 websockets are open" in await _refused(429, url, authorization=written)
            async with ws_connect(url, token=TOKEN_B):  # another caller is not held up
                pass
        async with ws_connect(url, token=TOKEN_A):  # the slot is free again once the first one closed
            pass


async def test_without_tokens_only_loopback_names_and_no_foreign_page(tmp_path: Path) -> None:
    async with serve(tmp_path, backend=FAKE, openenv={"port": 0}) as orch:
        url = facade_url(orch)
        status, body = await http_get(url, "/envs", Host="evil.example:80")  # a rebound DNS name
        assert status == 403 and "loopback host names only" in body["detail"]
        assert "may not use this facade" in await _refused(403, url, origin="http://evil.example")
        async with ws_connect(url, origin="http://localhost:3000"):  # a local page is this machine's user
            pass
        assert (await http_get(url, "/envs"))[0] == 200


async def test_the_facade_stays_on_loopback_unless_told(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"refusing to serve on '0\.0\.0\.0'"):
        async with serve(tmp_path, backend=FAKE, openenv={"port": 0, "host": "0.0.0.0"}):
            pass
    with pytest.raises(ConfigError, match="plain HTTP, so bearer tokens would cross the network in clear"):
        check_facade_host("0.0.0.0", insecure=False)
    check_facade_host("127.0.0.1", insecure=False)
    async with serve(tmp_path / "data", backend=FAKE) as orch:
        # a facade that lends its own token to callers without one: never reachable from another machine
        with pytest.raises(ConfigError, match="would act as that token's tenant"):
            await start_facade(OpenEnvConfig(host="0.0.0.0", port=0), orch.address, token=TOKEN_A, insecure=True)


async def test_an_oversized_frame_closes_the_socket_and_its_session(tmp_path: Path) -> None:
    async with serve(tmp_path, backend=FAKE, openenv={"port": 0, "max_message_bytes": 4096}) as orch:
        async with ws_connect(facade_url(orch)) as ws:
            await ws.send('{"type": "reset", "data": {"task_id": "py-000"}}')
            assert '"observation"' in await ws.recv()
            assert open_sessions(orch) == 1
            await ws.send('{"type": "step", "data": {"answer": "' + "x" * 8192 + '"}}')
            with pytest.raises(ConnectionClosed) as e:
                await ws.recv()
            assert e.value.rcvd is not None and e.value.rcvd.code == 1009  # message too big
        await until(lambda: open_sessions(orch) == 0, "closed")


async def test_no_route_opens_a_sandbox_outside_a_websocket(tmp_path: Path) -> None:
    async with serve(tmp_path, backend=FAKE, openenv={"port": 0}) as orch:
        url = facade_url(orch)
        # OpenEnv's stateless reset/step, its MCP and task routes: each would open sessions nothing closes
        for method, path, status in [
            ("POST", "/envs/python-tool/reset", 404),
            ("POST", "/envs/python-tool/step", 404),
            ("POST", "/envs/python-tool/mcp", 404),
            ("GET", "/envs/python-tool/state", 404),
            ("POST", "/envs/python-tool/schema", 405),
            ("GET", "/list_environments", 404),
            ("GET", "/envs/python-tool/docs", 404),
        ]:
            assert (await http_get(url, path, method))[0] == status, (method, path)
        await _refused(404, url, env="python-tool/mcp")
        assert open_sessions(orch) == 0


async def test_a_websocket_cannot_attach_to_a_running_session(tmp_path: Path) -> None:
    # OpenEnv attaches a websocket to the live session its query names: another caller's frames drove the episode
    # with the first caller's token, and a reset over it opened a session that no websocket's end closed
    security = {"token_file": _tokens(tmp_path)}
    async with serve(tmp_path / "data", backend=FAKE, security=security, openenv={"port": 0}) as orch:
        url = facade_url(orch)
        for query in ("?session_id=0f1e2d3c", "?x=1&session_id=", "?session_id"):
            body = await _refused(400, url, token=TOKEN_B, query=query)
            assert "session_id: each websocket runs its own episodes" in body
        async with ws_connect(url, token=TOKEN_A, query="?x=1"):  # other parameters are no matter
            pass


async def test_the_facade_never_tells_a_caller_the_orchestrators_address(tmp_path: Path) -> None:
    # gRPC's own failure text went to any caller, token or not: "UNAVAILABLE: failed to connect to all addresses;
    # last error: ... unix:/<the control plane's private dir>/grpc.sock: connect failed" (here its TCP port)
    async with serve(tmp_path / "data", backend=FAKE) as orch:
        facade = await start_facade(OpenEnvConfig(port=0), orch.address)
        port = orch.address.rsplit(":", 1)[1]
        try:
            await orch.stop(grace=0)  # gone: the facade's calls fail in gRPC's transport
            for path in ("/envs", "/envs/python-tool/health", "/envs/python-tool/metadata"):
                status, body = await http_get(facade.url, path)
                assert status in (502, 503) and "UNAVAILABLE" in str(body), (path, status, body)
                assert port not in str(body) and "127.0.0.1" not in str(body), (path, body)
        finally:
            await facade.close()


async def test_an_idle_websocket_is_closed_with_its_session(tmp_path: Path) -> None:
    # nothing reaped a websocket whose client sent no frame: uvicorn's pings kept it open for good, its session and
    # its slot of max_connections with it
    async with serve(tmp_path / "data", backend=FAKE, openenv={"port": 0, "idle_timeout_s": 1.0}) as orch:
        url = facade_url(orch)
        async with ws_connect(url) as ws:
            await ws.send('{"type": "reset", "data": {"task_id": "py-000"}}')
            answer = await ws.recv()
            assert '"observation"' in str(answer) and open_sessions(orch) == 1, answer
            with pytest.raises(ConnectionClosed) as closed:
                async with asyncio.timeout(10):
                    await ws.recv()  # silent: closed after a second of it
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1001
        await until(lambda: open_sessions(orch) == 0, "closed")
        assert orch.openenv is not None
        await until(lambda: orch.openenv is not None and orch.openenv.app.open_connections == 0, "slot free")


async def test_the_orchestrators_own_answers_reach_the_facades_caller(tmp_path: Path) -> None:
    # hiding gRPC's transport failures hid the orchestrator's own UNAVAILABLE (a sandbox that died, a worker lost)
    # and INTERNAL (its error id) as well: the API marks the statuses it answers itself
    import grpc

    from orchestrator.core.errors import SERVER_STATUS_KEY, SandboxUnavailableError
    from orchestrator.openenv.environment import rpc_message
    from protos import orchestrator_pb2 as pb
    from protos import orchestrator_pb2_grpc as pb_grpc

    async with serve(tmp_path / "data", backend=FAKE) as orch, grpc.aio.insecure_channel(orch.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pb_grpc.EnvironmentServiceStub(channel).Describe(pb.DescribeEnvironmentRequest(name="no-such-env"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert (SERVER_STATUS_KEY, "1") in tuple(refused.value.trailing_metadata() or ())
        # an UNAVAILABLE of the orchestrator's own, end to end through the facade: its message reaches the caller

        def down(*args: object) -> None:
            raise SandboxUnavailableError("the sandbox backend is down: try again shortly")

        orch.jobs.registry.lookup = down  # type: ignore[method-assign,assignment]
        facade = await start_facade(OpenEnvConfig(port=0), orch.address)
        try:
            status, body = await http_get(facade.url, "/envs/python-tool/metadata")
        finally:
            await facade.close()
    assert status == 503 and body["detail"] == "UNAVAILABLE: the sandbox backend is down: try again shortly", body
    ours = grpc.aio.Metadata((SERVER_STATUS_KEY, "1"))
    for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL):
        answered = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), ours, "sandbox s-1 died: its envd is gone")
        assert rpc_message(answered) == f"{code.name}: sandbox s-1 died: its envd is gone"
        transport = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "unix:/private/grpc.sock")
        assert "private" not in rpc_message(transport) and rpc_message(transport).startswith(code.name)
