"""No unbounded buffering in the orchestrator: Download is counted as it streams and refused at the cap (a 1 GiB
sparse file no longer passes through the server's memory), Exec stdin is capped per request and in flight per
tenant, open Execs per tenant are capped, group snapshots are bounded per snapshot and per job, and a warm pool
nothing uses any more is forgotten (its key is made by whoever names the image, limits and lease); file replies
(ReadFile, Download) a tenant has in flight are counted until they are sent, a client that never reads included."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import sys
import tarfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from orchestrator.backends.config import ExecRule, FakeBackendConfig
from orchestrator.backends.fake import FakeBackend
from orchestrator.backends.pool import PoolConfig, SandboxPool, lease_for
from orchestrator.client.sdk import EnvfleetClient
from orchestrator.core.errors import QuotaExceededError
from orchestrator.core.sandbox import SandboxSpec
from orchestrator.rollout.snapshots import SnapshotBudget, SnapshotCache
from orchestrator.service.caps import TenantBytes
from orchestrator.service.tenancy import LOCAL_TENANT
from protos import orchestrator_pb2 as pb
from tests.conftest import REPO, TEST_OWNER
from tests.orchestrator.servers import FAKE, FAKE_BASE_IMAGE, expect_error, expect_unreadable_exec_stream, serve

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
MiB = 1 << 20


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@contextlib.asynccontextmanager
async def peak_rss_growth() -> AsyncIterator[list[int]]:
    """Samples this process's RSS every 5 ms while the block runs; yields [growth] filled in at the end."""
    base, peak, out = _rss(), [0], [0]

    async def sample() -> None:
        while True:
            peak[0] = max(peak[0], _rss())
            await asyncio.sleep(0.005)

    task = asyncio.create_task(sample())
    try:
        yield out
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        out[0] = max(peak[0], _rss()) - base


async def test_download_of_a_huge_sparse_file_is_refused_without_reading_it(tmp_path: Path, base_image: str) -> None:
    """Real envd: a 1 GiB sparse file tars to 1 GiB; the orchestrator stops reading at the 32 MiB cap."""
    async with serve(tmp_path) as orch, EnvfleetClient(orch.address) as c:
        ss = c.sandbox_stub
        # room for envd to spool the archive inside the sandbox: the orchestrator is what must not hold it
        limits = pb.SandboxLimits(memory_mb=3072, tmp_mb=2048)
        sid = (await ss.Create(pb.CreateSandboxRequest(image=base_image, limits=limits))).sandbox_id
        made = [ev async for ev in ss.Exec(pb.ExecRequest(sandbox_id=sid, shell="truncate -s 1G big"))]
        assert made[-1].ended.exit_code == 0, made
        async with peak_rss_growth() as growth:
            await expect_error(
                ss.Download(pb.SandboxDownloadRequest(sandbox_id=sid, path="big")),
                EXHAUSTED,
                f"over sandboxes.max_output = {32 * MiB} bytes",
            )
        # before: the server grew by 2 GiB; now by the cap and a chunk or two, plus noise
        assert growth[0] < 200 * MiB, f"the server grew by {growth[0] / MiB:.0f} MiB"
        await ss.WriteFile(pb.SandboxWriteFileRequest(sandbox_id=sid, path="small", content=b"x" * 1000))
        assert (await ss.Download(pb.SandboxDownloadRequest(sandbox_id=sid, path="small"))).tar
        await ss.Delete(pb.DeleteSandboxRequest(sandbox_id=sid))


async def test_download_cap_names_the_setting(tmp_path: Path) -> None:
    async with (
        serve(tmp_path, backend=FAKE, sandboxes={"max_output": MiB}) as orch,
        EnvfleetClient(orch.address) as c,
    ):
        ss = c.sandbox_stub
        sid = (await ss.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))).sandbox_id
        await ss.WriteFile(pb.SandboxWriteFileRequest(sandbox_id=sid, path="big", content=b"x" * (2 * MiB)))
        await expect_error(
            ss.Download(pb.SandboxDownloadRequest(sandbox_id=sid, path="big")),
            EXHAUSTED,
            f"the archive of 'big' is over sandboxes.max_output = {MiB} bytes",
        )
        await ss.WriteFile(pb.SandboxWriteFileRequest(sandbox_id=sid, path="small", content=b"x" * 1000))
        assert (await ss.Download(pb.SandboxDownloadRequest(sandbox_id=sid, path="small"))).tar


