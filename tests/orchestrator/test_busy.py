"""A refusal that may succeed later (the host full, a tenant's sessions, sandboxes or jobs at their cap) says so with
google.rpc.RetryInfo, one that never will (a sandbox over the host's capacity) does not; the adapters' Reset asks
again while the server is busy, up to busy_wait_s, and raises a permanent refusal at once. Real gRPC, fake backend.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2

from integrations.session import AsyncSessions, SyncSessions
from orchestrator.client import busy
from orchestrator.client.busy import retry_after, retry_busy_sync
from orchestrator.client.gym import SessionEnv
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.models import JobSpec, TaskSelection
from orchestrator.core.policy import PolicyEndpoint
from protos import orchestrator_pb2 as pb
from tests.orchestrator.conftest import ENV
from tests.orchestrator.servers import FAKE, FAKE_BASE_IMAGE, serve, silent_policy

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == EXHAUSTED, e.value.details()
    return e.value


def reset(stub: Any) -> Any:
    return stub.Reset(pb.ResetRequest(env=ENV, task_id="py-000"))


async def test_caps_that_free_up_carry_retry_info_and_one_that_never_fits_does_not(tmp_path: Path) -> None:
    config: dict[str, Any] = {
        "sessions": {"max_per_tenant": 1},
        "sandboxes": {"max_per_tenant": 1},
        "caps": {"jobs_per_tenant": 1, "streams_per_tenant": 1},
        "pool": {"enabled": False},
    }
    async with (
        silent_policy() as url,
        serve(tmp_path, backend=FAKE, **config) as orch,
        EnvfleetClient(orch.address) as c,
    ):
        session = await reset(c.session_stub)
        e = await refusal(reset(c.session_stub))
        assert "sessions.max_per_tenant is 1" in str(e.details()) and retry_after(e) == 1.0
        box = await c.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))
        e = await refusal(c.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE)))
        assert "sandboxes.max_per_tenant is 1" in str(e.details()) and retry_after(e) == 1.0
        # the status in the trailer is the call's own (gRPC's rich error model: same code, same message)
        details = dict(e.trailing_metadata() or ())[busy.STATUS_DETAILS_KEY]
        status = status_pb2.Status.FromString(details)
        assert (status.code, status.message) == (code_pb2.RESOURCE_EXHAUSTED, e.details())
        assert status.details[0].Is(error_details_pb2.RetryInfo.DESCRIPTOR)

        spec = JobSpec(env=ENV, policy=PolicyEndpoint(base_url=url), tasks=TaskSelection(kind="ids", ids=["py-000"]))
        job_id = await c.submit(spec)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await c.submit(spec)
        assert "caps.jobs_per_tenant is 1" in str(refused.value.details()) and retry_after(refused.value) == 1.0
        # a stream over the cap: the slot frees when another stream ends (a trainer reconnecting before the server
        # has found its dead stream gets this, and may ask again)
        first = c.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id))
        await asyncio.sleep(0.3)
        e = await refusal(c.rollout_stub.StreamRollouts(pb.StreamRolloutsRequest(job_id=job_id)).read())
        assert "caps.streams_per_tenant is 1" in str(e.details()) and retry_after(e) == 1.0
        first.cancel()
        await c.rollout_stub.CancelJob(pb.CancelJobRequest(job_id=job_id))
        await c.session_stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id))
        await c.sandbox_stub.Delete(pb.DeleteSandboxRequest(sandbox_id=box.sandbox_id))

    # the host full: the same for a session and a raw sandbox; a sandbox bigger than the host: never worth a retry
    async with serve(tmp_path, backend=FAKE, capacity={"max_sandboxes": 1}) as orch, EnvfleetClient(orch.address) as c:
        session = await reset(c.session_stub)
        e = await refusal(reset(c.session_stub))
        assert "this host is at capacity" in str(e.details()) and retry_after(e) == 1.0
        e = await refusal(c.sandbox_stub.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE)))
        assert "this host is at capacity" in str(e.details()) and retry_after(e) == 1.0
        await c.session_stub.CloseSession(pb.CloseSessionRequest(session_id=session.session_id))
    async with serve(tmp_path, backend=FAKE, capacity={"cpus": 0.01}) as orch, EnvfleetClient(orch.address) as c:
        e = await refusal(reset(c.session_stub))
        assert "lower the environment's limits or raise capacity" in str(e.details()) and retry_after(e) is None


async def test_async_sessions_reset_waits_for_room_and_gives_up_on_what_never_fits(tmp_path: Path) -> None:
    async with (
        serve(tmp_path, backend=FAKE, sessions={"max_per_tenant": 1}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        sessions = AsyncSessions(client, busy_wait_s=30)
        first = await sessions.reset(ENV, "py-000")
        second = asyncio.ensure_future(sessions.reset(ENV, "py-000"))
        await asyncio.sleep(1.5)  # it asked, was refused, and waits
        assert not second.done() and orch.sessions is not None and orch.sessions.open_sessions() == 1
        await sessions.close(first.session_id)
        opening = await asyncio.wait_for(second, 20)
        assert opening.session_id != first.session_id and opening.task_id == "py-000"

        # busy_wait_s=0: the first refusal is raised
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await AsyncSessions(client, busy_wait_s=0).reset(ENV, "py-000")
        assert e.value.code() == EXHAUSTED
        await sessions.close(opening.session_id)

    async with serve(tmp_path, backend=FAKE, capacity={"cpus": 0.01}) as orch, EnvfleetClient(orch.address) as client:
        t0 = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await AsyncSessions(client, busy_wait_s=30).reset(ENV, "py-000")
        assert e.value.code() == EXHAUSTED and time.monotonic() - t0 < 5  # at once, not after 30 s


async def test_sync_sessions_and_gym_reset_wait_for_room_until_busy_wait_s(tmp_path: Path) -> None:
    async with (
        serve(tmp_path, backend=FAKE, sessions={"max_per_tenant": 1}) as orch,
        EnvfleetClient(orch.address) as client,
    ):
        held = await AsyncSessions(client).reset(ENV, "py-000")
        sync = SyncSessions(orch.address, busy_wait_s=30)
        gym = SessionEnv(orch.address, ENV, busy_wait_s=30)
        impatient = SyncSessions(orch.address, busy_wait_s=2)
        out: dict[str, Any] = {}

        def run(name: str, call: Any) -> None:
            try:
                out[name] = call()
            except grpc.RpcError as e:
                out[name] = e

        threads = [
            threading.Thread(target=run, args=("sync", lambda: sync.reset(ENV, "py-000"))),
            threading.Thread(target=run, args=("gym", lambda: gym.reset(options={"task_id": "py-000"}))),
            threading.Thread(target=run, args=("impatient", lambda: impatient.reset(ENV, "py-000"))),
        ]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        await asyncio.to_thread(threads[2].join, 30)
        assert isinstance(out["impatient"], grpc.RpcError) and out["impatient"].code() == EXHAUSTED
        assert 1.5 < time.monotonic() - t0 < 10  # it asked until its 2 s were up
        assert not out.get("sync") and not out.get("gym")
        await AsyncSessions(client).close(held.session_id)
        # one of them gets the freed session; it closes it, and the other gets one in turn
        for _ in range(400):
            if out.get("sync") or out.get("gym"):
                break
            await asyncio.sleep(0.05)
        if "sync" in out:
            await asyncio.to_thread(sync.close, out["sync"].session_id)
        else:
            await asyncio.to_thread(gym.close)
        for t in threads[:2]:
            await asyncio.to_thread(t.join, 30)
        assert out["sync"].task_id == "py-000" and out["gym"][1]["task_id"] == "py-000"
        await asyncio.to_thread(sync.close, out["sync"].session_id)  # NOT_FOUND, already closed: nothing to do
        await asyncio.to_thread(gym.close)
        for s in (sync, impatient):
            await asyncio.to_thread(s.shutdown)
        assert orch.sessions is not None and orch.sessions.open_sessions() == 0


class _Refusal(grpc.RpcError):  # type: ignore[misc]
    def __init__(self, code: grpc.StatusCode, trailer: tuple[tuple[str, Any], ...]) -> None:
        self._code, self._trailer = code, trailer

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return "busy"

    def trailing_metadata(self) -> tuple[tuple[str, Any], ...]:
        return self._trailer


def _trailer(code: int, delay_s: float) -> tuple[tuple[str, Any], ...]:
    info = error_details_pb2.RetryInfo()
    info.retry_delay.FromNanoseconds(int(delay_s * 1e9))
    status = status_pb2.Status(code=code, message="busy")
    status.details.add().Pack(info)
    return ((busy.STATUS_DETAILS_KEY, status.SerializeToString()),)


def test_retry_info_is_read_only_where_it_matches_the_status() -> None:
    assert retry_after(_Refusal(EXHAUSTED, _trailer(code_pb2.RESOURCE_EXHAUSTED, 2.5))) == 2.5
    assert retry_after(_Refusal(EXHAUSTED, ())) is None
    # another call's status, another code, unreadable bytes: no promise to wait for
    assert retry_after(_Refusal(EXHAUSTED, _trailer(code_pb2.UNAVAILABLE, 1))) is None
    assert retry_after(_Refusal(grpc.StatusCode.UNAVAILABLE, _trailer(code_pb2.RESOURCE_EXHAUSTED, 1))) is None
    assert retry_after(_Refusal(EXHAUSTED, ((busy.STATUS_DETAILS_KEY, b"\xff\xff"),))) is None

    calls: list[float] = []

    def call() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise _Refusal(EXHAUSTED, _trailer(code_pb2.RESOURCE_EXHAUSTED, 0.1))
        return "ok"

    assert retry_busy_sync(call, wait_s=10) == "ok" and len(calls) == 3
    assert all(b - a >= 0.1 for a, b in itertools.pairwise(calls))  # never sooner than the server asked
