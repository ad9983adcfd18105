"""Tenant boundaries on environments: a declarative environment is private to the tenant that registered it (unless
registered public), so no other tenant can list it, describe it, run jobs, sessions or sandboxes on it, or read its
scorer's reward components; warm pools are keyed by tenant, so a recycled sandbox never crosses tenants."""

from __future__ import annotations

import asyncio
import secrets
import stat
from pathlib import Path

import grpc
import pytest

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.backends.fake import FakeBackend
from orchestrator.backends.pool import TENANT_LABEL, PoolConfig, SandboxPool
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.sandbox import SandboxSpec
from protos import orchestrator_pb2 as pb
from tests.orchestrator.servers import FAKE, FAKE_BASE_IMAGE, expect_error, local_runner, serve, silent_policy

TOKEN_A, TOKEN_B = (secrets.token_urlsafe(24) for _ in range(2))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(f"tokens:\n  {TOKEN_A}: team-a\n  {TOKEN_B}: team-b\n")
    return path


def _spec(name: str, visibility: str = "") -> pb.EnvironmentSpec:
    # the scorer's components carry the task's secret: what another tenant must never get to read
    return pb.EnvironmentSpec(
        name=name,
        version="1",
        tools=["submit"],
        tasks=[pb.TaskSpec(id="t", prompt="say hi", reference=[pb.ToolCall(name="submit", arguments="{}")])],
        scoring=pb.ScoringSpec(command='echo \'{"reward": 1, "secret_answer": 42}\''),
        visibility=visibility,
    )


