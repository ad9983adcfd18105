"""Fixtures for the trainer adapters: a real orchestrator on the fake backend, the toy scripted policy and the
Qwen3-like model server double.

A test of an adapter whose trainer is not installed is skipped, saying which extra it needs; under
`make test-integrations` (ENVFLEET_REQUIRE_INTEGRATIONS=1) a missing trainer fails instead, so CI cannot pass by
skipping them.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.server.app import Orchestrator, OrchestratorConfig, create_server
from orchestrator.service.registry import Registry
from orchestrator.testing.qwen_like import QWEN_LIKE_DIR
from orchestrator.testing.scripted_policy import ScriptedServer, start_scripted_server
from orchestrator.testing.scripts import reference_script
from tests.conftest import TEST_OWNER

ENV = "python-tool"
# the Qwen-like tokenizer by name, resolved in QWEN_LIKE_DIR.parent, the orchestrator's tokenizer directory
TOKENIZER = QWEN_LIKE_DIR.name


def require(module: str, extra: str) -> ModuleType:
    """Import a trainer's module, or skip (fail under make test-integrations) naming the extra to install."""
    if os.environ.get("ENVFLEET_REQUIRE_INTEGRATIONS") == "1":
        return importlib.import_module(module)
    found: ModuleType = pytest.importorskip(
        module, reason=f"needs the `{extra}` extra: make test-integrations installs it"
    )
    return found


@pytest.fixture
def registry() -> Registry:
    return Registry.from_entry_points()


@contextlib.asynccontextmanager
async def serve(data_dir: Path, **backend: Any) -> AsyncIterator[Orchestrator]:
    """An orchestrator on the fake backend (real gRPC, jobs, sessions and scoring; sandboxes in process) that knows
    the Qwen-like tokenizer; `backend` goes to FakeBackendConfig (an exec_handler to break sandboxes)."""
    orch = await create_server(
        OrchestratorConfig(
            port=0,
            data_dir=data_dir,
            backend=FakeBackendConfig(owner=TEST_OWNER, **backend),
            tokenizer_dirs=[QWEN_LIKE_DIR.parent],
        )
    )
    try:
        yield orch
    finally:
        await orch.stop(grace=1)


@pytest.fixture
async def orchestrator(tmp_path: Path) -> AsyncIterator[Orchestrator]:
    """An orchestrator on the fake backend with the Qwen-like tokenizer configured."""
    async with serve(tmp_path / "data") as orch:
        yield orch


@pytest.fixture
async def policy_server(registry: Registry) -> AsyncIterator[ScriptedServer]:
    """The scripted policy replaying each python-tool task's reference solution (toy tokens, prefix template)."""
    server = await start_scripted_server(reference_script(registry.get(ENV)))
    yield server
    await server.close()


@pytest.fixture
async def qwen_server(registry: Registry) -> AsyncIterator[ScriptedServer]:
    """The model server double (qwen3 template) replaying each python-tool task's reference solution: <think>
    blocks, tool-call JSON spaced unlike json.dumps, non-canonical tokenizations, every sample logged."""
    server = await start_scripted_server(reference_script(registry.get(ENV)).model_copy(update={"template": "qwen3"}))
    yield server
    await server.close()
