"""Bad input gets the right status and a message that says what to fix; the server stays healthy. On the fake
backend: nothing here reaches a sandbox."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import InvalidRequestError
from orchestrator.core.models import JobSpec
from orchestrator.server.app import Orchestrator
from orchestrator.server.convert import job_spec_from_pb
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc
from tests.orchestrator.servers import expect_error, expect_unreadable_exec_stream

GOOD_POLICY = pb.PolicyEndpoint(base_url="http://127.0.0.1:9/v1", model="m")


def spec(**kw: object) -> pb.JobSpec:
    base: dict[str, object] = {"env": "python-tool", "policy": GOOD_POLICY}
    base.update(kw)
    return pb.JobSpec(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (spec(env="no-such-env"), grpc.StatusCode.NOT_FOUND, "no environment named 'no-such-env'"),
        (spec(env="python-tol"), grpc.StatusCode.NOT_FOUND, "did you mean python-tool"),
        (spec(env="python-tool@9"), grpc.StatusCode.NOT_FOUND, "has no version '9'"),
        (spec(env=""), grpc.StatusCode.INVALID_ARGUMENT, "env: String should have at least 1 character"),
        (
            spec(group_size=-1),
            grpc.StatusCode.INVALID_ARGUMENT,
            "group_size: Input should be greater than or equal to 1",
        ),
        (spec(group_size=100000), grpc.StatusCode.INVALID_ARGUMENT, "group_size: Input should be less than or equal"),
        (spec(rollout_timeout_s=1e12), grpc.StatusCode.INVALID_ARGUMENT, "rollout_timeout_s"),
        (spec(rollout_timeout_s=-5), grpc.StatusCode.INVALID_ARGUMENT, "rollout_timeout_s"),
        (spec(max_concurrency=-3), grpc.StatusCode.INVALID_ARGUMENT, "max_concurrency"),
        (spec(max_turns=10**6), grpc.StatusCode.INVALID_ARGUMENT, "max_turns"),
        (spec(priority=1000), grpc.StatusCode.INVALID_ARGUMENT, "priority"),
        (spec(policy=pb.PolicyEndpoint(base_url="ftp://x")), grpc.StatusCode.INVALID_ARGUMENT, "policy.base_url"),
        (spec(policy=pb.PolicyEndpoint()), grpc.StatusCode.INVALID_ARGUMENT, "policy.base_url"),
        # each was taken, and every rollout of the job was then a POLICY_ERROR: no request can be made to them
        (spec(policy=pb.PolicyEndpoint(base_url="http://")), grpc.StatusCode.INVALID_ARGUMENT, "names no host"),
        (spec(policy=pb.PolicyEndpoint(base_url="http://a b/v1")), grpc.StatusCode.INVALID_ARGUMENT, "a space"),
        (spec(policy=pb.PolicyEndpoint(base_url="http://h:99999/v1")), grpc.StatusCode.INVALID_ARGUMENT, "not a URL"),
        (spec(policy=pb.PolicyEndpoint(base_url="http://[::1/v1")), grpc.StatusCode.INVALID_ARGUMENT, "not a URL"),
        (
            spec(policy=pb.PolicyEndpoint(base_url="http://h/v1", api_key="s\u00e9cret\n")),
            grpc.StatusCode.INVALID_ARGUMENT,
            "api_key holds a character an HTTP header cannot carry",
        ),
        (
            spec(tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "tasks.ids is empty",
        ),
        (
            spec(tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["nope"])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "unknown task id",
        ),
        (
            spec(tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_SAMPLE, count=10**5)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "has only",
        ),
        (
            spec(sampling=pb.SamplingParams(temperature=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "sampling.temperature",
        ),
    ],
)
async def test_malformed_job_specs(
    fake_client: EnvfleetClient, request_: pb.JobSpec, code: grpc.StatusCode, message: str
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await fake_client.rollout_stub.SubmitJob(request_)
    assert e.value.code() == code
    assert message in (e.value.details() or ""), e.value.details()
    assert "cret" not in (e.value.details() or "")  # a key is never echoed


async def test_bad_arguments_of_other_calls(fake_client: EnvfleetClient) -> None:
    stub = fake_client.rollout_stub
    cases = [
        (stub.GetJob(pb.GetJobRequest()), grpc.StatusCode.INVALID_ARGUMENT, "job_id is empty"),
        (stub.GetJob(pb.GetJobRequest(job_id="x" * 500)), grpc.StatusCode.INVALID_ARGUMENT, "too long"),
        (stub.CancelJob(pb.CancelJobRequest(job_id="missing")), grpc.StatusCode.NOT_FOUND, "no job"),
        (stub.Ack(pb.AckRequest(job_id="missing")), grpc.StatusCode.NOT_FOUND, "no job"),
        (stub.UpdatePolicy(pb.UpdatePolicyRequest(job_id="missing")), grpc.StatusCode.INVALID_ARGUMENT, "version"),
        (
            fake_client.env_stub.Describe(pb.DescribeEnvironmentRequest()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "name is empty",
        ),
    ]
    for call, code, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == code and message in (e.value.details() or ""), e.value.details()
    stream = stub.StreamRollouts(pb.StreamRolloutsRequest(job_id="j", max_in_flight=-1))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stream.read()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_in_flight" in (e.value.details() or "")


async def test_oversized_message_is_refused_and_server_stays_healthy(
    fake_client: EnvfleetClient, fake_orchestrator: Orchestrator
) -> None:
    huge = pb.JobSpec(
        env="python-tool", tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["x" * (1 << 20)] * 70)
    )
    # a raw channel with no send limit of its own: the server's 64 MiB limit is what refuses it
    async with grpc.aio.insecure_channel(fake_orchestrator.address) as raw:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await pb_grpc.RolloutServiceStub(raw).SubmitJob(huge, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    async with grpc.aio.insecure_channel(fake_orchestrator.address) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert [e.name for e in await fake_client.list_envs()]


_pb_specs = st.builds(
    pb.JobSpec,
    env=st.text(max_size=30),
    group_size=st.integers(-(2**31), 2**31 - 1),
    max_concurrency=st.integers(-(2**31), 2**31 - 1),
    priority=st.integers(-(2**31), 2**31 - 1),
    max_turns=st.integers(-(2**31), 2**31 - 1),
    rollout_timeout_s=st.floats(allow_nan=True, allow_infinity=True),
    tasks=st.builds(
        pb.TaskSelection,
        kind=st.sampled_from([0, 1, 2]),
        ids=st.lists(st.text(max_size=10), max_size=3),
        count=st.integers(-(2**31), 2**31 - 1),
        seed=st.integers(-(2**63), 2**63 - 1),
    ),
    sampling=st.builds(
        pb.SamplingParams,
        temperature=st.floats(allow_nan=True),
        top_p=st.floats(allow_nan=True),
        max_tokens=st.integers(-(2**31), 2**31 - 1),
    ),
    policy=st.builds(
        pb.PolicyEndpoint,
        base_url=st.one_of(st.text(max_size=30), st.just("http://127.0.0.1:8000/v1")),
        request_timeout_s=st.floats(allow_nan=True, allow_infinity=True),
        max_retries=st.integers(-(2**31), 2**31 - 1),
        outage_wait_s=st.floats(allow_nan=True, allow_infinity=True),
    ),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_pb_specs)
def test_job_spec_validator_accepts_or_explains(m: pb.JobSpec) -> None:
    """Any wire JobSpec either validates or raises InvalidRequestError with a message; nothing else escapes."""
    try:
        s = job_spec_from_pb(m)
    except InvalidRequestError as e:
        assert str(e).startswith("invalid job spec: ") and len(str(e)) > 20
        return
    assert isinstance(s, JobSpec)
    assert 1 <= s.group_size <= 1024 and 0 < s.rollout_timeout_s <= 86400
    assert 0 <= s.policy.outage_wait_s <= 86400
    assert s.policy.base_url.startswith(("http://", "https://"))


async def test_a_request_that_does_not_parse_is_invalid_argument(fake_orchestrator: Orchestrator) -> None:
    # gRPC parses a request before any handler runs; a string field that is not UTF-8 (how a lone surrogate
    # arrives) made it UNKNOWN "Unexpected <class DecodeError>", or INTERNAL with a traceback for a stream's first
    # message
    bad_string = b"\x0a\x03\xed\xa0\x80"  # field 1, a string: the UTF-8 form of a lone surrogate
    async with grpc.aio.insecure_channel(fake_orchestrator.address) as channel:
        for method, stream in (
            ("/envfleet.v1.SandboxService/ReadFile", False),
            ("/envfleet.v1.RolloutService/GetJob", False),
            ("/envfleet.v1.RolloutService/StreamRollouts", True),
        ):
            call = (channel.unary_stream if stream else channel.unary_unary)(method)(bad_string)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await (call.read() if stream else call)  # type: ignore[attr-defined]
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.code(), e.value.details())
            assert "does not parse" in str(e.value.details())


async def test_an_exec_streams_later_message_that_does_not_parse_ends_it_with_a_status(
    fake_orchestrator: Orchestrator, fake_client: EnvfleetClient
) -> None:
    # it was read by the task that feeds the process's stdin, which swallowed the error and cancelled the command:
    # the call got no status at all, and without a deadline it stayed open for good
    sandbox = await fake_client.sandbox_stub.Create(pb.CreateSandboxRequest(image="envfleet/base:latest"))
    first = pb.ExecInput(request=pb.ExecRequest(sandbox_id=sandbox.sandbox_id, shell="cat")).SerializeToString()

    async def frames() -> AsyncIterator[bytes]:
        yield first
        yield b"\xff"  # a tag that is no field: not a message

    try:
        await expect_unreadable_exec_stream(fake_orchestrator.address, frames(), 20)
    finally:
        await fake_client.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=sandbox.sandbox_id))


async def test_repeated_fields_past_their_limits_are_counted_before_anything_is_built(
    fake_client: EnvfleetClient,
) -> None:
    # each item was checked, copied or parsed before the limit was: 33 million empty task ids held the event loop for
    # 20 s, 64 MiB of empty tasks for minutes (and gigabytes), 2 million env vars for seconds, for every tenant
    too_many_ids = spec(tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=[""] * 100_001))
    env_spec = pb.EnvironmentSpec(name="x", version="1", tasks=[pb.TaskSpec()] * 100_001)
    long_reference = pb.EnvironmentSpec(name="x", version="1", tasks=[pb.TaskSpec(reference=[pb.ToolCall()] * 101)])
    jsonl = pb.EnvironmentSpec(name="x", version="1", tasks_jsonl="{}\n" * 100_001)
    sandbox = pb.CreateSandboxRequest(env_vars={f"V{i}": "" for i in range(257)})
    cases = [
        (fake_client.rollout_stub.SubmitJob(too_many_ids), "tasks.ids has 100001 ids; the limit is 100000"),
        (fake_client.env_stub.Validate(env_spec), "tasks has 100001 items; the limit is 100000"),  # map_guard
        (fake_client.env_stub.Register(long_reference), "tasks[0].reference: 101 calls; the limit is 100"),
        (fake_client.env_stub.Validate(jsonl), "tasks_jsonl: more than 100000 tasks"),
        (fake_client.sandbox_stub.Create(sandbox), "env_vars: at most 256 variables, got 257"),
    ]
    for call, message in cases:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert message in (e.value.details() or ""), e.value.details()


async def test_a_count_that_only_sampling_reads_does_not_size_a_job_of_every_task(fake_client: EnvfleetClient) -> None:
    # a job of every task (python-tool's few) with a stray count was refused as count x group_size rollouts
    every = spec(tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_ALL, count=5000), group_size=256)
    job_id = (await fake_client.rollout_stub.SubmitJob(every)).job_id
    await fake_client.cancel_job(job_id)


async def test_an_execs_arguments_and_streamed_stdin_are_bounded_before_anything_copies_them(
    fake_client: EnvfleetClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 3 million variables held the event loop 144 s in the copy that sizes an Exec's stdin, before their own check
    # refused them; nothing bounded argv; an ExecStream message's stdin could be a whole 64 MiB message, held as
    # long as the command did not read it; and a stream that never sent its request held its call, counted nowhere
    from orchestrator.server import trainer_services
    from orchestrator.server.trainer_services import MAX_ARGS, MAX_ARGV_CHARS, MAX_STDIN_CHUNK

    ss = fake_client.sandbox_stub
    sid = (await ss.Create(pb.CreateSandboxRequest(image="envfleet/base:latest"))).sandbox_id
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    try:
        cases = [
            (pb.ExecRequest(sandbox_id=sid, env={f"V{i}": "" for i in range(257)}), "env: at most 256 variables"),
            (pb.ExecRequest(sandbox_id=sid, argv=pb.Argv(args=[""] * (MAX_ARGS + 1))), f"at most {MAX_ARGS} arguments"),
            (
                pb.ExecRequest(sandbox_id=sid, argv=pb.Argv(args=["x" * (MAX_ARGV_CHARS // 2 + 1)] * 2)),
                f"argv: at most {MAX_ARGV_CHARS} characters in all",
            ),
        ]
        for request, fragment in cases:
            await expect_error(ss.Exec(request), invalid, fragment)
            await expect_error(ss.ExecStream(iter([pb.ExecInput(request=request)])), invalid, fragment)
        big = b"x" * (MAX_STDIN_CHUNK + 1)
        first = pb.ExecInput(request=pb.ExecRequest(sandbox_id=sid, shell="cat", stdin=big))
        await expect_error(ss.ExecStream(iter([first])), invalid, f"in chunks of at most {MAX_STDIN_CHUNK}")
        cat = pb.ExecInput(request=pb.ExecRequest(sandbox_id=sid, shell="cat"))
        call = ss.ExecStream(iter([cat, pb.ExecInput(stdin=big)]))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for _ in call:
                pass
        assert e.value.code() == invalid and f"in chunks of at most {MAX_STDIN_CHUNK}" in str(e.value.details())

        monkeypatch.setattr(trainer_services, "FIRST_INPUT_S", 0.3)

        async def nothing() -> AsyncIterator[pb.ExecInput]:
            await asyncio.Event().wait()
            yield cat

        await expect_error(ss.ExecStream(nothing()), invalid, "ExecStream: no request within 0.3s")
    finally:
        await ss.Delete(pb.DeleteSandboxRequest(sandbox_id=sid))


def test_an_enum_value_this_server_does_not_know_is_named_by_its_number() -> None:
    # a client on a newer proto sends a value this server lacks: the refusal said "(got '?')"
    spec = pb.JobSpec(env="python-tool", policy=pb.PolicyEndpoint(base_url="http://127.0.0.1:9/v1"), advantage=9)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=r"advantage: .*enum value 9, unknown to this server"):
        job_spec_from_pb(spec)
    spec = pb.JobSpec(env="python-tool", policy=pb.PolicyEndpoint(base_url="http://127.0.0.1:9/v1"))
    spec.tasks.kind = 7  # type: ignore[assignment]
    with pytest.raises(InvalidRequestError, match=r"tasks.kind: .*enum value 7, unknown to this server"):
        job_spec_from_pb(spec)


def test_a_log_row_that_cannot_be_read_goes_out_with_its_tokens_missing() -> None:
    # the stand-in INFRA_ERROR rollout carried no tokens message: status UNSPECIFIED, which the proto says is never sent
    from orchestrator.server.convert import entry_to_pb
    from orchestrator.service.store import LogEntry

    m = entry_to_pb(LogEntry(seq=3, group_id="j:t", payload='{"id": ', rollout_id="j:t:0", job_id="j"))
    assert (m.status, m.tokens.status, m.error.kind) == (
        pb.ROLLOUT_STATUS_INFRA_ERROR,
        pb.TOKEN_STATUS_MISSING,
        "UnreadableLogEntry",
    )


async def test_health_watch_streams_the_servers_status(fake_orchestrator: Orchestrator) -> None:
    # Watch writes its messages itself (context.write): the error wrapper iterated it as a generator, and every
    # Watch, a load balancer's or a probe's, ended INTERNAL
    async with grpc.aio.insecure_channel(fake_orchestrator.address) as ch:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=10)
        first = await call.read()
        assert first.status == health_pb2.HealthCheckResponse.SERVING
        call.cancel()