async def test_another_tenants_private_environment_does_not_exist_for_me(tmp_path: Path, token_file: Path) -> None:
    async with (
        serve(tmp_path / "data", backend=FAKE, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        await a.env_stub.Register(_spec("a-private"))
        await a.env_stub.Register(_spec("a-public", visibility="public"))
        with pytest.raises(grpc.aio.AioRpcError, match="visibility"):
            await a.env_stub.Register(_spec("a-odd", visibility="friends"))

        names_b = {e.name for e in (await b.env_stub.List(pb.ListEnvironmentsRequest())).environments}
        assert "a-private" not in names_b and {"a-public", "python-tool"} <= names_b
        names_a = {e.name for e in (await a.env_stub.List(pb.ListEnvironmentsRequest())).environments}
        assert {"a-private", "a-public"} <= names_a

        missing = "no environment named 'a-private'"
        for call in (
            b.env_stub.Describe(pb.DescribeEnvironmentRequest(name="a-private@1")),
            b.session_stub.Reset(pb.ResetRequest(env="a-private", task_id="t")),
            b.session_stub.Reset(pb.ResetRequest(env="a-private@1")),
            b.sandbox_stub.Create(pb.CreateSandboxRequest(env="a-private@1")),
            b.rollout_stub.SubmitJob(
                pb.JobSpec(
                    env="a-private",
                    tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_ALL),
                    policy=pb.PolicyEndpoint(base_url="http://127.0.0.1:9/v1", model="m"),
                )
            ),
        ):
            details = await expect_error(call, grpc.StatusCode.NOT_FOUND, missing)
            assert "a-private" not in details.split(missing, 1)[1], details  # no "did you mean" either

        # so B never reaches the scorer, hence never its reward components; A still does, and B may use public ones
        session = await a.session_stub.Reset(pb.ResetRequest(env="a-private", task_id="t"))
        step = await a.session_stub.Step(
            pb.StepRequest(session_id=session.session_id, action=pb.Action(final_answer="hi"))
        )
        assert step.reward == 1.0 and step.reward_components["secret_answer"] == 42
        public = await b.session_stub.Reset(pb.ResetRequest(env="a-public", task_id="t"))
        await b.session_stub.CloseSession(pb.CloseSessionRequest(session_id=public.session_id))

    # the visibility is durable: after a restart B still cannot use A's private environment
    async with (
        serve(tmp_path / "data", backend=FAKE, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        await expect_error(
            b.session_stub.Reset(pb.ResetRequest(env="a-private", task_id="t")),
            grpc.StatusCode.NOT_FOUND,
            "no environment named 'a-private'",
        )
        ok = await b.session_stub.Reset(pb.ResetRequest(env="a-public", task_id="t"))
        await b.session_stub.CloseSession(pb.CloseSessionRequest(session_id=ok.session_id))


async def test_warm_pools_are_keyed_by_tenant() -> None:
    backend = FakeBackend(FakeBackendConfig())
    pool = SandboxPool(backend, PoolConfig())
    spec = SandboxSpec(image=FAKE_BASE_IMAGE)
    a_spec = spec.model_copy(update={"labels": {"envfleet.tenant": "team-a"}})
    b_spec = spec.model_copy(update={"labels": {"envfleet.tenant": "team-b"}})
    try:
        box, source = await pool.acquire(a_spec)
        assert source == "cold"
        assert await pool.release(box, recycle=True)  # kept warm, for team-a only
        other, source = await pool.acquire(b_spec)
        assert source == "cold" and other is not box
        again, source = await pool.acquire(a_spec)
        assert source == "warm" and again is box
        await pool.release(other, recycle=False)
        await pool.release(again, recycle=False)
    finally:
        await pool.close()
        await backend.close()


async def test_session_sandboxes_come_from_the_tenants_own_pool(tmp_path: Path, token_file: Path) -> None:
    async with (
        serve(tmp_path / "data", backend=FAKE, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        assert orch.sessions is not None
        ra = await a.session_stub.Reset(pb.ResetRequest(env="python-tool", task_id="py-000"))
        rb = await b.session_stub.Reset(pb.ResetRequest(env="python-tool", task_id="py-000"))
        live = orch.sessions._sessions  # the managers' own record of which sandbox serves which session
        assert live[ra.session_id].sandbox.spec.labels["envfleet.tenant"] == "team-a"
        assert live[rb.session_id].sandbox.spec.labels["envfleet.tenant"] == "team-b"
        for client, r in ((a, ra), (b, rb)):
            await client.session_stub.CloseSession(pb.CloseSessionRequest(session_id=r.session_id))


async def test_a_raw_sandbox_is_never_made_on_an_environments_image(tmp_path: Path, token_file: Path) -> None:
    """By its tag, an environment's image would pass no registry: it may be another tenant's private one, with what
    its owner built into it (hidden tests, data). A raw sandbox names an environment by env=, which checks."""
    theirs = "envfleet/env-a-private:0123456789ab"  # on this host: A's environment was built here
    backend = FakeBackendConfig(owner=FAKE.owner, images=(theirs,))
    async with (
        serve(tmp_path / "data", backend=backend, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        await expect_error(
            b.sandbox_stub.Create(pb.CreateSandboxRequest(image=theirs)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "is a registered environment's image: create the sandbox with env=NAME instead",
        )
        # checked as text, the prefix checks passed this one, for the engine's URL router to clean into A's
        for dotted in ("envfleet/x/../env-a-private:0123456789ab", "envfleet/../../containers/x"):
            await expect_error(
                b.sandbox_stub.Create(pb.CreateSandboxRequest(image=dotted)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "is no image reference",
            )
        ok = await b.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))
        await b.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=ok.sandbox_id))


async def test_raw_sandboxes_carry_the_callers_tenant(tmp_path: Path, token_file: Path) -> None:
    """A raw sandbox's tenant label is the authenticated caller's (the request has no labels to set): the key its
    streamed and plain execs take their turns by (tests/security/test_exec_turns.py)."""
    async with (
        serve(tmp_path / "data", backend=FAKE, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        assert orch.sandboxes is not None
        ia = await a.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))
        ib = await b.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))
        live = orch.sandboxes._live  # the manager's own record of each raw sandbox
        assert live[ia.sandbox_id].sandbox.spec.labels[TENANT_LABEL] == "team-a"
        assert live[ib.sandbox_id].sandbox.spec.labels[TENANT_LABEL] == "team-b"
        for client, info in ((a, ia), (b, ib)):
            await client.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=info.sandbox_id))


async def test_rollout_sandboxes_come_from_the_job_owners_pool(tmp_path: Path, token_file: Path) -> None:
    async with (
        silent_policy() as url,
        serve(tmp_path / "data", backend=FAKE, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        job = pb.JobSpec(
            env="python-tool",
            tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["py-000"]),
            policy=pb.PolicyEndpoint(base_url=url, model="m"),
        )
        for client in (a, b):
            await client.rollout_stub.SubmitJob(job)
        runner = local_runner(orch)
        for _ in range(100):  # both rollouts hold their sandboxes while they wait on the silent policy
            if len(runner.active) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(box.spec.labels.get("envfleet.tenant", "") for box in runner.active.values()) == [
            "team-a",
            "team-b",
        ]


async def test_the_data_directory_is_this_users_alone(tmp_path: Path) -> None:
    # it holds every tenant's rollouts and job specs, their policies' API keys among them; made with the umask's
    # 0755 (its result log 0644), any local user could read them
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    async with serve(data, backend=FAKE):
        assert stat.S_IMODE(data.stat().st_mode) == 0o700