async def test_exec_stdin_and_open_execs_are_capped(tmp_path: Path) -> None:
    backend = FakeBackendConfig(owner=TEST_OWNER, rules=(ExecRule(match="^sleepy", latency_s=30),))
    caps = {"exec_stdin_bytes": 2 * MiB, "stdin_bytes_per_tenant": 3 * MiB, "streams_per_tenant": 2}
    async with serve(tmp_path, backend=backend, caps=caps) as orch, EnvfleetClient(orch.address) as c:
        ss = c.sandbox_stub
        sid = (await ss.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))).sandbox_id

        def run(stdin: bytes, shell: str = "sleepy") -> grpc.aio.UnaryStreamCall:
            return ss.Exec(pb.ExecRequest(sandbox_id=sid, shell=shell, stdin=stdin))

        await expect_error(run(b"x" * (2 * MiB + 1)), EXHAUSTED, "caps.exec_stdin_bytes is 2097152 per Exec")
        first = run(b"x" * (2 * MiB))
        assert (await first.read()).WhichOneof("event") == "started"  # it holds 2 MiB of the tenant's 3
        await expect_error(run(b"y" * (2 * MiB)), EXHAUSTED, "caps.stdin_bytes_per_tenant is 3145728 per tenant")
        second = run(b"z" * MiB)
        assert (await second.read()).WhichOneof("event") == "started"
        await expect_error(run(b""), EXHAUSTED, "caps.streams_per_tenant is 2 per tenant")
        first.cancel()
        second.cancel()
        await asyncio.sleep(0.2)
        events = [ev.WhichOneof("event") async for ev in run(b"q" * (2 * MiB), shell="cat")]
        assert events[0] == "started" and events[-1] == "ended"  # the budget came back


async def test_snapshots_are_bounded_per_snapshot_per_job_and_in_all() -> None:
    backend = FakeBackend(FakeBackendConfig())
    budget = SnapshotBudget(max_bytes=3 * MiB, per_job_count=8, per_job_bytes=4 * MiB, total_bytes=5 * MiB)
    cache = SnapshotCache(budget)
    setups: list[str] = []

    async def prepared(job: str, task: str, size: int) -> str:
        # a workspace under /tmp: the fake refuses to restore a snapshot into "/" (envd allows it)
        async with await backend.create(SandboxSpec(image=FAKE_BASE_IMAGE, workspace="/tmp/ws")) as box:

            async def setup() -> None:
                setups.append(task)
                await box.write_file("data", b"d" * size)

            return await cache.prepare((job, task), box, box.spec.workspace, setup)

    try:
        # over the per-snapshot cap: not held; every sample runs its own setup
        assert [await prepared("j1", "huge", 5 * MiB) for _ in range(3)] == ["fallback"] * 3
        assert setups.count("huge") == 3 and cache.held_bytes("j1") == 0
        # within it: held once, restored for the others
        assert [await prepared("j1", "a", 2 * MiB) for _ in range(2)] == ["built", "restored"]
        assert 2 * MiB < cache.held_bytes("j1") < 3 * MiB
        # a second one would take the job past its 4 MiB budget
        assert [await prepared("j1", "b", 2 * MiB) for _ in range(2)] == ["fallback", "fallback"]
        assert cache.held_bytes("j1") < 3 * MiB
        assert await prepared("j2", "b", 2 * MiB) == "built"  # the budget is per job
        # but the process holds at most 5 MiB, however many jobs there are (a tenant's many jobs added up before)
        assert [await prepared("j3", "c", 2 * MiB) for _ in range(2)] == ["fallback", "fallback"]
        assert 4 * MiB < cache.total_bytes() <= 5 * MiB
        cache.forget_job("j1")
        assert cache.held_bytes("j1") == 0 and cache.total_bytes() < 3 * MiB
        assert await prepared("j4", "c", 2 * MiB) == "built"
    finally:
        await backend.close()


class _SlowDownload:
    """A sandbox double whose workspace download runs `during` first (it has the workspace `/tmp/ws`)."""

    def __init__(self, during: Callable[[], None], size: int) -> None:
        self.during, self.size = during, size

    async def download_at_most(self, path: str, max_bytes: int) -> bytes:
        await asyncio.sleep(0.01)
        self.during()
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            info = tarfile.TarInfo("ws/data")
            info.size = self.size
            tar.addfile(info, io.BytesIO(b"d" * self.size))
        return buf.getvalue()


async def test_snapshots_read_at_once_are_not_refused_for_room_they_never_took() -> None:
    # each read in flight reserved its whole room (up to max_bytes): 20 small snapshots at once reserved 5 GiB
    # and the last ones were refused, their groups never snapshotted
    cache = SnapshotCache(SnapshotBudget(max_bytes=256 * MiB, total_bytes=1 << 30))

    async def setup() -> None:
        pass

    outcomes = await asyncio.gather(
        *(cache.prepare((f"j{i}", "t"), _SlowDownload(lambda: None, 1000), "/tmp/ws", setup) for i in range(20))  # type: ignore[arg-type]
    )
    assert outcomes == ["built"] * 20 and 20 * 1000 < cache.total_bytes() < MiB


