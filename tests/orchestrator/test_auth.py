"""Bearer tokens, tenant isolation (also across a restart), TLS and mTLS, and the plaintext policy, on real gRPC and
the fake backend (who may call what is the control plane's; no sandbox behaviour is tested here)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from orchestrator.client.auth import ClientTLS
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import ConfigError
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from orchestrator.testing.scripted_policy import ScriptedServer
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc
from tests.conftest import REPO
from tests.orchestrator.conftest import ENV
from tests.orchestrator.servers import FAKE, FAKE_BASE_IMAGE, expect_error, serve

TOKEN_A, TOKEN_B, TOKEN_OLD = (secrets.token_urlsafe(24) for _ in range(3))


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(
        "tokens:\n"
        f"  {TOKEN_A}: team-a\n"
        f"  {TOKEN_B}: {{tenant: team-b}}\n"
        f'  {TOKEN_OLD}: {{tenant: team-a, expires_at: "2020-01-01T00:00:00Z"}}\n'
    )
    return path


async def _list_jobs(channel: grpc.aio.Channel, token: str | None = None) -> pb.ListJobsResponse:
    md = (("authorization", f"Bearer {token}"),) if token else None
    reply: pb.ListJobsResponse = await pb_grpc.RolloutServiceStub(channel).ListJobs(
        pb.ListJobsRequest(), metadata=md, timeout=10
    )
    return reply


async def test_tokens_and_tenant_isolation(tmp_path: Path, token_file: Path, policy_server: ScriptedServer) -> None:
    security = {"token_file": token_file}
    async with serve(tmp_path / "data", backend=FAKE, security=security) as orch:
        async with grpc.aio.insecure_channel(orch.address) as raw:
            await expect_error(_list_jobs(raw), grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
            await expect_error(_list_jobs(raw, "w" * 32), grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
            await expect_error(_list_jobs(raw, TOKEN_OLD), grpc.StatusCode.UNAUTHENTICATED, "expired at 2020-01-01")
            stream = pb_grpc.RolloutServiceStub(raw).StreamRollouts(pb.StreamRolloutsRequest(job_id="j"))
            await expect_error(stream, grpc.StatusCode.UNAUTHENTICATED, "missing bearer token")
            health = await health_pb2_grpc.HealthStub(raw).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # health needs no token

        async with EnvfleetClient(orch.address, token=TOKEN_A) as a, EnvfleetClient(orch.address, token=TOKEN_B) as b:
            spec = JobSpec(
                env=ENV,
                tasks=TaskSelection(kind="ids", ids=["py-000"]),
                policy=PolicyEndpoint(base_url=policy_server.url, model="scripted"),
            )
            job_id = await a.submit(spec)
            # tenant B can neither see, stream, ack, update nor cancel A's job: it does not exist for B
            rs = b.rollout_stub
            for call in (
                rs.GetJob(pb.GetJobRequest(job_id=job_id)),
                rs.CancelJob(pb.CancelJobRequest(job_id=job_id)),
                rs.Ack(pb.AckRequest(job_id=job_id, up_to=100)),
                rs.UpdatePolicy(pb.UpdatePolicyRequest(job_id=job_id, version="evil")),
                rs.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id)),
            ):
                await expect_error(call, grpc.StatusCode.NOT_FOUND, f"no job '{job_id}'")
            assert await b.list_jobs() == []
            (rollout,) = [r async for r in a.rollouts(job_id)]
            assert rollout.reward == 1.0 and [j.job_id for j in await a.list_jobs()] == [job_id]

            # sessions
            session = await a.session_stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
            sid = session.session_id
            await expect_error(
                b.session_stub.Step(pb.StepRequest(session_id=sid, action=pb.Action(final_answer="1"))),
                grpc.StatusCode.NOT_FOUND,
                "no session",
            )
            await expect_error(
                b.session_stub.CloseSession(pb.CloseSessionRequest(session_id=sid)), grpc.StatusCode.NOT_FOUND
            )
            assert (await a.session_stub.CloseSession(pb.CloseSessionRequest(session_id=sid))).was_running

            # raw sandboxes
            box = await a.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))
            bid, ss = box.sandbox_id, b.sandbox_stub
            for call in (
                ss.Exec(pb.ExecRequest(sandbox_id=bid, shell="id")),
                ss.ReadFile(pb.SandboxReadFileRequest(sandbox_id=bid, path="x")),
                ss.WriteFile(pb.SandboxWriteFileRequest(sandbox_id=bid, path="x", content=b"evil")),
                ss.Download(pb.SandboxDownloadRequest(sandbox_id=bid, path=".")),
                ss.Get(pb.GetSandboxRequest(sandbox_id=bid)),
                ss.Delete(pb.DeleteSandboxRequest(sandbox_id=bid)),
            ):
                await expect_error(call, grpc.StatusCode.NOT_FOUND, f"no sandbox '{bid}'")
            assert list((await ss.List(pb.ListSandboxesRequest())).sandboxes) == []
            assert [s.sandbox_id for s in (await a.sandbox_stub.List(pb.ListSandboxesRequest())).sandboxes] == [bid]
            await a.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=bid))

            # an environment name belongs to the tenant that registered it
            env = pb.EnvironmentSpec(
                name="team-a-env",
                version="1",
                tools=["submit"],
                tasks=[pb.TaskSpec(id="t", prompt="say hi", reference=[pb.ToolCall(name="submit", arguments="{}")])],
                scoring=pb.ScoringSpec(command="echo '{\"reward\": 1}'"),
            )
            assert (await a.env_stub.Register(env)).source == "spec"
            env.version = "2"
            await expect_error(b.env_stub.Register(env), grpc.StatusCode.PERMISSION_DENIED, "another tenant")

    # ownership is durable: after a restart B still cannot see A's job, nor take A's environment name
    async with (
        serve(tmp_path / "data", backend=FAKE, security=security) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        assert (await a.get_job(job_id)).state == "COMPLETED"
        await expect_error(b.get_job(job_id), grpc.StatusCode.NOT_FOUND)
        await expect_error(b.env_stub.Register(env), grpc.StatusCode.PERMISSION_DENIED, "another tenant")


async def test_tls_and_mtls(tmp_path: Path, token_file: Path, pki: dict[str, Path]) -> None:
    tls = {"cert_file": pki["server_cert"], "key_file": pki["server_key"]}
    async with serve(tmp_path / "tls", backend=FAKE, security={"token_file": token_file, "tls": tls}) as orch:
        trusted = ClientTLS.from_files(pki["ca"])
        async with EnvfleetClient(orch.address, token=TOKEN_A, tls=trusted) as client:
            assert await client.list_jobs() == []
        async with grpc.aio.insecure_channel(orch.address) as plain:  # a plaintext client cannot talk to it
            await expect_error(_list_jobs(plain, TOKEN_A), grpc.StatusCode.UNAVAILABLE)
        async with grpc.aio.secure_channel(orch.address, trusted.credentials()) as channel:
            # reflection is off by default once TLS is on
            replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                metadata=(("authorization", f"Bearer {TOKEN_A}"),),
            )
            await expect_error(replies, grpc.StatusCode.UNIMPLEMENTED)

    mtls = {**tls, "client_ca_file": pki["ca"]}
    async with serve(tmp_path / "mtls", backend=FAKE, security={"token_file": token_file, "tls": mtls}) as orch:
        without = ClientTLS.from_files(pki["ca"])
        async with grpc.aio.secure_channel(orch.address, without.credentials()) as channel:
            await expect_error(_list_jobs(channel, TOKEN_A), grpc.StatusCode.UNAVAILABLE)
        with_cert = ClientTLS.from_files(pki["ca"], pki["client_cert"], pki["client_key"])
        async with EnvfleetClient(orch.address, token=TOKEN_A, tls=with_cert) as client:
            assert await client.list_jobs() == []
            await expect_error(client.rollout_stub.GetJob(pb.GetJobRequest(job_id="nope")), grpc.StatusCode.NOT_FOUND)


async def test_plaintext_is_refused_off_loopback(
    tmp_path: Path, token_file: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(ConfigError, match="bearer tokens would cross the network in clear"):
        async with serve(tmp_path / "a", backend=FAKE, host="0.0.0.0", security={"token_file": token_file}):
            pass
    with pytest.raises(ConfigError, match="anyone could call it"):
        async with serve(tmp_path / "b", backend=FAKE, host="0.0.0.0"):
            pass
    with caplog.at_level(logging.WARNING, logger="orchestrator.server.security"):
        insecure = {"token_file": token_file, "insecure": True}
        async with (
            serve(tmp_path / "c", backend=FAKE, host="0.0.0.0", security=insecure) as orch,
            EnvfleetClient(f"127.0.0.1:{orch.port}", token=TOKEN_B) as client,
        ):
            assert await client.list_jobs() == []
    assert "INSECURE: serving plaintext gRPC on 0.0.0.0" in caplog.text
    with pytest.raises(ValueError, match="refusing to send a bearer token in clear"):
        EnvfleetClient("10.1.2.3:50051", token=TOKEN_A)


async def test_no_token_file_keeps_the_local_quick_start(fake_client: EnvfleetClient) -> None:
    """Without a token file every caller is the local tenant; reflection lists the new services."""
    client = fake_client
    assert await client.list_jobs() == []
    async with grpc.aio.insecure_channel(client.target) as channel:
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        reply = await replies.read()
    names = {s.name for s in reply.list_services_response.service}
    assert {"envfleet.v1.SessionService", "envfleet.v1.SandboxService", "envfleet.v1.RolloutService"} <= names


async def test_rollout_command_reaches_a_server_with_a_token(
    tmp_path: Path, token_file: Path, policy_server: ScriptedServer
) -> None:
    mine = tmp_path / "my-token"
    mine.write_text(TOKEN_A + "\n")
    out = tmp_path / "r.jsonl"
    async with serve(tmp_path / "srv", backend=FAKE, security={"token_file": token_file}) as orch:

        def rollout(*extra: str) -> subprocess.CompletedProcess[str]:
            argv = ["rollout", "--env", ENV, "--tasks", "1", "--policy", policy_server.url, "--out", str(out)]
            return subprocess.run(
                [sys.executable, "-m", "orchestrator.cli", *argv, "--server", orch.address, *extra],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=300,
                env={k: v for k, v in os.environ.items() if k != "ENVFLEET_TOKEN"},
            )

        refused = await asyncio.to_thread(rollout)
        assert refused.returncode != 0 and "missing bearer token" in refused.stderr, refused.stderr[-2000:]
        ok = await asyncio.to_thread(rollout, "--token-file", str(mine))
        assert ok.returncode == 0, ok.stderr[-2000:]
        assert [json.loads(x)["status"] for x in out.read_text().splitlines()] == ["OK"]
        async with EnvfleetClient(orch.address, token=TOKEN_A) as a:
            assert [j.env for j in await a.list_jobs()] == ["python-tool@1"]  # the job is team-a's
