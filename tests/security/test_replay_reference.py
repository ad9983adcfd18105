"""The replay policy (replay://reference) streams each task's reference solution, which Describe never shows. Any
tenant that could see an environment could run it: another tenant's public environment gave away its answer keys,
a built-in one its gold patches and reference programs. With tokens, only the tenant that registered an environment
replays it, unless the operator allows every tenant (security.replay_reference: all); a server without tokens has
one user, who may. Real gRPC on the fake backend."""

from __future__ import annotations

import secrets
from pathlib import Path

import grpc
import pytest

from orchestrator.client.convert import job_spec_to_pb
from orchestrator.core.errors import PermissionDeniedError
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import REPLAY_URL, PolicyEndpoint
from orchestrator.server.security import Authenticator, ReplayGate, SecurityConfig
from orchestrator.service.registry import Registry
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc
from tests.orchestrator.conftest import ENV
from tests.orchestrator.servers import FAKE, expect_error, serve

TOKEN = secrets.token_urlsafe(24)
SILENT_URL = "http://127.0.0.1:9/v1"  # no server: the job only has to exist


def _spec(url: str, task_ids: list[str]) -> pb.JobSpec:
    return job_spec_to_pb(
        JobSpec(env=ENV, tasks=TaskSelection(kind="ids", ids=task_ids), policy=PolicyEndpoint(base_url=url))
    )


@pytest.mark.parametrize("mode", ["owner", "all"])
async def test_a_tenant_replays_only_what_it_registered_unless_the_operator_allows_all(
    tmp_path: Path, mode: str
) -> None:
    task_ids = [Registry.from_entry_points().get(ENV).tasks()[0].id]
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"tokens:\n  {TOKEN}: team-a\n")
    security = {"token_file": tokens, "replay_reference": mode}
    md = (("authorization", f"Bearer {TOKEN}"),)
    async with (
        serve(tmp_path / "data", backend=FAKE, security=security) as orch,
        grpc.aio.insecure_channel(orch.address) as channel,
    ):
        stub = pb_grpc.RolloutServiceStub(channel)
        replay = stub.SubmitJob(_spec(REPLAY_URL, task_ids[:1]), metadata=md, timeout=30)
        if mode == "owner":
            await expect_error(replay, grpc.StatusCode.PERMISSION_DENIED, "reference solution", "not yours")
        else:
            assert (await replay).job_id
        # nor by a policy update of a job that runs against a server
        job = await stub.SubmitJob(_spec(SILENT_URL, task_ids[:1]), metadata=md, timeout=30)
        update = stub.UpdatePolicy(
            pb.UpdatePolicyRequest(job_id=job.job_id, version="2", base_url=REPLAY_URL), metadata=md, timeout=30
        )
        if mode == "owner":
            await expect_error(update, grpc.StatusCode.PERMISSION_DENIED, "reference solution")
        else:
            await update


def test_the_owner_of_an_environment_replays_it_and_a_server_without_tokens_allows_all(tmp_path: Path) -> None:
    owners = {"acme-eval": "team-a"}
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(f"tokens:\n  {TOKEN}: team-a\n")
    gate = ReplayGate("owner", Authenticator.from_config(SecurityConfig(token_file=tokens)), owners.get)
    gate.check("team-a", "acme-eval@2", REPLAY_URL)
    gate.check("team-b", "acme-eval@2", "http://vllm:8000/v1")  # a policy server is anyone's
    for tenant, env in (("team-b", "acme-eval@2"), ("team-a", "python-tool")):
        with pytest.raises(PermissionDeniedError, match="reference solution"):
            gate.check(tenant, env, REPLAY_URL)
    ReplayGate("owner", Authenticator(), owners.get).check("local", "python-tool", REPLAY_URL)