async def test_a_waiting_call_cancelled_as_the_budget_frees_takes_none_of_it() -> None:
    # a cancelled task's turn is cancelled at once, and the task leaves the line only when it next runs: a release
    # in between granted the cancelled turn (set_result raised on it) and counted its bytes for good, so every later
    # read of the tenant waited for ever (seen in CI: a Download past a deadline, then the next one never came)
    budget = TenantBytes(10, "caps.read_bytes_per_tenant", "bytes of replies")
    first = await budget.take("a", 10)
    waiting = asyncio.create_task(budget.take("a", 5))
    await asyncio.sleep(0.01)
    waiting.cancel()
    first.release()  # before the cancelled task runs
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert budget.held("a") == 0 and not budget._waiting
    async with asyncio.timeout(1):
        (await budget.take("a", 10)).release()


async def test_a_groups_snapshot_is_let_go_once_its_samples_restored_it() -> None:
    # held until the job's end, a job of more groups than per_job_count had snapshots for its first groups only (a
    # 100,000-task job: 0.26% of them), the rest each running every sample's setup, and kept the bytes meanwhile
    backend = FakeBackend(FakeBackendConfig())
    cache = SnapshotCache(SnapshotBudget(max_bytes=MiB, per_job_count=2, per_job_bytes=2 * MiB, total_bytes=4 * MiB))
    setups: list[str] = []

    async def prepared(task: str, sample: int) -> str:
        async with await backend.create(SandboxSpec(image=FAKE_BASE_IMAGE, workspace="/tmp/ws")) as box:

            async def setup() -> None:
                setups.append(task)
                await box.write_file("data", b"d" * 1000)

            return await cache.prepare(("j", task), box, box.spec.workspace, setup, restores=2, sample=sample)

    try:
        for task in ("a", "b", "c", "d", "e"):  # groups of 3, one after another: more groups than the job may hold
            assert [await prepared(task, k) for k in range(3)] == ["built", "restored", "restored"], task
            assert cache.held_bytes("j") == 0
        assert setups == ["a", "b", "c", "d", "e"]
        assert await prepared("a", 1) == "fallback"  # a retry after the group's samples: its own setup
        # a retry counts as its sample, the builder's too: the snapshot waits for each other sample once
        assert [await prepared("f", k) for k in (0, 0, 1, 1)] == ["built", "restored", "restored", "restored"]
        assert cache.held_bytes("j") > 0
        assert await prepared("f", 2) == "restored" and cache.held_bytes("j") == 0
    finally:
        await backend.close()


async def test_a_jobs_snapshots_read_side_by_side_keep_to_its_budget() -> None:
    # the job's room was read before each download: six groups of one job read at once each took all of it, and the
    # job held 550 KB against a budget of 200 KB (one tenant's job could take the whole process's budget)
    cache = SnapshotCache(SnapshotBudget(max_bytes=100_000, per_job_bytes=200_000, total_bytes=10 * MiB))

    async def setup() -> None:
        pass

    outcomes = await asyncio.gather(
        *(cache.prepare(("j", f"t{i}"), _SlowDownload(lambda: None, 80_000), "/tmp/ws", setup) for i in range(6))  # type: ignore[arg-type]
    )
    assert outcomes.count("built") == 2 and outcomes.count("fallback") == 4, outcomes
    assert cache.held_bytes("j") <= 200_000


async def test_a_job_forgotten_while_its_snapshot_is_read_holds_nothing() -> None:
    cache = SnapshotCache(SnapshotBudget(max_bytes=8 * MiB, total_bytes=16 * MiB))

    async def setup() -> None:
        pass

    box = _SlowDownload(lambda: cache.forget_job("j"), MiB)
    await cache.prepare(("j", "t"), box, "/tmp/ws", setup)  # type: ignore[arg-type]
    assert cache.total_bytes() == 0 and cache.held_bytes("j") == 0 and len(cache) == 0


