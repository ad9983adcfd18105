"""Server-side caps per request and per tenant (`caps:` and `capacity:` in the server configuration): each refusal is
RESOURCE_EXHAUSTED and names the cap, and raw sandboxes and sessions take their share of the host's capacity like
rollouts do, giving it back when they end."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.client.sdk import EnvfleetClient
from orchestrator.server.convert import job_spec_from_pb
from protos import orchestrator_pb2 as pb
from tests.orchestrator.servers import FAKE, FAKE_BASE_IMAGE, expect_error, serve, silent_policy

TOKEN_A, TOKEN_B = (secrets.token_urlsafe(24) for _ in range(2))
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(f"tokens:\n  {TOKEN_A}: team-a\n  {TOKEN_B}: team-b\n")
    return path


def _job(url: str, group_size: int = 1) -> pb.JobSpec:
    return pb.JobSpec(
        env="python-tool",
        tasks=pb.TaskSelection(kind=pb.TaskSelection.KIND_IDS, ids=["py-000"]),
        group_size=group_size,
        policy=pb.PolicyEndpoint(base_url=url, model="m"),
    )


async def test_sandbox_limits_are_capped_for_raw_sandboxes_and_declarative_specs(tmp_path: Path) -> None:
    caps = {"sandbox": {"memory_mb": 2048, "cpus": 2}}
    async with serve(tmp_path, backend=FAKE, caps=caps) as orch, EnvfleetClient(orch.address) as c:
        ss = c.sandbox_stub
        # what a raw sandbox could ask for before: a terabyte of memory, 1024 CPUs
        for limits, cap in (
            (pb.SandboxLimits(memory_mb=1 << 20), "caps.sandbox.memory_mb = 2048"),
            (pb.SandboxLimits(cpus=1024), "caps.sandbox.cpus = 2"),
        ):
            await expect_error(ss.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE, limits=limits)), EXHAUSTED, cap)
        ok = await ss.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE, limits=pb.SandboxLimits(memory_mb=2048)))
        await ss.Delete(pb.DeleteSandboxRequest(sandbox_id=ok.sandbox_id))

        spec = pb.EnvironmentSpec(
            name="greedy",
            version="1",
            tools=["submit"],
            tasks=[pb.TaskSpec(id="t", prompt="hi", reference=[pb.ToolCall(name="submit", arguments="{}")])],
            scoring=pb.ScoringSpec(command="echo '{\"reward\": 1}'"),
            limits=pb.SandboxLimits(memory_mb=1 << 20, cpus=1024),
        )
        for call in (c.env_stub.Validate(spec), c.env_stub.Register(spec)):
            await expect_error(call, EXHAUSTED, "limits.memory_mb = 1.04858e+06 is over caps.sandbox.memory_mb")


async def test_jobs_streams_and_rollouts_per_job_are_capped_per_tenant(tmp_path: Path, token_file: Path) -> None:
    caps = {"jobs_per_tenant": 1, "streams_per_tenant": 1, "rollouts_per_job": 10}
    async with (
        silent_policy() as url,
        serve(tmp_path, backend=FAKE, caps=caps, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        await expect_error(a.rollout_stub.SubmitJob(_job(url, group_size=11)), EXHAUSTED, "caps.rollouts_per_job is 10")
        job_id = (await a.rollout_stub.SubmitJob(_job(url))).job_id
        await expect_error(a.rollout_stub.SubmitJob(_job(url)), EXHAUSTED, "caps.jobs_per_tenant is 1")
        other = (await b.rollout_stub.SubmitJob(_job(url))).job_id  # the cap is per tenant

        first = a.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))
        await asyncio.sleep(0.3)  # the first stream is open and waiting for rollouts
        second = a.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))
        await expect_error(second, EXHAUSTED, "caps.streams_per_tenant is 1")
        b_stream = b.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=other))
        await asyncio.sleep(0.3)
        assert b_stream.done() is False  # B's own stream is not counted against A
        first.cancel()
        await asyncio.sleep(0.3)
        again = a.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))  # the slot came back
        await asyncio.sleep(0.3)
        assert again.done() is False
        for call in (again, b_stream):
            call.cancel()

        await a.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=job_id))
        await a.rollout_stub.SubmitJob(_job(url))  # a finished job no longer counts


async def test_a_tenant_keeps_a_capped_number_of_finished_jobs(tmp_path: Path, token_file: Path) -> None:
    # submitting and cancelling in a loop left every job (a spec of up to 100,000 task ids) for the whole retention
    caps = {"finished_jobs_per_tenant": 3}
    async with (
        silent_policy() as url,
        serve(tmp_path, backend=FAKE, caps=caps, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        others = []
        for _ in range(3):  # B's finished jobs are B's: A's loop below removes none of them
            others.append((await b.rollout_stub.SubmitJob(_job(url))).job_id)
            await b.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=others[-1]))
        ids = []
        for _ in range(8):
            ids.append((await a.rollout_stub.SubmitJob(_job(url))).job_id)
            await a.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=ids[-1]))
        listed = {j.job_id for j in (await a.rollout_stub.ListJobs(pb.ListJobsRequest())).jobs}
        assert listed == set(ids[-3:])  # the last three; the oldest went before their retention ran out
        await expect_error(
            a.rollout_stub.GetJob(pb.GetJobRequest(job_id=ids[0])),
            grpc.StatusCode.NOT_FOUND,
            "a tenant keeps its last 3 finished jobs",
        )
        assert {j.job_id for j in (await b.rollout_stub.ListJobs(pb.ListJobsRequest())).jobs} == set(others)
    # and the result log holds no more of them either: a restart finds the same jobs
    async with (
        serve(tmp_path, backend=FAKE, caps=caps, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
    ):
        listed = {j.job_id for j in (await a.rollout_stub.ListJobs(pb.ListJobsRequest())).jobs}
    assert listed == set(ids[-3:])


async def test_a_job_whose_cancel_is_under_way_is_not_trimmed_from_under_it(tmp_path: Path, token_file: Path) -> None:
    # a cancelled job is finished at once but has no end time until its sandboxes are gone: it sorted as the
    # oldest finished job, a submit meanwhile removed it, and the CancelJob that was tearing it down said NOT_FOUND
    caps = {"finished_jobs_per_tenant": 1}
    slow = FAKE.model_copy(update={"destroy_latency_s": 2.0})
    async with (
        silent_policy() as url,
        serve(tmp_path, backend=slow, caps=caps, pool={"enabled": False}, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
    ):
        job_id = (await a.rollout_stub.SubmitJob(_job(url))).job_id
        for _ in range(100):  # its rollout holds a sandbox
            if (await a.rollout_stub.GetJob(pb.GetJobRequest(job_id=job_id))).in_flight:
                break
            await asyncio.sleep(0.05)
        cancel = asyncio.ensure_future(a.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=job_id)))
        await asyncio.sleep(0.5)  # the sandbox is being destroyed
        assert not cancel.done()
        await a.rollout_stub.SubmitJob(_job(url))
        status = await cancel
        assert status.job_id == job_id and status.state == pb.JOB_STATE_CANCELLED


async def test_sessions_and_raw_sandboxes_share_the_hosts_capacity_with_rollouts(tmp_path: Path) -> None:
    config: dict[str, Any] = {"capacity": {"max_sandboxes": 2}, "pool": {"enabled": False}}
    async with (
        silent_policy() as url,
        serve(tmp_path, backend=FAKE, **config) as orch,
        EnvfleetClient(orch.address) as c,
    ):
        box = await c.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))
        session = await c.session_stub.Reset(pb.ResetRequest(env="python-tool", task_id="py-000"))
        await expect_error(
            c.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE)),
            EXHAUSTED,
            "this host is at capacity",
            "capacity.max_sandboxes = 2",
        )
        await expect_error(
            c.session_stub.Reset(pb.ResetRequest(env="python-tool", task_id="py-000")),
            EXHAUSTED,
            "capacity.max_sandboxes = 2",
        )
        # a rollout waits for the capacity they hold
        job_id = (await c.rollout_stub.SubmitJob(_job(url))).job_id
        await asyncio.sleep(0.3)
        assert (orch.jobs.scheduler.in_flight, orch.jobs.scheduler.reserved) == (0, 2)

        await c.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=box.sandbox_id))
        await asyncio.sleep(0.3)
        assert orch.jobs.scheduler.in_flight == 1  # the freed share went to the queued rollout
        await c.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=job_id))
        await asyncio.sleep(0.3)
        step = await c.session_stub.Step(
            pb.StepRequest(session_id=session.session_id, action=pb.Action(final_answer="x"))
        )
        assert step.status != pb.ROLLOUT_STATUS_UNSPECIFIED  # the episode ended: its sandbox is released
        assert orch.jobs.scheduler.reserved == 0
        again = await c.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))
        await c.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=again.sandbox_id))


async def test_per_tenant_counts_name_their_caps(tmp_path: Path) -> None:
    config: dict[str, Any] = {"sessions": {"max_per_tenant": 1}, "sandboxes": {"max_per_tenant": 1}}
    async with serve(tmp_path, backend=FAKE, **config) as orch, EnvfleetClient(orch.address) as c:
        r = await c.session_stub.Reset(pb.ResetRequest(env="python-tool", task_id="py-000"))
        await expect_error(
            c.session_stub.Reset(pb.ResetRequest(env="python-tool", task_id="py-000")),
            EXHAUSTED,
            "sessions.max_per_tenant is 1",
        )
        box = await c.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))
        await expect_error(
            c.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE)),
            EXHAUSTED,
            "sandboxes.max_per_tenant is 1",
        )
        await c.session_stub.CloseSession(pb.CloseSessionRequest(session_id=r.session_id))
        await c.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=box.sandbox_id))


async def test_a_create_past_the_tenants_cap_makes_no_engine_call(tmp_path: Path) -> None:
    # the image lookup (an engine call, on the threads every sandbox start shares) came before the cap: a tenant at
    # its cap kept thousands of them in flight; and creates side by side each passed the cap, read before any held
    config: dict[str, Any] = {"sandboxes": {"max_per_tenant": 2}}
    async with serve(tmp_path, backend=FAKE, **config) as orch, EnvfleetClient(orch.address) as c:
        assert orch.sandboxes is not None
        present = orch.sandboxes._image_present
        lookups: list[str] = []

        def slow(image: str) -> bool:
            lookups.append(image)
            time.sleep(0.3)
            return bool(present(image))

        orch.sandboxes._image_present = slow
        creates = [c.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE)) for _ in range(6)]
        replies = await asyncio.gather(*creates, return_exceptions=True)
        made = [r for r in replies if isinstance(r, pb.SandboxInfo)]
        refused = [r for r in replies if isinstance(r, grpc.aio.AioRpcError)]
        assert len(made) == 2 and len(refused) == 4 and len(lookups) == 2, replies
        assert all(r.code() == EXHAUSTED and "sandboxes.max_per_tenant is 2" in str(r.details()) for r in refused)
        for box in made:
            await c.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=box.sandbox_id))


def _spec(name: str, version: str, padding: int = 4096) -> pb.EnvironmentSpec:
    return pb.EnvironmentSpec(
        name=name,
        version=version,
        tools=["submit"],
        tasks=[pb.TaskSpec(id="t", prompt="p" * padding, reference=[pb.ToolCall(name="submit", arguments="{}")])],
        scoring=pb.ScoringSpec(command="echo '{\"reward\": 1}'"),
    )


async def test_the_specs_a_tenant_keeps_registered_are_capped_across_restarts(tmp_path: Path, token_file: Path) -> None:
    from orchestrator.server.convert_specs import spec_from_pb

    # every spec of the test has the same size; two fit under the cap, a third does not
    size = len(spec_from_pb(_spec("a-env", "1")).model_dump_json())
    caps, security = {"spec_bytes_per_tenant": 2 * size + size // 2}, {"token_file": token_file}
    async with (
        serve(tmp_path, backend=FAKE, caps=caps, security=security) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        await a.env_stub.Register(_spec("a-env", "1"))
        await a.env_stub.Register(_spec("a-env", "2"))
        await expect_error(
            a.env_stub.Register(_spec("a-env", "3")),
            EXHAUSTED,
            f"{2 * size} bytes of registered specs held and {size} more asked for; caps.spec_bytes_per_tenant is "
            f"{2 * size + size // 2} per tenant",
        )
        await a.env_stub.Register(_spec("a-env", "1"))  # the same spec again is a no-op, not more bytes
        await b.env_stub.Register(_spec("b-env", "1"))  # the cap is per tenant
        await a.env_stub.Validate(_spec("a-env", "3"))  # validating keeps nothing
    # a restart counts what each tenant registered before
    async with (
        serve(tmp_path, backend=FAKE, caps=caps, security=security) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
    ):
        assert {"a-env"} <= {e.name for e in await a.list_envs()}
        await expect_error(a.env_stub.Register(_spec("a-env", "3")), EXHAUSTED, "caps.spec_bytes_per_tenant")


async def test_the_environments_a_tenant_keeps_registered_are_counted_across_restarts(
    tmp_path: Path, token_file: Path
) -> None:
    # only their bytes were capped: 12,500 small public versions of one tenant (59 MB of specs) took every tenant's
    # List past the message limit, and an unknown name's error listed every one of them
    caps, security = {"environments_per_tenant": 2}, {"token_file": token_file}
    async with (
        serve(tmp_path, backend=FAKE, caps=caps, security=security) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        await a.env_stub.Register(_spec("a-env", "1", padding=16))
        await a.env_stub.Register(_spec("a-other", "1", padding=16))
        await expect_error(
            a.env_stub.Register(_spec("a-env", "2", padding=16)),
            EXHAUSTED,
            "2 environments registered (versions count) held and 1 more asked for; caps.environments_per_tenant is 2",
        )
        await a.env_stub.Register(_spec("a-env", "1", padding=16))  # the same again is a no-op
        await b.env_stub.Register(_spec("b-env", "1", padding=16))  # the cap is per tenant
    async with (
        serve(tmp_path, backend=FAKE, caps=caps, security=security) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
    ):
        await expect_error(a.env_stub.Register(_spec("a-env", "2", padding=16)), EXHAUSTED, "environments_per_tenant")


def test_an_unknown_environments_error_lists_a_few_names() -> None:
    from orchestrator.core.errors import EnvironmentNotFoundError
    from orchestrator.service.declarative import make_environment, parse_spec
    from orchestrator.service.registry import KNOWN_IN_HINT, Registry
    from tests.orchestrator.test_registration import word_count_spec

    registry = Registry()
    for i in range(100):
        registry.register(make_environment(parse_spec(word_count_spec(name=f"env-{i:03d}"))))
    with pytest.raises(EnvironmentNotFoundError) as e:
        registry.lookup("zzzzzzzz")
    assert (
        "env-000" in str(e.value)
        and f"and {100 - KNOWN_IN_HINT} more" in str(e.value)
        and "env-099" not in str(e.value)
    )


# A trainer whose process stops answering (its host crashed, a partition): its connection stays up as far as the
# kernel knows, for hours
_STOPPED_TRAINER = """
import asyncio, sys
from orchestrator.client.sdk import EnvfleetClient
from protos import orchestrator_pb2 as pb

