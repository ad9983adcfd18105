"""Fixtures for the orchestrator: a scripted policy server and orchestrators serving real gRPC on loopback, on real
Docker (`orchestrator`, `client`) or on the fake backend (`fake_orchestrator`, `fake_client`: control-plane tests)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from orchestrator.backends.config import DockerBackendConfig, FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.testing.scripted_policy import Script, ScriptedServer, start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.conftest import TEST_OWNER

ENV = "python-tool"


@pytest.fixture
def registry() -> Registry:
    return Registry.from_entry_points()


@pytest.fixture
def task_ids(registry: Registry) -> list[str]:
    return [t.id for t in registry.get(ENV).tasks()]


ScriptFactory = Callable[[Script], "AsyncIterator[ScriptedServer]"]


@pytest.fixture
async def policy_server(registry: Registry) -> AsyncIterator[ScriptedServer]:
    """The scripted policy replaying the reference solution of every python-tool task."""
    server = await start_scripted_server(reference_script(registry.get(ENV)))
    yield server
    await server.close()


@pytest.fixture
async def slow_policy(registry: Registry) -> AsyncIterator[ScriptedServer]:
    """The reference solutions, 0.3 s per completion: a job lasts long enough to lose a worker in the middle."""
    script = reference_script(registry.get(ENV)).model_copy(update={"latency_s": 0.3})
    server = await start_scripted_server(script)
    yield server
    await server.close()


@pytest.fixture
async def orchestrator(tmp_path: Path, base_image: str) -> AsyncIterator[Orchestrator]:
    """An orchestrator on a free loopback port with its own data dir; stopped (sandboxes destroyed) afterwards."""
    orch = await create_server(
        OrchestratorConfig(port=0, data_dir=tmp_path / "data", backend=DockerBackendConfig(owner=TEST_OWNER))
    )
    yield orch
    await orch.stop(grace=1)


@pytest.fixture
async def client(orchestrator: Orchestrator) -> AsyncIterator[EnvfleetClient]:
    async with EnvfleetClient(orchestrator.address) as c:
        yield c


@pytest.fixture
async def fake_orchestrator(tmp_path: Path) -> AsyncIterator[Orchestrator]:
    """An orchestrator on the fake backend: real gRPC, jobs, store and scheduler; no Docker."""
    orch = await create_server(
        OrchestratorConfig(port=0, data_dir=tmp_path / "data", backend=FakeBackendConfig(owner=TEST_OWNER))
    )
    yield orch
    await orch.stop(grace=1)


@pytest.fixture
async def fake_client(fake_orchestrator: Orchestrator) -> AsyncIterator[EnvfleetClient]:
    async with EnvfleetClient(fake_orchestrator.address) as c:
        yield c


def job(url: str, ids: list[str], n: int = 1, **kw: object) -> JobSpec:
    """A python-tool job on the given task ids."""
    return JobSpec.model_validate(
        {
            "env": ENV,
            "tasks": TaskSelection(kind="ids", ids=ids),
            "group_size": n,
            "policy": PolicyEndpoint(base_url=url, model="scripted", version="v1"),
            **kw,
        }
    )