# The trainer runs in its own process, so that only the server's memory is measured here.
_TRAINER = """
import asyncio, json, sys
import grpc
import pytest
from orchestrator.client.sdk import EnvfleetClient
from protos import orchestrator_pb2 as pb

async def main(address: str, sid: str, n: int, size: int) -> None:
    async with EnvfleetClient(address) as c:
        async def one() -> str:
            req = pb.ExecRequest(sandbox_id=sid, shell="sleep 1; wc -c", stdin=b"s" * size)
            try:
                async for _ in c.sandbox_stub.Exec(req):
                    pass
            except grpc.aio.AioRpcError as e:
                return f"{e.code().name}: {e.details()}"
            return "ran"
        print(json.dumps(await asyncio.gather(*(one() for _ in range(n)))))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


async def test_concurrent_large_stdin_is_bounded_per_tenant(tmp_path: Path, base_image: str) -> None:
    """Real envd: 8 Execs at once with 16 MiB of stdin each (the per-request cap) against a tenant budget of 32 MiB.
    Before, all 8 ran and the server grew by 717 MiB (5.6x the stdin); now 2 run and the rest are refused before
    their stdin is copied out of the request."""
    caps = {"stdin_bytes_per_tenant": 32 * MiB}
    async with serve(tmp_path, caps=caps) as orch, EnvfleetClient(orch.address) as c:
        ss = c.sandbox_stub
        sid = (await ss.Create(pb.CreateSandboxRequest(image=base_image))).sandbox_id
        async with peak_rss_growth() as growth:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _TRAINER,
                orch.address,
                sid,
                "8",
                str(16 * MiB),
                cwd=REPO,
                stdout=asyncio.subprocess.PIPE,
            )
            out, _ = await proc.communicate()
        outcomes = json.loads(out)
        ran = outcomes.count("ran")
        refused = [o for o in outcomes if o != "ran"]
        assert 1 <= ran <= 2 and refused, outcomes
        assert all(o.startswith("RESOURCE_EXHAUSTED") and "caps.stdin_bytes_per_tenant" in o for o in refused)
        # the 8 request messages (gRPC receives and parses each whole before any handler runs, ~1.6x) and the copies
        # of the <= 32 MiB handed on to envd (~3.5x): measured 380 to 400 MiB, against 717 MiB before
        assert growth[0] < 480 * MiB, f"the server grew by {growth[0] / MiB:.0f} MiB"
        await ss.Delete(pb.DeleteSandboxRequest(sandbox_id=sid))


async def test_a_lower_message_cap_refuses_large_requests_before_they_are_read(tmp_path: Path) -> None:
    """gRPC reads a message whole before any handler; `max_message_bytes` refuses one from its length prefix."""
    config: dict[str, Any] = {"max_message_bytes": 8 * MiB, "sandboxes": {"max_output": 4 * MiB}}
    async with serve(tmp_path, backend=FAKE, **config) as orch, EnvfleetClient(orch.address) as c:
        ss = c.sandbox_stub
        sid = (await ss.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))).sandbox_id
        await expect_error(
            ss.Exec(pb.ExecRequest(sandbox_id=sid, shell="cat", stdin=b"x" * (10 * MiB))),
            EXHAUSTED,
            "Received message larger than max",
        )
        events = [ev.WhichOneof("event") async for ev in ss.Exec(pb.ExecRequest(sandbox_id=sid, shell="true"))]
        assert events[-1] == "ended"


# ExecStream: each trainer streams its stdin in 1 MiB chunks; the server passes them on as the processes read them.
_STREAMING_TRAINER = """
import asyncio, json, sys
import grpc
import pytest
from orchestrator.client.sdk import EnvfleetClient
from protos import orchestrator_pb2 as pb

async def main(address: str, sid: str, n: int, size: int) -> None:
    async with EnvfleetClient(address) as c:
        async def one() -> str:
            async def inputs():
                yield pb.ExecInput(request=pb.ExecRequest(sandbox_id=sid, shell="sleep 1; wc -c", timeout_s=300))
                for _ in range(size >> 20):
                    yield pb.ExecInput(stdin=b"s" * (1 << 20))
            out = b""
            try:
                async for ev in c.sandbox_stub.ExecStream(inputs()):
                    out += ev.stdout
            except grpc.aio.AioRpcError as e:
                return f"{e.code().name}: {e.details()}"
            return out.decode().strip()
        print(json.dumps(await asyncio.gather(*(one() for _ in range(n)))))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
"""


async def streamed_stdin_growth(orch_address: str, sid: str, n: int, size: int) -> tuple[list[str], int]:
    """`n` concurrent ExecStreams of `size` bytes of stdin each from another process: their outcomes (wc -c) and
    this process's peak RSS growth while they ran."""
    async with peak_rss_growth() as growth:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _STREAMING_TRAINER,
            orch_address,
            sid,
            str(n),
            str(size),
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
    return json.loads(out), growth[0]


