"""A tenant's registered environment never stands in for the server's own: a spec saved under a name that the
operator later installed as a built-in was loaded back at the next start without Register's name checks, over the
built-in, and every tenant's jobs of that name (their rewards included) ran the one tenant's environment."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.environment import Environment, Rubric, Task
from orchestrator.service.registry import Registry
from tests.orchestrator.servers import expect_error, serve
from tests.orchestrator.test_registration import to_pb, word_count_spec


class InstalledLater(Environment):
    """A built-in environment the operator installs after a tenant registered a spec of the same name."""

    name = "installed-later"
    tools = ("submit",)
    max_turns = 1
    rubric = Rubric([("one", lambda ctx: 1.0, 1.0)])

    def tasks(self) -> Sequence[Task]:
        return [Task(id="t", prompt="submit")]


async def test_a_saved_tenant_environment_never_replaces_a_built_in_of_its_name(tmp_path: Path) -> None:
    # the saved spec was loaded back without the name checks a Register makes, over the built-in: every tenant's
    # "installed-later" (and the jobs resumed on it) ran the tenant's environment, with the tenant's scoring
    from orchestrator.backends.config import FakeBackendConfig
    from orchestrator.service.registration import SPEC_SOURCE
    from tests.conftest import TEST_OWNER

    fake = FakeBackendConfig(owner=TEST_OWNER)
    spec = word_count_spec(name=InstalledLater.name)
    spec["scoring"]["command"] = """echo '{"reward": 1}'"""  # the fake backend echoes it: the reference passes
    before = Registry.from_entry_points()
    async with serve(tmp_path, before, backend=fake) as orch, EnvfleetClient(orch.address) as client:
        await client.env_stub.Register(to_pb(spec))
        assert before.lookup(InstalledLater.name).source == SPEC_SOURCE
    registry = Registry.from_entry_points()
    registry.register(InstalledLater())
    async with serve(tmp_path, registry, backend=fake) as orch, EnvfleetClient(orch.address) as client:
        assert registry.lookup(f"{InstalledLater.name}@1").source == "python"
        assert isinstance(registry.get(InstalledLater.name), InstalledLater)
        await expect_error(
            client.env_stub.Register(to_pb({**spec, "version": "2"})),
            grpc.StatusCode.PERMISSION_DENIED,
            "is a built-in environment of this server",
        )
