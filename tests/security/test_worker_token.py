"""The worker token outlives a control-plane restart (so remote workers can rejoin) without becoming a weaker secret:
it is kept in a 0600 file of the data dir, a worker with a wrong or rotated-out token is refused after the restart
(UNAUTHENTICATED), and a token file that others could read, a link, or a short token is refused at start."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.core.errors import ConfigError
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.worker.identity import FLEET_ID_FILE, TOKEN_FILE
from protos import worker_pb2 as wpb
from protos import worker_pb2_grpc as wpb_grpc
from tests.conftest import TEST_OWNER
from tests.orchestrator.servers import expect_error
from tests.orchestrator.worker_wire import ScriptedWorker


async def _never(_: wpb.Assignment) -> None:
    await asyncio.Event().wait()


async def _plane(data: Path, **options: object) -> Orchestrator:
    config = OrchestratorConfig.model_validate(
        {
            "port": 0,
            "data_dir": data,
            "backend": FakeBackendConfig(owner=TEST_OWNER),
            "worker_listen": "127.0.0.1:0",
            **options,
        }
    )
    return await create_server(config)


async def _joins(orch: Orchestrator, token: str) -> None:
    assert orch.workers is not None and orch.workers.tcp_address is not None
    async with ScriptedWorker(orch.workers.tcp_address, _never, worker_id="w-good", token=token):
        await orch.workers.hub.wait_for_workers(1, timeout_s=30)


async def _refused(orch: Orchestrator, token: str) -> None:
    """A worker dialling with `token` is refused before its hello is read. The stream sends nothing: a write racing
    the server's refusal would surface as the client's own INTERNAL error instead of the server's status."""
    assert orch.workers is not None and orch.workers.tcp_address is not None
    quiet = asyncio.Event()
    joined = len(orch.workers.hub.workers())

    async def nothing() -> AsyncIterator[wpb.WorkerMessage]:
        await quiet.wait()
        return
        yield

    async with grpc.aio.insecure_channel(orch.workers.tcp_address) as channel:
        call = wpb_grpc.WorkerServiceStub(channel).Connect(nothing(), metadata=(("authorization", f"Bearer {token}"),))
        try:
            details = await expect_error(asyncio.wait_for(call.read(), 30), grpc.StatusCode.UNAUTHENTICATED)
        finally:
            quiet.set()
    assert "worker token" in details
    assert len(orch.workers.hub.workers()) == joined, "a refused worker never joins"


def _token(data: Path) -> str:
    path = data / TOKEN_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, oct(path.stat().st_mode)
    return path.read_text().strip()


async def test_the_worker_token_survives_a_restart_and_a_wrong_or_rotated_one_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    orch = await _plane(data)
    try:
        first = _token(data)
        assert orch.workers is not None and orch.workers.token == first
        await _joins(orch, first)
    finally:
        await orch.stop(grace=0)
    fleet_id = (data / FLEET_ID_FILE).read_text()

    orch = await _plane(data)  # restarted on the same data dir: the same token, the same fleet
    try:
        assert _token(data) == first and (data / FLEET_ID_FILE).read_text() == fleet_id
        await _refused(orch, "x" * 43)
        await _refused(orch, first[:-1] + ("A" if first[-1] != "A" else "B"))
        await _joins(orch, first)
    finally:
        await orch.stop(grace=0)

    (data / TOKEN_FILE).unlink()  # the operator rotates the token
    orch = await _plane(data)
    try:
        second = _token(data)
        assert second != first
        await _refused(orch, first)  # a worker still holding the old token
        await _joins(orch, second)
    finally:
        await orch.stop(grace=0)


async def test_an_operator_token_file_must_be_private_and_is_used_as_given(tmp_path: Path) -> None:
    data = tmp_path / "data"
    given = tmp_path / "token"
    given.write_text("t" * 40 + "\n")
    given.chmod(0o644)
    with pytest.raises(ConfigError, match=r"readable by others .*chmod 600"):
        await _plane(data, worker_token_file=given)
    link = tmp_path / "link"
    link.symlink_to(given)
    given.chmod(0o600)
    with pytest.raises(ConfigError, match="must be a regular file"):
        await _plane(data, worker_token_file=link)
    short = tmp_path / "short"
    fd = os.open(short, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"tooshort\n")
    os.close(fd)
    with pytest.raises(ConfigError, match="32-512 printable ASCII"):
        await _plane(data, worker_token_file=short)
    orch = await _plane(data, worker_token_file=given)
    try:
        await _refused(orch, "u" * 40)
        await _joins(orch, "t" * 40)
        assert not (data / TOKEN_FILE).exists(), "the operator's token is not copied into the data dir"
    finally:
        await orch.stop(grace=0)


async def test_a_token_file_in_the_data_dir_that_others_can_read_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    orch = await _plane(data)
    await orch.stop(grace=0)
    (data / TOKEN_FILE).chmod(0o640)
    with pytest.raises(ConfigError, match="readable by others"):
        await _plane(data)