async def test_streamed_stdin_is_not_buffered(tmp_path: Path, base_image: str) -> None:
    """Real envd: 8 ExecStreams with 100 MiB of stdin each, all at once, past every stdin cap (a streamed chunk is
    never held whole). Before (8 unary Execs of 50 MiB, no caps): the server grew from 100 MiB to 1.6 GiB; the unary
    Exec still refuses stdin over its cap. Streamed: the server holds what gRPC's flow-control windows let in."""
    async with serve(tmp_path) as orch, EnvfleetClient(orch.address) as c:
        ss = c.sandbox_stub
        sid = (await ss.Create(pb.CreateSandboxRequest(image=base_image, limits=pb.SandboxLimits(cpus=2)))).sandbox_id
        outcomes, growth = await streamed_stdin_growth(orch.address, sid, 8, 100 * MiB)
        assert outcomes == [str(100 * MiB)] * 8, outcomes
        # 800 MiB of stdin went through. The server grows by what gRPC's flow-control windows on both hops of 8 calls
        # let in, plus allocator slack, whatever the size: 56-66 MiB in 12 runs with the server's bandwidth probing
        # off (93-771 MiB with it on, windows grown by the probe). Holding the stdin takes 800 MiB at least.
        assert growth < 400 * MiB, f"the server grew by {growth / MiB:.0f} MiB"
        await expect_error(
            ss.Exec(pb.ExecRequest(sandbox_id=sid, shell="wc -c", stdin=b"x" * (17 * MiB))),
            EXHAUSTED,
            "caps.exec_stdin_bytes",
        )
        await ss.Delete(pb.DeleteSandboxRequest(sandbox_id=sid))


async def _until_written(ss: Any, sid: str, path: str, content: bytes) -> None:
    """Wait until the sandbox's file at `path` holds `content` (read with Execs of its own)."""
    async with asyncio.timeout(60):
        while True:
            read = pb.ExecRequest(sandbox_id=sid, shell=f"cat {path} 2>/dev/null")
            if b"".join([ev.stdout async for ev in ss.Exec(read)]) == content:
                return
            await asyncio.sleep(0.1)


async def test_an_exec_stream_cut_short_by_a_message_that_does_not_parse_stops_its_command(
    tmp_path: Path, base_image: str
) -> None:
    """Real envd: a later message that does not parse ended the command's stdin, so the command ran on with part of
    its input (here: a write cut short, then the step after it) before the caller got INVALID_ARGUMENT. Now it is
    stopped where it stands: what came after the end of its input never runs."""
    async with serve(tmp_path) as orch, EnvfleetClient(orch.address) as c:
        ss = c.sandbox_stub
        sid = (await ss.Create(pb.CreateSandboxRequest(image=base_image))).sandbox_id
        request = pb.ExecRequest(sandbox_id=sid, shell="cat > /tmp/input; touch /tmp/ran", timeout_s=60)

        async def frames() -> AsyncIterator[bytes]:
            yield pb.ExecInput(request=request).SerializeToString()
            yield pb.ExecInput(stdin=b"the first half").SerializeToString()
            await _until_written(ss, sid, "/tmp/input", b"the first half")  # the command runs and has read it
            yield b"\xff"  # a tag that is no field: not a message

        await expect_unreadable_exec_stream(orch.address, frames(), 30)
        check = "sleep 1; test -e /tmp/ran && echo ran || echo stopped; cat /tmp/input"
        out = b"".join([ev.stdout async for ev in ss.Exec(pb.ExecRequest(sandbox_id=sid, shell=check))])
        assert out.decode() == "stopped\nthe first half", out
        await ss.Delete(pb.DeleteSandboxRequest(sandbox_id=sid))


async def test_an_exec_stream_its_caller_cancels_stops_its_command(tmp_path: Path, base_image: str) -> None:
    """Real envd: a caller that goes mid-stdin (its call cancelled) stops the command; its stdin does not end, which
    would let it run on with part of its input."""
    async with serve(tmp_path) as orch, EnvfleetClient(orch.address) as c:
        ss = c.sandbox_stub
        sid = (await ss.Create(pb.CreateSandboxRequest(image=base_image))).sandbox_id
        request = pb.ExecRequest(sandbox_id=sid, shell="cat > /tmp/input; touch /tmp/ran", timeout_s=60)
        sent = asyncio.Event()

        async def inputs() -> AsyncIterator[pb.ExecInput]:
            yield pb.ExecInput(request=request)
            yield pb.ExecInput(stdin=b"the first half")
            sent.set()
            await asyncio.sleep(60)

        call = ss.ExecStream(inputs())
        assert (await call.read()).WhichOneof("event") == "started"
        await sent.wait()
        await _until_written(ss, sid, "/tmp/input", b"the first half")  # the command has read it
        call.cancel()
        check = "sleep 2; test -e /tmp/ran && echo ran || echo stopped; cat /tmp/input"
        out = b"".join([ev.stdout async for ev in ss.Exec(pb.ExecRequest(sandbox_id=sid, shell=check))])
        assert out.decode() == "stopped\nthe first half", out
        await ss.Delete(pb.DeleteSandboxRequest(sandbox_id=sid))


