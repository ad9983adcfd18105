"""Orchestrators with a custom configuration, for tests of sessions, sandboxes, registration and auth. `serve(...)`
runs on real Docker; `serve(..., backend=FAKE)` on the fake backend."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.backends.config import DockerBackendConfig, FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import Rollout, RolloutStatus
from orchestrator.core.tracing import Tracer
from orchestrator.rollout.runner import RolloutRunner
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.service.executor import LocalExecutor
from orchestrator.service.registry import Registry
from tests.conftest import TEST_OWNER

FAKE = FakeBackendConfig(owner=TEST_OWNER)
# the image every fake backend has, for the raw sandbox API (a docker test uses the base_image fixture instead)
FAKE_BASE_IMAGE = FAKE.base_image


@contextlib.asynccontextmanager
async def silent_policy() -> AsyncIterator[str]:
    """A policy URL that accepts connections and never answers: a job's rollouts stay running, its stream open."""
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        for w in held:
            w.close()
        server.close()
        await server.wait_closed()


@contextlib.asynccontextmanager
async def serve(
    data_dir: Path, registry: Registry | None = None, *, tracer: Tracer | None = None, **config: Any
) -> AsyncIterator[Orchestrator]:
    """An orchestrator on a free loopback port, owned by the test suite; stopped (sandboxes destroyed) afterwards."""
    settings: dict[str, Any] = {"port": 0, "data_dir": data_dir, "backend": DockerBackendConfig(owner=TEST_OWNER)}
    orch = await create_server(OrchestratorConfig.model_validate({**settings, **config}), registry, tracer=tracer)
    try:
        yield orch
    finally:
        await orch.stop(grace=1)


async def expect_error(call: Any, code: grpc.StatusCode, *fragments: str) -> str:
    """Await a call (or read the first message of a stream) and check its status and message; returns the message."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        if hasattr(call, "read"):
            await call.read()
        else:
            await call
    details = e.value.details() or ""
    assert e.value.code() == code, f"{e.value.code()}: {details}"
    for fragment in fragments:
        assert fragment in details, details
    return details


async def expect_unreadable_exec_stream(address: str, frames: AsyncIterator[bytes], timeout_s: float) -> None:
    """Send ExecStream's raw `frames` (serialized messages, or bytes that are none) and check that the call ends with
    INVALID_ARGUMENT saying a message does not parse."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.stream_stream("/envfleet.v1.SandboxService/ExecStream")(frames, timeout=timeout_s)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    assert "does not parse" in str(e.value.details())


def local_runner(orch: Orchestrator) -> RolloutRunner:
    """The in-process runner of an orchestrator without rollout workers."""
    executor = orch.jobs.executor
    assert isinstance(executor, LocalExecutor), "this orchestrator runs its rollouts on workers"
    return executor.runner


def check_delivery(rollouts: list[Rollout], expected_ids: set[str]) -> None:
    """Every expected rollout once after dedup by id; a failed one carries no reward and is INFRA_ERROR."""
    by_id: dict[str, Rollout] = {}
    for r in rollouts:
        by_id.setdefault(r.id, r)  # at least once: a duplicate is dropped by id
    assert set(by_id) == expected_ids
    for r in by_id.values():
        if r.status.scored:
            assert r.reward is not None
        else:
            assert r.reward is None and r.status == RolloutStatus.INFRA_ERROR, (r.status, r.error)


async def until_done(client: EnvfleetClient, job_id: str, at_least: int, timeout_s: float, poll_s: float = 0.1) -> int:
    """Poll a job until `at_least` of its rollouts are done or `timeout_s` has passed; how many are done then (the
    caller asserts on it)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    # a remote job has no event to wait on: polled
    while (done := (await client.get_job(job_id)).done) < at_least and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(poll_s)
    return done
