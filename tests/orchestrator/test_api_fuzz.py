"""Hypothesis-generated requests against every RPC of a live orchestrator: a bad request gets a status that says
what is wrong (INVALID_ARGUMENT, NOT_FOUND, ...), never UNKNOWN or INTERNAL, never a hang; the server stays healthy.
Run against real Docker (envd's answers to fuzzed paths and commands) and against the fake backend (the fast twin)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.server.app import Orchestrator
from orchestrator.testing.scripted_policy import ScriptedServer
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc
from tests.orchestrator.conftest import ENV, job
from tests.orchestrator.servers import FAKE_BASE_IMAGE

CALL_TIMEOUT_S = 30.0
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

CHARS = st.characters(exclude_categories=["Cs"])  # no lone surrogates: protobuf strings are UTF-8
TEXT = st.text(CHARS, max_size=40)
LONG = st.text(CHARS, min_size=129, max_size=300)
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
DOUBLE = st.floats(allow_nan=True, allow_infinity=True)
JSONISH = st.one_of(TEXT, st.just("{}"), st.dictionaries(TEXT, st.one_of(TEXT, INT32), max_size=3).map(json.dumps))
# never a registered environment: a job on one would start real rollouts
BAD_ENV = st.one_of(TEXT, LONG, st.just("python-tool@9")).filter(
    lambda s: s.split("@")[0] not in ("python-tool", "code-tests", "word-count", "echo-word")
)


def ids(*real: str) -> st.SearchStrategy[str]:
    return st.one_of(TEXT, LONG, st.just(""), *(st.just(r) for r in real))


LIMITS = st.builds(
    pb.SandboxLimits,
    memory_mb=st.one_of(st.none(), INT32),
    cpus=st.one_of(st.none(), DOUBLE),
    pids=st.one_of(st.none(), INT32),
    tmp_mb=st.one_of(st.none(), INT32),
    workspace_mb=st.one_of(st.none(), INT32),
)
TOOL_CALL = st.builds(
    pb.ToolCall, id=TEXT, name=st.one_of(TEXT, st.sampled_from(["python", "submit", "bash"])), arguments=JSONISH
)
ACTION = st.one_of(
    st.just(pb.Action()), st.builds(pb.Action, tool_call=TOOL_CALL), st.builds(pb.Action, final_answer=TEXT)
)
ENV_SPEC = st.builds(
    pb.EnvironmentSpec,
    name=st.one_of(TEXT, st.just("fuzz-env")),
    version=st.one_of(TEXT, st.just("1")),
    image=st.builds(
        pb.ImageSource,
        dockerfile=st.one_of(st.just(""), TEXT),
        base=st.one_of(st.just(""), TEXT),
        packages=st.lists(TEXT, max_size=2),
        files=st.dictionaries(TEXT, TEXT, max_size=2),
        setup=st.lists(TEXT, max_size=2),
    ),
    tasks=st.lists(
        st.builds(
            pb.TaskSpec,
            id=TEXT,
            prompt=TEXT,
            data_json=JSONISH,
            files=st.dictionaries(TEXT, TEXT, max_size=2),
            reference=st.lists(TOOL_CALL, max_size=2),
        ),
        max_size=3,
    ),
    tasks_jsonl=st.one_of(st.just(""), TEXT),
    tools=st.lists(st.one_of(TEXT, st.sampled_from(["bash", "submit", "python"])), max_size=3),
    scoring=st.one_of(st.none(), st.builds(pb.ScoringSpec, command=TEXT, timeout_s=st.one_of(st.none(), DOUBLE))),
    limits=LIMITS,
    max_turns=st.one_of(st.none(), INT32),
    tool_timeout_s=st.one_of(st.none(), DOUBLE),
)


class Fuzzer:
    """Calls RPCs with a blocking channel and checks every status."""

    def __init__(self, address: str, base_image: str, sandbox_id: str, session_id: str, job_id: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.env = pb_grpc.EnvironmentServiceStub(self.channel)
        self.rollout = pb_grpc.RolloutServiceStub(self.channel)
        self.session = pb_grpc.SessionServiceStub(self.channel)
        self.sandbox = pb_grpc.SandboxServiceStub(self.channel)
        self.base_image, self.sandbox_id, self.session_id, self.job_id = base_image, sandbox_id, session_id, job_id
        self.calls = 0

    def call(self, rpc: Callable[..., Any], request: Any, stream: bool = False) -> Any:
        self.calls += 1
        try:
            reply = rpc(request, timeout=CALL_TIMEOUT_S)
            return list(reply) if stream else reply
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            assert code in ALLOWED, f"{code.name} ({details}) for {type(request).__name__} {str(request)[:500]}"
            assert details, f"{code.name} without a message for {type(request).__name__}"
            return None

    def run(self) -> None:
        many = settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        few = settings(max_examples=10, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        real_box, real_session, real_job = self.sandbox_id, self.session_id, self.job_id

        @many
        @given(st.builds(pb.DescribeEnvironmentRequest, name=st.one_of(BAD_ENV, st.just(ENV))))
        def describe(r: pb.DescribeEnvironmentRequest) -> None:
            self.call(self.env.Describe, r)
            self.call(self.env.List, pb.ListEnvironmentsRequest())

        @few
        @given(ENV_SPEC, st.booleans())
        def register(r: pb.EnvironmentSpec, validate_only: bool) -> None:
            self.call(self.env.Validate if validate_only else self.env.Register, r)

        @many
        @given(
            st.builds(
                pb.JobSpec,
                env=BAD_ENV,
                tasks=st.builds(
                    pb.TaskSelection,
                    kind=st.sampled_from([0, 1, 2, 7]),
                    ids=st.lists(TEXT, max_size=3),
                    count=INT32,
                    seed=INT64,
                ),
                group_size=INT32,
                sampling=st.builds(
                    pb.SamplingParams, temperature=st.one_of(st.none(), DOUBLE), max_tokens=st.one_of(st.none(), INT32)
                ),
                policy=st.builds(pb.PolicyEndpoint, base_url=TEXT, request_timeout_s=st.one_of(st.none(), DOUBLE)),
                max_concurrency=INT32,
                priority=INT32,
                max_turns=INT32,
                rollout_timeout_s=DOUBLE,
            )
        )
        def submit(r: pb.JobSpec) -> None:
            reply = self.call(self.rollout.SubmitJob, r)
            assert reply is None, "a fuzzed job was accepted"

        @many
        @given(ids(real_job), INT64, INT32, INT32, st.lists(TEXT, max_size=3), TEXT)
        def jobs(job_id: str, seq: int, in_flight: int, batch: int, ack_ids: list[str], version: str) -> None:
            self.call(self.rollout.GetJob, pb.GetJobRequest(job_id=job_id))
            self.call(self.rollout.Ack, pb.AckRequest(job_id=job_id, up_to=seq, ids=ack_ids))
            self.call(
                self.rollout.UpdatePolicy, pb.UpdatePolicyRequest(job_id=job_id, version=version, base_url=version)
            )
            self.call(self.rollout.ListJobs, pb.ListJobsRequest())
            if job_id != real_job:  # the real one is finished: its stream would end normally
                self.call(self.rollout.CancelJob, pb.CancelJobRequest(job_id=job_id))
            stream = pb.StreamRolloutsRequest(job_id=job_id, resume_after=seq, max_in_flight=in_flight, max_batch=batch)
            self.call(self.rollout.StreamRollouts, stream, stream=True)

        @few
        @given(st.one_of(BAD_ENV, st.just(ENV)), ids("py-000"), st.one_of(st.none(), INT64), INT32)
        def reset(env: str, task_id: str, seed: int | None, max_turns: int) -> None:
            r = pb.ResetRequest(env=env, task_id=task_id, max_turns=max_turns)
            if seed is not None:
                r.seed = seed
            reply = self.call(self.session.Reset, r)
            if reply is not None:
                self.call(self.session.CloseSession, pb.CloseSessionRequest(session_id=reply.session_id))

        @many
        @given(ids(real_session), ACTION)
        def step(session_id: str, action: pb.Action) -> None:
            self.call(self.session.Step, pb.StepRequest(session_id=session_id, action=action))
            if session_id != real_session:
                self.call(self.session.Close, pb.CloseSessionRequest(session_id=session_id))

        @few
        @given(
            st.one_of(st.just(""), st.just(self.base_image), TEXT, st.just("envfleet/base:nope")),
            st.one_of(st.just(""), st.just(ENV), BAD_ENV),
            LIMITS,
            DOUBLE,
            st.dictionaries(TEXT, TEXT, max_size=2),
        )
        def create(image: str, env: str, limits: pb.SandboxLimits, ttl: float, env_vars: dict[str, str]) -> None:
            r = pb.CreateSandboxRequest(image=image, env=env, limits=limits, ttl_s=ttl, env_vars=env_vars)
            reply = self.call(self.sandbox.Create, r)
            if reply is not None:
                self.call(self.sandbox.Delete, pb.DeleteSandboxRequest(sandbox_id=reply.sandbox_id))

        exec_requests = st.builds(
            pb.ExecRequest,
            sandbox_id=ids(real_box),
            shell=st.one_of(st.none(), TEXT),
            argv=st.one_of(st.none(), st.builds(pb.Argv, args=st.lists(TEXT, max_size=3))),
            cwd=TEXT,
            env=st.dictionaries(TEXT, TEXT, max_size=2),
            stdin=st.binary(max_size=64),
            timeout_s=st.one_of(DOUBLE.filter(lambda x: not 0 <= x <= 3600), st.floats(0.01, 2.0)),
            max_output_bytes=st.one_of(INT64, st.integers(1, 4096)),
        )

        @many
        @given(exec_requests)
        def exec_(r: pb.ExecRequest) -> None:
            self.call(self.sandbox.Exec, r, stream=True)

        @many
        @given(
            ids(real_box),
            TEXT,
            st.binary(max_size=256),
            st.one_of(INT32, st.integers(0, 0o777)),
            st.one_of(INT64, st.integers(0, 4096)),
        )
        def files(sandbox_id: str, path: str, data: bytes, mode: int, max_bytes: int) -> None:
            self.call(self.sandbox.Get, pb.GetSandboxRequest(sandbox_id=sandbox_id))
            self.call(self.sandbox.List, pb.ListSandboxesRequest())
            self.call(
                self.sandbox.WriteFile,
                pb.SandboxWriteFileRequest(sandbox_id=sandbox_id, path=path, content=data, mode=mode),
            )
            self.call(
                self.sandbox.ReadFile, pb.SandboxReadFileRequest(sandbox_id=sandbox_id, path=path, max_bytes=max_bytes)
            )
            self.call(self.sandbox.Upload, pb.SandboxUploadRequest(sandbox_id=sandbox_id, dest_dir=path, tar=data))
            self.call(self.sandbox.Download, pb.SandboxDownloadRequest(sandbox_id=sandbox_id, path=path))
            if sandbox_id != real_box:
                self.call(self.sandbox.Delete, pb.DeleteSandboxRequest(sandbox_id=sandbox_id))

        for fuzz in (describe, register, submit, jobs, reset, step, create, exec_, files):
            fuzz()

    def close(self) -> None:
        self.channel.close()


async def test_fuzzed_requests_get_clear_statuses(
    orchestrator: Orchestrator, client: EnvfleetClient, base_image: str, policy_server: ScriptedServer
) -> None:
    await _fuzz(orchestrator, client, base_image, policy_server)


async def test_fuzzed_requests_get_clear_statuses_on_the_fake_backend(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient, policy_server: ScriptedServer
) -> None:
    await _fuzz(fake_orchestrator, fake_client, FAKE_BASE_IMAGE, policy_server)


async def _fuzz(
    orchestrator: Orchestrator, client: EnvfleetClient, base_image: str, policy_server: ScriptedServer
) -> None:
    job_id = await client.submit(job(policy_server.url, ["py-000"]))
    assert [r.reward async for r in client.rollouts(job_id)] == [1.0]
    box = await client.sandbox_stub.Create(pb.CreateSandboxRequest(image=base_image))
    session = await client.session_stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))

    fuzzer = Fuzzer(orchestrator.address, base_image, box.sandbox_id, session.session_id, job_id)
    try:
        await asyncio.to_thread(fuzzer.run)
    finally:
        fuzzer.close()
    assert fuzzer.calls > 300

    # still healthy, and still working
    async with grpc.aio.insecure_channel(orchestrator.address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    events = [e async for e in client.sandbox_stub.Exec(pb.ExecRequest(sandbox_id=box.sandbox_id, shell="echo ok"))]
    assert b"".join(e.stdout for e in events) == b"ok\n"
    for s in (await client.sandbox_stub.List(pb.ListSandboxesRequest())).sandboxes:
        if s.state == pb.SANDBOX_STATE_RUNNING:
            await client.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=s.sandbox_id))
    assert [j.job_id for j in await client.list_jobs()] == [job_id]  # no fuzzed job was accepted