async def test_a_cancelled_callers_stdin_does_not_end_before_the_cancel_arrives() -> None:
    # gRPC ends a cancelled caller's messages as it ends a closed call's, and cancels the handler a few loop turns
    # later: stdin ended at once, and under load its end reached envd first (a clean-clone CI run: the test above
    # found "ran", the command run to its end on half its input)
    from orchestrator.server.trainer_services import _StreamedStdin

    async def rest() -> AsyncIterator[pb.ExecInput]:
        yield pb.ExecInput(stdin=b"the first half")  # then the caller cancelled

    stdin = _StreamedStdin(pb.ExecInput(request=pb.ExecRequest()), rest())
    got: list[bytes] = []
    ended = False

    async def feed() -> None:
        nonlocal ended
        async for chunk in stdin.chunks():
            got.append(chunk)
        ended = True

    task = asyncio.ensure_future(feed())
    for _ in range(5):  # the handler's cancellation, as gRPC delivers it
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert got == [b"the first half"] and not ended


async def test_exec_stream_needs_the_request_first(tmp_path: Path) -> None:
    async with serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as c:

        async def inputs() -> AsyncIterator[pb.ExecInput]:
            yield pb.ExecInput(stdin=b"data")

        await expect_error(
            c.sandbox_stub.ExecStream(inputs()),
            grpc.StatusCode.INVALID_ARGUMENT,
            "the first message of ExecStream must be the request",
        )


async def test_pools_nothing_uses_are_forgotten_with_their_metric_series() -> None:
    # each distinct lease (a tenant's rollout_timeout_s, a raw sandbox's ttl_s) was a pool of its own, kept for good
    # with two metric series, however briefly it was used
    assert lease_for(600) == lease_for(3000) == 3600 and lease_for(3541) == lease_for(7000) == 7200
    backend = FakeBackend(FakeBackendConfig(owner=TEST_OWNER))
    pool = SandboxPool(backend, PoolConfig(rate_window_s=0.2, idle_ttl_s=0.3))  # what it refilled expires soon
    pool.start()
    try:
        for n in range(20):
            sandbox, _ = await pool.acquire(SandboxSpec(image=FAKE_BASE_IMAGE, ttl_s=4000.0 + n))
            await pool.release(sandbox, recycle=False)
        assert len(pool.stats()) == 20
        for _ in range(100):  # the refiller looks at every pool once a second
            if not pool.stats():
                break
            await asyncio.sleep(0.1)
        assert pool.stats() == {}
        gauges = ("envfleet_pool_idle", "envfleet_pool_target")
        assert [s for m in pool.metrics.registry.collect() if m.name in gauges for s in m.samples] == []
        # a forgotten key works again
        sandbox, _ = await pool.acquire(SandboxSpec(image=FAKE_BASE_IMAGE, ttl_s=4000.0))
        await pool.release(sandbox, recycle=True)
    finally:
        await pool.close()
        await backend.close()


@contextlib.asynccontextmanager
async def _unread_call(address: str, method: str, request: bytes) -> AsyncIterator[None]:
    """A gRPC call over raw HTTP/2 from a client that never reads its reply: its window for the reply is 0, so the
    server cannot send a byte of it. The call ends (cancelled) when the block exits."""
    import h2.config
    import h2.connection
    import h2.settings

    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    sid = conn.get_next_available_stream_id()
    headers = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", method),
        (":authority", address),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    conn.send_headers(sid, headers)
    conn.send_data(sid, b"\0" + len(request).to_bytes(4, "big") + request, end_stream=True)
    writer.write(conn.data_to_send())
    await writer.drain()

    async def answer_pings() -> None:  # settings and pings are answered; the reply's window never opens
        while data := await reader.read(65536):
            conn.receive_data(data)
            writer.write(conn.data_to_send())

    pump = asyncio.create_task(answer_pings())
    try:
        yield
    finally:
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
        writer.close()