async def main(address, token, job_id):
    async with EnvfleetClient(address, token=token) as client:
        call = client.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))
        print("streaming", flush=True)
        async for _ in call:
            pass

asyncio.run(main(*sys.argv[1:]))
"""


async def test_a_stream_of_a_trainer_that_stops_answering_gives_its_slot_back(tmp_path: Path, token_file: Path) -> None:
    # without keepalive the server never found out: the stream held one of the tenant's streams_per_tenant (and its
    # job past its retention) until the kernel gave up on the connection, two hours on
    import os
    import signal
    import sys

    caps = {"streams_per_tenant": 1}
    async with (
        silent_policy() as url,
        serve(tmp_path, backend=FAKE, caps=caps, security={"token_file": token_file}, client_keepalive_s=1.0) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
    ):
        job_id = (await a.rollout_stub.SubmitJob(_job(url))).job_id
        trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _STOPPED_TRAINER, orch.address, TOKEN_A, job_id, stdout=asyncio.subprocess.PIPE
        )
        try:
            assert trainer.stdout is not None
            assert (await asyncio.wait_for(trainer.stdout.readline(), 30)).strip() == b"streaming"
            await asyncio.sleep(0.5)
            second = a.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))
            await expect_error(second, EXHAUSTED, "caps.streams_per_tenant is 1")  # the trainer's stream is open
            os.kill(trainer.pid, signal.SIGSTOP)
            for _ in range(100):  # a ping every second, answered within a second, or the connection is cut
                again = a.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))
                await asyncio.sleep(0.2)
                if not again.done():
                    break
            assert not again.done(), "the stopped trainer's stream still holds the tenant's only slot"
            again.cancel()
        finally:
            trainer.kill()
            await trainer.wait()


async def test_calls_in_flight_are_capped_per_tenant(tmp_path: Path, token_file: Path) -> None:
    """A tenant's waiting calls are capped (each holds memory however little it asks): ExecStreams that never send
    their request wait 30 s apiece, and past caps.calls_per_tenant the next call is refused busy, whatever it is,
    while another tenant's calls go on; one call ended, a call fits again."""
    async with (
        serve(tmp_path, backend=FAKE, caps={"calls_per_tenant": 3}, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        quiet = asyncio.Event()

        async def nothing() -> Any:
            await quiet.wait()
            yield pb.ExecInput()  # pragma: no cover - never reached

        waiting = [a.sandbox_stub.ExecStream(nothing()) for _ in range(3)]
        reads = [asyncio.ensure_future(call.read()) for call in waiting]
        await asyncio.sleep(0.5)  # the three are in their handlers, waiting for a first message
        assert not any(r.done() for r in reads)
        await expect_error(a.sandbox_stub.List(pb.ListSandboxesRequest()), EXHAUSTED, "caps.calls_per_tenant is 3")
        await b.sandbox_stub.List(pb.ListSandboxesRequest())  # the cap is per tenant
        waiting[0].cancel()
        await asyncio.sleep(0.3)
        await a.sandbox_stub.List(pb.ListSandboxesRequest())
        for call in waiting:
            call.cancel()
        await asyncio.gather(*reads, return_exceptions=True)


async def test_a_register_cancelled_as_its_spec_is_saved_is_kept_and_counted(tmp_path: Path, token_file: Path) -> None:
    # a Register whose deadline came while the spec was being saved left the file on disk, unregistered and
    # uncounted; the next start loaded it past the tenant's cap (a tenant could stack specs by cancelling on time)
    import threading

    from orchestrator.server.convert_specs import spec_from_pb

    size = len(spec_from_pb(_spec("a-env", "1")).model_dump_json())
    caps, security = {"spec_bytes_per_tenant": size + size // 2}, {"token_file": token_file}
    async with (
        serve(tmp_path, backend=FAKE, caps=caps, security=security) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
    ):
        assert orch.registrar is not None
        store = orch.registrar._store
        save, saving, go = store.save, threading.Event(), threading.Event()

        def slow(record: Any) -> None:
            saving.set()
            go.wait(30)
            save(record)

        store.save = slow  # type: ignore[method-assign]
        call = a.env_stub.Register(_spec("a-env", "1"))
        assert await asyncio.to_thread(saving.wait, 30)
        call.cancel()
        await asyncio.sleep(0.2)  # the call is gone; its save goes on
        go.set()
        for _ in range(50):
            if "a-env" in {e.name for e in await a.list_envs()}:
                break
            await asyncio.sleep(0.1)
        assert "a-env" in {e.name for e in await a.list_envs()}  # registered, and counted:
        await expect_error(a.env_stub.Register(_spec("a-env", "2")), EXHAUSTED, "caps.spec_bytes_per_tenant")


async def test_a_registered_spec_that_no_longer_loads_keeps_its_name(tmp_path: Path, token_file: Path) -> None:
    # a stored spec a tightened check refuses was skipped at the start: its name was anyone's, and another tenant's
    # registration of it replaced the file (the owner's jobs of it were then cancelled as "environment gone")
    import json

    security = {"token_file": token_file}
    async with (
        serve(tmp_path, backend=FAKE, security=security) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
    ):
        await a.env_stub.Register(_spec("a-env", "1"))
    (stored,) = (tmp_path / "environments").glob("a-env@1.json")
    record = json.loads(stored.read_text())
    record["spec"]["no_such_field"] = 1  # what a newer check would refuse
    stored.write_text(json.dumps(record))
    async with (
        serve(tmp_path, backend=FAKE, security=security) as orch,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        await expect_error(
            b.env_stub.Register(_spec("a-env", "1")), grpc.StatusCode.PERMISSION_DENIED, "belongs to another tenant"
        )
    assert json.loads(stored.read_text())["owner"] == "team-a"


async def test_a_tenants_registration_calls_waiting_for_its_check_slot_are_capped(
    tmp_path: Path, token_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each call waiting for the tenant's one check slot held its request (up to 64 MiB; hundreds of MiB once
    # converted), and nothing refused the next: a dozen behind one slow check took 4.4 GiB of the control plane
    from orchestrator.service import registration
    from tests.orchestrator.test_registration import to_pb, word_count_spec

    release = asyncio.Event()

    async def slow(self: registration.Registrar, spec: Any, tenant: str) -> registration.ValidationResult:
        await release.wait()  # a check that takes a while (the fake backend runs no reference solution)
        return registration.ValidationResult(env=spec.ref(), image="checked", num_tasks=1)

    monkeypatch.setattr(registration.Registrar, "_validated", slow)
    async with (
        serve(tmp_path, backend=FAKE, security={"token_file": token_file}) as orch,
        EnvfleetClient(orch.address, token=TOKEN_A) as a,
        EnvfleetClient(orch.address, token=TOKEN_B) as b,
    ):
        spec = to_pb(word_count_spec())
        under_way = [
            asyncio.ensure_future(a.env_stub.Validate(spec)) for _ in range(1 + registration.MAX_WAITING_CHECKS)
        ]
        await asyncio.sleep(0.5)
        details = await expect_error(a.env_stub.Validate(spec), EXHAUSTED, "environment check(s) under way")
        assert f"{1 + registration.MAX_WAITING_CHECKS} per tenant" in details
        b_check = asyncio.ensure_future(b.env_stub.Validate(spec))  # B's own are not A's to spend
        await asyncio.sleep(0.2)
        release.set()
        for report in await asyncio.gather(*under_way, b_check):
            assert report.num_tasks > 0, report
        assert (await a.env_stub.Validate(spec)).num_tasks > 0  # and given back


async def test_a_spec_is_converted_off_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # converting a spec of 100,000 tasks (each task's JSON parsed and checked) took 2-30 s on the event loop: another
    # tenant's ListJobs waited 6.6 s behind one Validate, and every stream and rollout with it
    import threading

    from orchestrator.server import services
    from orchestrator.server.convert_specs import spec_from_pb
    from tests.orchestrator.test_registration import to_pb, word_count_spec

    threads: list[threading.Thread] = []
    convert = spec_from_pb

    def watched(request: Any) -> Any:
        threads.append(threading.current_thread())
        return convert(request)

    monkeypatch.setattr(services, "spec_from_pb", watched)
    async with serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as client:
        bad = to_pb({**word_count_spec(), "tools": ["no-such-tool"]})
        await expect_error(client.env_stub.Validate(bad), grpc.StatusCode.INVALID_ARGUMENT, "no-such-tool")
    assert threads and threading.main_thread() not in threads


async def test_a_task_named_many_times_is_kept_once(tmp_path: Path) -> None:
    # the job's rollouts counted each task once, but its spec kept every copy: 100,000 copies of one long id were
    # 20 MiB of memory and 12 MiB of the log a job, for as many jobs as a tenant keeps
    async with silent_policy() as url, serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as c:
        spec = _job(url, group_size=2)
        spec.tasks.ids[:] = ["py-001", "py-000"] * 50_000
        reply = await c.rollout_stub.SubmitJob(spec)
        assert reply.num_rollouts == 4
        assert orch.jobs._jobs[reply.job_id].spec.tasks.ids == ["py-001", "py-000"]
        (stored,) = [j for j in await orch.jobs.store.jobs() if j.job_id == reply.job_id]
        assert stored.spec.tasks.ids == ["py-001", "py-000"]
        await c.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=reply.job_id))


async def test_jobs_trimmed_together_stay_removed_when_the_submit_is_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the finished jobs a submit trims are forgotten at once and removed one by one: a submit cancelled during the
    # first removal left the others in the log, unmarked, and the next start loaded them again
    async with silent_policy() as url:
        async with serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as c:
            old = []
            for _ in range(3):
                old.append((await c.rollout_stub.SubmitJob(_job(url))).job_id)
                await c.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=old[-1]))
        async with serve(tmp_path, backend=FAKE, caps={"finished_jobs_per_tenant": 1}) as orch:
            removing = asyncio.Event()

            async def hangs(job_id: str) -> None:
                removing.set()
                await asyncio.Event().wait()

            monkeypatch.setattr(orch.jobs.store, "remove_job", hangs)
            submit = asyncio.ensure_future(orch.jobs.submit(job_spec_from_pb(_job(url))))
            await asyncio.wait_for(removing.wait(), 10)
            submit.cancel()
            await asyncio.gather(submit, return_exceptions=True)
        async with serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as c:
            listed = {j.job_id for j in (await c.rollout_stub.ListJobs(pb.ListJobsRequest())).jobs}
    assert not listed & set(old), listed
