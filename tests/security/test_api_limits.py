"""The API edge bounds what it accepts and what it says back: identifiers are capped, every echoed value is cut,
a job's size is checked before anything is built, and an internal error never echoes exception text."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from orchestrator.backends.config import FakeBackendConfig
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.echo import ECHO_CHARS, MAX_MESSAGE_CHARS, bounded, echo
from orchestrator.server.app import Orchestrator
from orchestrator.server.convert_sessions import MAX_STEP_REQUEST_BYTES
from protos import orchestrator_pb2 as pb
from protos import orchestrator_pb2_grpc as pb_grpc
from tests.conftest import TEST_OWNER
from tests.orchestrator.conftest import ENV
from tests.orchestrator.servers import expect_error, serve

# a message of a few hundred characters is plenty; the bug this guards against gave 20,059 for a 20 KB id
SHORT = 1024


@pytest.fixture
async def orch(tmp_path: Path, base_image: str) -> AsyncIterator[Orchestrator]:
    async with serve(tmp_path / "data") as o:
        yield o


@pytest.fixture
async def channel(orch: Orchestrator) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(orch.address) as ch:
        yield ch


def _job(**kw: object) -> pb.JobSpec:
    m = pb.JobSpec(env=ENV, policy=pb.PolicyEndpoint(base_url="http://127.0.0.1:9/v1"))
    m.MergeFrom(pb.JobSpec(**kw))  # type: ignore[arg-type]
    return m


def test_echo_and_bounded_cut_long_values() -> None:
    assert echo("abc") == "'abc'"
    long = echo("x" * 20_000)
    assert len(long) < ECHO_CHARS + 30 and long.endswith("(20002 chars)")
    assert len(bounded("y" * 100_000)) < MAX_MESSAGE_CHARS + 50


async def test_submit_job_with_huge_unknown_task_id_answers_briefly(channel: grpc.aio.Channel) -> None:
    stub = pb_grpc.RolloutServiceStub(channel)
    for size in (200, 20_000, 100_000):  # past 64 KiB the whole id in the status broke the HTTP/2 connection
        tasks = pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["t" * size])
        details = await expect_error(
            stub.SubmitJob(_job(tasks=tasks), timeout=30), grpc.StatusCode.INVALID_ARGUMENT, "tasks.ids"
        )
        assert len(details) < SHORT, len(details)
    # an id within the cap but unknown is echoed cut short
    tasks = pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["u" * 120, "v" * 120])
    details = await expect_error(
        stub.SubmitJob(_job(tasks=tasks), timeout=30), grpc.StatusCode.INVALID_ARGUMENT, "unknown task id"
    )
    assert len(details) < SHORT and "u" * (ECHO_CHARS + 10) not in details
    # the server still answers on the same channel
    assert (await stub.ListJobs(pb.ListJobsRequest(), timeout=10)).jobs == []


async def test_every_identifier_is_capped_at_the_edge(channel: grpc.aio.Channel) -> None:
    big = "z" * 50_000
    rs, ss = pb_grpc.RolloutServiceStub(channel), pb_grpc.SessionServiceStub(channel)
    es, bs = pb_grpc.EnvironmentServiceStub(channel), pb_grpc.SandboxServiceStub(channel)
    calls = [
        rs.SubmitJob(_job(env=big), timeout=30),
        rs.SubmitJob(_job(policy=pb.PolicyEndpoint(base_url="http://127.0.0.1:9/v1", model=big)), timeout=30),
        rs.SubmitJob(_job(policy=pb.PolicyEndpoint(base_url="http://h/" + big)), timeout=30),
        rs.SubmitJob(_job(policy=pb.PolicyEndpoint(base_url="http://127.0.0.1:9/v1", version=big)), timeout=30),
        rs.UpdatePolicy(pb.UpdatePolicyRequest(job_id="j", version=big), timeout=30),
        rs.GetJob(pb.GetJobRequest(job_id=big), timeout=30),
        es.Describe(pb.DescribeEnvironmentRequest(name=big), timeout=30),
        es.RegisterArchive(pb.EnvironmentArchive(kind="harbor", name=big, archive=b"x"), timeout=30),
        es.ValidateArchive(pb.EnvironmentArchive(kind=big, name="n", version=big, archive=b"x"), timeout=30),
        ss.Reset(pb.ResetRequest(env=ENV, task_id=big), timeout=30),
        ss.Step(pb.StepRequest(session_id=big, action=pb.Action(final_answer="1")), timeout=30),
        bs.Get(pb.GetSandboxRequest(sandbox_id=big), timeout=30),
        bs.Create(pb.CreateSandboxRequest(image=big), timeout=30),
    ]
    for call in calls:
        details = await expect_error(call, grpc.StatusCode.INVALID_ARGUMENT)
        assert len(details) < SHORT and "z" * (ECHO_CHARS + 10) not in details, details[:200]


async def test_unknown_names_are_echoed_short(channel: grpc.aio.Channel) -> None:
    name = "n" * 190  # within the 200-character cap of an environment reference
    es, ss = pb_grpc.EnvironmentServiceStub(channel), pb_grpc.SessionServiceStub(channel)
    for call in (
        es.Describe(pb.DescribeEnvironmentRequest(name=name), timeout=30),
        ss.Reset(pb.ResetRequest(env=ENV, task_id="q" * 128), timeout=30),
        pb_grpc.RolloutServiceStub(channel).GetJob(pb.GetJobRequest(job_id="w" * 128), timeout=30),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        details = e.value.details() or ""
        assert len(details) < SHORT and not re.search(r"([nqw])\1{" + str(ECHO_CHARS + 10) + "}", details), details


async def test_job_size_is_checked_before_anything_is_built(channel: grpc.aio.Channel) -> None:
    # 100,000 ids x 1024 samples would be 100 million work items built in memory before any check
    tasks = pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=[f"id-{i}" for i in range(100_000)])
    stub = pb_grpc.RolloutServiceStub(channel)
    await expect_error(
        stub.SubmitJob(_job(tasks=tasks, group_size=1024), timeout=30),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tasks x group_size",
    )
    sample = pb.TaskSelection(kind=pb.TaskSelection.KIND_SAMPLE, count=1_000_000)
    await expect_error(
        stub.SubmitJob(_job(tasks=sample, group_size=1024), timeout=30),
        grpc.StatusCode.INVALID_ARGUMENT,
        "tasks x group_size",
    )


async def test_internal_error_carries_an_id_not_the_exception_text(
    orch: Orchestrator, channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "/srv/secret/path-0xdeadbeef"

    async def broken(*args: object, **kwargs: object) -> object:
        raise RuntimeError(f"cannot open {secret}")

    orch.jobs.list = broken  # type: ignore[method-assign,assignment]
    with caplog.at_level(logging.ERROR, logger="orchestrator.server.errors"):
        details = await expect_error(
            pb_grpc.RolloutServiceStub(channel).ListJobs(pb.ListJobsRequest(), timeout=10),
            grpc.StatusCode.INTERNAL,
            "internal error",
        )
    assert secret not in details and "RuntimeError" not in details
    error_id = re.search(r"error id ([0-9a-f]{12})", details)
    assert error_id, details
    logged = [r for r in caplog.records if error_id.group(1) in r.getMessage()]
    assert logged and logged[0].exc_info and secret in str(logged[0].exc_info[1])


def _tool_step(session_id: str) -> pb.StepRequest:
    call = pb.ToolCall(id="c", name="python", arguments='{"code": "print(1)"}')
    return pb.StepRequest(session_id=session_id, action=pb.Action(tool_call=call))


async def test_a_session_holds_one_waiting_step_and_no_step_past_what_a_step_can_carry(tmp_path: Path) -> None:
    # each Step sent to a session whose step runs waited for its turn holding its whole request (up to the server's
    # 64 MiB message, unknown fields and all): a hundred sent at once held gigabytes for as long as the steps took
    backend = FakeBackendConfig(owner=TEST_OWNER, exec_latency_s=2.0)
    async with serve(tmp_path, backend=backend) as orch, EnvfleetClient(orch.address) as client:
        assert orch.sessions is not None
        ss = client.session_stub
        r = await ss.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))
        session = orch.sessions._sessions[r.session_id]
        running = asyncio.ensure_future(ss.Step(_tool_step(r.session_id), timeout=60))
        for _ in range(200):
            if session.lock.locked():
                break
            await asyncio.sleep(0.01)
        waiting = asyncio.ensure_future(ss.Step(_tool_step(r.session_id), timeout=60))
        for _ in range(200):
            if session.waiting:
                break
            await asyncio.sleep(0.01)
        for _ in range(5):
            await expect_error(
                ss.Step(_tool_step(r.session_id), timeout=1),
                grpc.StatusCode.FAILED_PRECONDITION,
                "has a step running and 1 waiting",
            )
        assert [s.observation.strip() for s in await asyncio.gather(running, waiting)] == ["print(1)"] * 2

        # a StepRequest larger than any action it may carry is refused as it is read, before it waits anywhere
        step = _tool_step(r.session_id).SerializeToString()
        padding = b"x" * MAX_STEP_REQUEST_BYTES
        unknown = b"\x7a" + _varint(len(padding)) + padding  # field 15, length-delimited: no field of StepRequest
        raw = client._channel.unary_unary(
            "/envfleet.v1.SessionService/Step",
            request_serializer=lambda b: b,
            response_deserializer=pb.StepResponse.FromString,
        )
        await expect_error(
            raw(step + unknown, timeout=30),
            grpc.StatusCode.INVALID_ARGUMENT,
            f"over this call's {MAX_STEP_REQUEST_BYTES}",
        )
        ok = await raw(step, timeout=30)  # the same step, as sent by a client
        assert ok.observation.strip() == "print(1)"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


async def test_a_request_with_a_huge_map_is_refused_before_it_is_parsed(channel: grpc.aio.Channel) -> None:
    # protobuf fills a map's hash table at a cost far past linear at some sizes: an ExecRequest of 600,000 env
    # entries (7 MiB) took 7 s to parse here, 2.6 million (33 MiB) 160 s, on the event loop every call shares and
    # before any handler could refuse it. Counted first on a shape that parses in linear time: INVALID_ARGUMENT
    from orchestrator.server.map_guard import MAX_MAP_ENTRIES

    too_many = {f"{i:x}": "" for i in range(MAX_MAP_ENTRIES + 1)}
    sandboxes = pb_grpc.SandboxServiceStub(channel)
    environments = pb_grpc.EnvironmentServiceStub(channel)
    exec_request = pb.ExecRequest(sandbox_id="x", shell="true", env=too_many)
    spec = pb.EnvironmentSpec(name="maps", version="1", image=pb.ImageSource(files=too_many))
    cases = [
        (sandboxes.Exec(exec_request), "env has"),
        (sandboxes.ExecStream(iter([pb.ExecInput(request=exec_request)])), "request.env has"),
        (sandboxes.Create(pb.CreateSandboxRequest(image="envfleet/base", env_vars=too_many)), "env_vars has"),
        (environments.Validate(spec), "image.files has"),
        (environments.Register(pb.EnvironmentSpec(tasks=[pb.TaskSpec(files=too_many)])), "tasks[0].files has"),
    ]
    for call, where in cases:
        await expect_error(
            call,
            grpc.StatusCode.INVALID_ARGUMENT,
            f"refused unparsed: {where} {MAX_MAP_ENTRIES + 1} entries; the limit is {MAX_MAP_ENTRIES}",
        )