async def test_file_replies_a_client_never_reads_count_against_its_tenant_until_they_end(tmp_path: Path) -> None:
    # a reply waits in the server until its client reads it: ReadFile and Download of 32 MiB each, from clients that
    # never read, pinned the server's memory without bound (nothing counted them once their handler returned)
    caps = {"read_bytes_per_tenant": 5 * MiB}
    async with (
        serve(tmp_path, backend=FAKE, caps=caps, sandboxes={"max_output": 4 * MiB}) as orch,
        EnvfleetClient(orch.address) as c,
    ):
        assert orch.sandboxes is not None
        replies = orch.sandboxes._replies
        ss = c.sandbox_stub
        sid = (await ss.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))).sandbox_id
        await ss.WriteFile(pb.SandboxWriteFileRequest(sandbox_id=sid, path="big", content=b"x" * (3 * MiB)))
        read_big = pb.SandboxReadFileRequest(sandbox_id=sid, path="big")
        assert len((await ss.ReadFile(read_big)).content) == 3 * MiB  # alone, it fits
        async with _unread_call(orch.address, "/envfleet.v1.SandboxService/ReadFile", read_big.SerializeToString()):
            for _ in range(100):  # its reply is made, and waits for a window that never opens
                if replies.held(LOCAL_TENANT) == 3 * MiB:
                    break
                await asyncio.sleep(0.05)
            assert replies.held(LOCAL_TENANT) == 3 * MiB
            # another 3 MiB reply waits its turn (a read is counted at its 4 MiB cap while it runs)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ss.ReadFile(read_big, timeout=1.0)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            small = pb.SandboxReadFileRequest(sandbox_id=sid, path="big", max_bytes=MiB)
            assert len((await ss.ReadFile(small)).content) == MiB  # one that fits goes at once
        waited = ss.ReadFile(read_big, timeout=30)  # the unread call ended: its 3 MiB came back
        assert len((await waited).content) == 3 * MiB
        # given back when the server's call ends, which may come a few loop turns after this client has the reply
        # (asserted at once, the full suite failed it under load)
        for _ in range(100):
            if replies.held(LOCAL_TENANT) == 0:
                break
            await asyncio.sleep(0.05)
        assert replies.held(LOCAL_TENANT) == 0
        # and Download's reply the same way
        download = pb.SandboxDownloadRequest(sandbox_id=sid, path="big")
        async with _unread_call(orch.address, "/envfleet.v1.SandboxService/Download", download.SerializeToString()):
            for _ in range(100):
                if replies.held(LOCAL_TENANT) > 3 * MiB:  # the tar of a 3 MiB file
                    break
                await asyncio.sleep(0.05)
            assert replies.held(LOCAL_TENANT) > 3 * MiB
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ss.Download(download, timeout=1.0)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len((await ss.Download(download, timeout=30)).tar) > 3 * MiB
        for _ in range(100):
            if not replies.held(LOCAL_TENANT):
                break
            await asyncio.sleep(0.05)
        assert replies.held(LOCAL_TENANT) == 0


async def test_a_tenants_reply_budget_goes_in_turns_and_refuses_what_never_fits() -> None:
    budget = TenantBytes(10, "caps.read_bytes_per_tenant", "bytes of replies")
    with pytest.raises(QuotaExceededError, match=r"11 bytes of replies asked for at once; caps\.read_bytes_per_tenant"):
        await budget.take("a", 11)
    first = await budget.take("a", 8)
    other = await budget.take("b", 10)  # another tenant's budget is its own
    second = asyncio.create_task(budget.take("a", 5))
    third = asyncio.create_task(
        budget.take("a", 1)
    )  # it would fit, but waits behind the second: first come, first served
    gone = asyncio.create_task(budget.take("a", 2))
    await asyncio.sleep(0.01)
    assert not second.done() and not third.done()
    gone.cancel()  # a waiting call cancelled leaves the line
    await asyncio.gather(gone, return_exceptions=True)
    first.shrink(4)  # a reply smaller than its cap keeps only its size
    taken = await second
    assert (await third).amount == 1 and budget.held("a") == 10
    first.release()
    first.release()  # once
    taken.release()
    assert budget.held("a") == 1 and budget.held("b") == 10
    other.release()
    late = asyncio.create_task(budget.take("a", 10))
    await asyncio.sleep(0.01)
    late.cancel()
    await asyncio.gather(late, return_exceptions=True)
    assert budget.held("a") == 1 and not budget._waiting


async def test_a_read_as_large_as_the_tenants_budget_still_reads(tmp_path: Path) -> None:
    # ReadFile reads a byte past its cap to say whether the file went on: the budget was asked for that byte too,
    # and a budget of exactly the cap refused every read at its cap
    caps = {"read_bytes_per_tenant": 1 * MiB}
    async with (
        serve(tmp_path, backend=FAKE, caps=caps, sandboxes={"max_output": 1 * MiB}) as orch,
        EnvfleetClient(orch.address) as c,
    ):
        ss = c.sandbox_stub
        sid = (await ss.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))).sandbox_id
        await ss.WriteFile(pb.SandboxWriteFileRequest(sandbox_id=sid, path="big", content=b"x" * (2 * MiB)))
        got = await ss.ReadFile(pb.SandboxReadFileRequest(sandbox_id=sid, path="big"))
        assert len(got.content) == 1 * MiB and got.truncated
        await ss.Delete(pb.DeleteSandboxRequest(sandbox_id=sid))


