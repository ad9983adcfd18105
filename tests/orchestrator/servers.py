"""Orchestrators with a custom configuration, for tests of sessions, sandboxes, registration and auth. `serve(...)`
runs on real Docker; `serve(..., backend=FAKE)` on the fake backend."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.backends.config import DockerBackendConfig, FakeBackendConfig
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from tests.conftest import TEST_OWNER

FAKE = FakeBackendConfig(owner=TEST_OWNER)
# the image every fake backend has, for the raw sandbox API (a docker test uses the base_image fixture instead)
FAKE_BASE_IMAGE = FAKE.base_image


@contextlib.asynccontextmanager
async def serve(data_dir: Path, registry: Registry | None = None, **config: Any) -> AsyncIterator[Orchestrator]:
    """An orchestrator on a free loopback port, owned by the test suite; stopped (sandboxes destroyed) afterwards."""
    settings: dict[str, Any] = {"port": 0, "data_dir": data_dir, "backend": DockerBackendConfig(owner=TEST_OWNER)}
    orch = await create_server(OrchestratorConfig.model_validate({**settings, **config}), registry)
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