async def test_writes_and_uploads_in_flight_are_capped_per_tenant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # each WriteFile or Upload holds its content about four times over until envd has it, and nothing counted them:
    # 100 writes of 63 MiB to a sandbox whose envd is slow held some 20 GiB. Past the cap a call is refused at once,
    # busy (its message let go), and the budget comes back as calls end
    from orchestrator.backends.fake.backend import FakeSandbox
    from orchestrator.client.busy import retry_after

    envd_slow = asyncio.Event()
    write = FakeSandbox.write_file

    async def slow_write(self: FakeSandbox, path: str, data: bytes, *a: Any, **kw: Any) -> None:
        if path.startswith("slow"):
            await envd_slow.wait()
        await write(self, path, data, *a, **kw)

    monkeypatch.setattr(FakeSandbox, "write_file", slow_write)
    async with (
        serve(tmp_path, backend=FAKE, caps={"write_bytes_per_tenant": 3 * MiB}) as orch,
        EnvfleetClient(orch.address) as c,
    ):
        ss = c.sandbox_stub
        sid = (await ss.Create(pb.CreateSandboxRequest(image=FAKE_BASE_IMAGE))).sandbox_id
        first = ss.WriteFile(pb.SandboxWriteFileRequest(sandbox_id=sid, path="slow", content=b"x" * (2 * MiB)))
        await asyncio.sleep(0.3)  # it holds 2 MiB of the tenant's 3
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ss.WriteFile(pb.SandboxWriteFileRequest(sandbox_id=sid, path="b", content=b"y" * (2 * MiB)))
        assert e.value.code() == EXHAUSTED and "caps.write_bytes_per_tenant is 3145728 per tenant" in str(
            e.value.details()
        )
        assert retry_after(e.value) == 1.0
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as t:
            info = tarfile.TarInfo("big")
            info.size = 2 * MiB
            t.addfile(info, io.BytesIO(b"z" * info.size))
        await expect_error(
            ss.Upload(pb.SandboxUploadRequest(sandbox_id=sid, dest_dir=".", tar=tar.getvalue())),
            EXHAUSTED,
            "caps.write_bytes_per_tenant",
        )
        envd_slow.set()
        await first
        await ss.WriteFile(pb.SandboxWriteFileRequest(sandbox_id=sid, path="b", content=b"y" * (2 * MiB)))  # room
        await ss.Delete(pb.DeleteSandboxRequest(sandbox_id=sid))


async def test_list_replies_a_client_never_reads_count_against_its_tenant_until_they_end(tmp_path: Path) -> None:
    # a list reply (List, ListJobs, a sandboxes' List) waits here until its client reads it, and nothing counted it
    # once its handler had returned: 100 unread List calls of 1.7 MiB each held 534 MiB of the control plane
    async with serve(tmp_path, backend=FAKE) as orch, EnvfleetClient(orch.address) as c:
        size = (await c.env_stub.List(pb.ListEnvironmentsRequest())).ByteSize()
    caps = {"read_bytes_per_tenant": size + size // 2}
    async with serve(tmp_path, backend=FAKE, caps=caps) as orch, EnvfleetClient(orch.address) as c:
        listing = pb.ListEnvironmentsRequest().SerializeToString()
        async with _unread_call(orch.address, "/envfleet.v1.EnvironmentService/List", listing):
            await expect_error(
                _listed_when_room(c), grpc.StatusCode.RESOURCE_EXHAUSTED, "bytes of list replies to your calls"
            )
            assert len((await c.rollout_stub.ListJobs(pb.ListJobsRequest())).jobs) == 0  # a small one still fits
        for _ in range(100):  # the unread call ended: its bytes came back
            try:
                await c.env_stub.List(pb.ListEnvironmentsRequest())
                break
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.05)
        assert len((await c.env_stub.List(pb.ListEnvironmentsRequest())).environments) > 0


async def _listed_when_room(c: EnvfleetClient) -> pb.ListEnvironmentsResponse:
    """The second List, once the first (unread) holds its bytes: it is refused."""
    for _ in range(100):
        try:
            await c.env_stub.List(pb.ListEnvironmentsRequest())
        except grpc.aio.AioRpcError:
            raise
        await asyncio.sleep(0.05)  # the unread call's reply is not made yet
    raise AssertionError("the unread List's reply was never counted")


def test_one_list_reply_always_goes_and_the_rest_fit_the_budget() -> None:
    # a reply past the cap alone was refused busy for good: nothing held could ever make room for it
    from orchestrator.core.errors import BusyError
    from orchestrator.server.replies import UnreadReplies

    class Call:
        def __init__(self) -> None:
            self.ends: list[Any] = []

        def add_done_callback(self, end: Any) -> None:
            self.ends.append(end)

    budget = UnreadReplies(10, "caps.read_bytes_per_tenant (list replies)")
    big, first = pb.ListEnvironmentsResponse(environments=[pb.EnvironmentInfo(name="x" * 20)]), Call()
    assert budget.hold("t", big, first) is big and budget.held("t") == big.ByteSize() > 10  # alone: it goes
    with pytest.raises(BusyError, match="bytes of list replies to your calls are not read yet"):
        budget.hold("t", pb.ListEnvironmentsResponse(environments=[pb.EnvironmentInfo(name="y")]), Call())
    assert budget.hold("other", big, Call()) is big  # the budget is the tenant's
    for end in first.ends:
        end(None)
    assert budget.held("t") == 0
